"""Op-level capture for PyTorch: ``watch(model, ops=True)`` and ``escalate=True``.

While a watched forward pass runs, a ``TorchFunctionMode`` sees every torch operation the
model's code calls (``torch.log``, ``F.gelu``, ``x + y``, ``.detach()``), one call level deep:
the operations inside a torch function (``F.multi_head_attention_forward``) run with the mode
popped, so each row is an operation the code wrote. Each floating output that requires a
gradient gets the adapter's gradient hook (the gradient becomes a row of kind ``"op"``) and a
finiteness check (one reduction, read at the step's single host sync).

Most op outputs are also a layer's output (``F.linear`` inside ``nn.Linear``): measuring the
same gradient twice would double the cost of capture. So an op output is held until the module
it ran in returns; if it is the output of a watched layer, the op's row is a copy of the layer's
row, measured once; otherwise the op output gets a gradient hook and a finiteness check of its
own then. A held output that is about to be written in place (``add_``, ``x[i] = v``,
``F.relu(x, inplace=True)``) is hooked first, so that its row stays the gradient of the value
the op produced.

The package's modules, whose imports point one way (``capture`` → ``flow`` → ``sites``):

- :mod:`~graddebug_torch.ops.sites`: naming an op's site (``<op>@<file>:<line>`` in the module
  it ran in) from the user's frame behind the call;
- :mod:`~graddebug_torch.ops.flow`: value flow and cuts (``.detach()``, ``no_grad``, a numpy
  round trip), and the op-level events they become when the step closes;
- :mod:`~graddebug_torch.ops.capture`: the mode and :class:`OpCapture`, which records through
  the narrow :class:`OpHost` interface rather than the adapter itself.
"""

from __future__ import annotations

from graddebug_torch.ops.capture import OpCapture, OpHost
from graddebug_torch.ops.sites import OpSite

__all__ = ["OpCapture", "OpHost", "OpSite"]
