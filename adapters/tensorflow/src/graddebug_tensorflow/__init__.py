"""TensorFlow/Keras adapter for graddebug: wrapped layer calls, taps and statistics kept in TF
state, so that capture works alike in eager mode, inside ``tf.function`` and in ``model.fit``.

Users do not import this package: ``graddebug.watch(model)`` finds it through the
``graddebug`` entry-point group.
"""

from __future__ import annotations

__all__: list[str] = []
