"""TensorFlow/Keras adapter for graddebug: wrapped layer calls, taps and statistics kept in TF
state, so that capture works alike in eager mode, inside ``tf.function`` and in ``model.fit``.

Users do not import this package: ``graddebug.watch(model)`` finds it through the
``graddebug`` entry-point group.

Where things are (the same names as in ``graddebug_torch``):

- ``plugin``: the entry point; ``adapter``: the Adapter protocol and its capabilities.
- ``watching``: layer outputs hooked (wrapped ``layer.call``, custom-gradient identities, slots).
- ``captures``: what the hooks fill during a step (state buffers, the flags compiled steps read);
  ``eagerrows``: an eager step's sentinel rows, written into those buffers when it is read.
- ``closing``: the close, one read of the buffers, and the rows turned into records.
- ``params``: watched variables; ``stats``: the statistics' ops; ``outputs``: slots, output
  names and interventions; ``model``: the layers of a Keras model by name.
- ``scaling``: loss scaling; ``distributed``: ``tf.distribute`` replicas.
- ``ops``: op-level capture (``ops.capture``, ``ops.sites``, ``ops.flow``).
- ``callbacks``: the Keras callback; ``v1graph``, ``v1session``: ``tf.compat.v1`` graphs.
"""

from __future__ import annotations

from graddebug_tensorflow._version import __version__

__all__ = ["__version__"]
