"""Where graddebug meets the tools people train and test with: ``graddebug.check``, the pytest
plugin, and the stop-on logic that the framework callbacks (Keras, Lightning) share."""
