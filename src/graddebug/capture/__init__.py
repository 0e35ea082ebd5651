"""Capture: the Watcher (:mod:`~graddebug.capture.watcher`), the rows of a live run
(:mod:`~graddebug.capture.buffer`), the run's metadata (:mod:`~graddebug.capture.metadata`) and
what adapters share about layers, interventions and the fail-open rule
(:mod:`~graddebug.capture.layers`)."""
