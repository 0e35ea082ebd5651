"""Keras 3 on the torch backend: the torch adapter's hooks, with Keras's names.

A Keras layer on this backend is a ``torch.nn.Module`` whose ``__call__`` runs torch's module
hooks, and its variables' values are ``torch.nn.Parameter`` objects that ``loss.backward()``
fills. So :class:`graddebug_torch.adapter.TorchAdapter` does the capture, unchanged: a forward
hook per watched layer attaches the tensor hooks to its outputs, a post-accumulate-grad hook per
variable sees its gradient, and the close reads ``p.grad`` in one transfer. What differs is
where the layers are: Keras keeps its sub-layers in its own tracker, not as torch child
modules, so they are found through Keras (:mod:`graddebug_keras.model`) and named as on the
TensorFlow backend: the Keras layer name, and the variable's short name (``kernel``, ``bias``).
The torch adapter reads the model only through the index it is given
(:class:`KerasTorchIndex`, a :class:`graddebug_torch.model.ModelIndex`), and this class uses
only its public members (``updates``, the adapter protocol), none of its private ones.

Keras's optimizer is not a torch optimizer: the step boundary is the callback's
``on_train_batch_end``, or, with ``watch(model, optimizer=opt)``, the end of ``opt.apply``.
Its ``apply`` is wrapped on the instance to give the torch adapter's update watch
(:attr:`~graddebug_torch.adapter.TorchAdapter.updates`) what torch's
optimizer step hooks give it (the weights sampled before and after the update), so that
parameter rows carry ``weight_norm`` and ``update_norm``; the callback also wraps the model's
``compute_loss`` for the batch's loss row.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import torch

from graddebug.adapter import WatchContext, WatchOptions
from graddebug.adapter.protocol import Distributed, StepClock, TrainingCallback, TrainStep
from graddebug.errors import ConfigError
from graddebug_keras.callbacks import build_callback
from graddebug_keras.model import LayerIndex, channels_first
from graddebug_keras.optimizers import Wrapped, check_keras_optimizer
from graddebug_torch.adapter import TorchAdapter
from graddebug_torch.params import TorchParam

__all__ = ["KerasTorchAdapter", "KerasTorchIndex"]


class KerasTorchIndex:
    """A Keras model's layers and variables as the torch adapter reads a model
    (:class:`graddebug_torch.model.ModelIndex`): Keras's names, leaf layers watched by
    default, each variable's torch tensor under its layer and short name.

    Args:
        model: A Keras layer or model on the torch backend.
    """

    def __init__(self, model: Any) -> None:
        self.keras = LayerIndex(model)

    @property
    def layers(self) -> dict[str, Any]:
        """Every layer below the model by Keras name."""
        return self.keras.named

    def select(self, layers: Sequence[Any] | None) -> dict[str, Any]:
        """The layers ``layers=`` names (see :meth:`graddebug_keras.model.LayerIndex.select`).

        Raises:
            UnknownNameError: A name, glob or type matches no layer.
        """
        return self.keras.select(layers)

    def layer_names(self) -> list[str]:
        """Every layer name, and the model's own."""
        return self.keras.layer_names()

    def name(self, qualified: str) -> str:
        """Keras names are layer names already; the model's own is its Keras name."""
        return qualified or self.keras.root

    def params(self, chosen: Collection[str] | None,
               keep: Collection[str]) -> list[TorchParam]:
        """The trainable variables' torch tensors, of the chosen layers and those inside them.

        Raises:
            ConfigError: A variable holds no torch tensor (a model of another backend).
        """
        index, found = self.keras, []
        for layer, short, var in index.variables():
            chain = index.chain(layer)
            if chosen is not None and not any(name in chosen for name in chain):
                continue
            value = var.value
            if not isinstance(value, torch.Tensor):
                raise ConfigError(
                    f"the variable {var.path!r} of {index.root!r} holds a "
                    f"{type(value).__name__}, not a torch tensor: is the model built on "
                    "another Keras backend?")
            found.append(TorchParam(layer, short, value, chain, keep=layer in keep))
        return found

    def channels_first(self, layer: Any) -> bool:
        """Whether the layer's ``data_format`` is ``channels_first``."""
        return channels_first(layer)

    def keeps_finite(self, layer: Any) -> bool:
        """No Keras layer is assumed to keep finite inputs finite: each output is checked."""
        return False

    def weighted(self, layer: Any) -> bool:
        """No Keras layer is taken as fixed by its input and parameters."""
        return False


class KerasTorchAdapter(TorchAdapter):
    """Watches a Keras model or layer on the torch backend: the torch adapter, reading the
    model through :class:`KerasTorchIndex`, with Keras's optimizer and callback."""

    name = "keras-torch"
    capabilities = frozenset({StepClock, Distributed, TrainStep, TrainingCallback})
    # Not scaler=: Keras's fit never calls a torch GradScaler (its loss scaling is a
    # LossScaleOptimizer), so dividing by that scaler's scale would make every row wrong.
    watch_options = frozenset({"params", "layers", "keep", "intervene", "outputs", "param_stats",
                               "optimizer", "ops", "escalate", "full_stats_every"})

    def __init__(self, context: WatchContext, model: Any, params: Mapping[str, Any] | None,
                 options: WatchOptions) -> None:
        keras_index = KerasTorchIndex(model)
        super().__init__(context, model, params, options, index=keras_index)
        self._keras = keras_index.keras
        self._wrapped: list[Wrapped] = []
        # Per wrapped optimizer (by id): what to call after each of its applies.
        self._applies: dict[int, list[Callable[[], None]]] = {}
        self._loss: Any = None  # the tensor compute_loss returned last in training

    # -- the step boundary ------------------------------------------------------------------

    def follow_optimizer(self, optimizer: Any, on_step: Callable[[], None]) -> None:
        """Call ``on_step`` after each ``optimizer.apply`` of a Keras optimizer (its
        ``apply_gradients`` goes through it), until ``detach``: the gradients are still on
        ``p.grad`` then.

        Raises:
            ConfigError: ``optimizer`` is not a Keras optimizer.
        """
        check_keras_optimizer(optimizer)
        self._measure(optimizer).append(on_step)

    def _measure(self, optimizer: Any) -> list[Callable[[], None]]:
        """Wrap ``optimizer.apply`` once: the update watch samples the weights before and
        after it, as around a torch optimizer's step, then the callbacks returned (a list to
        add to) run. ``apply`` updates the variables' torch tensors in place."""
        key = id(optimizer)
        if key in self._applies:
            return self._applies[key]
        after: list[Callable[[], None]] = []
        self._applies[key] = after
        updates = self.updates
        groups = _ParamGroups(self._keras.model)

        def apply(original: Callable[..., Any]) -> Callable[..., Any]:
            def applied(*args: Any, **kwargs: Any) -> Any:
                updates.before_step(groups)
                out = original(*args, **kwargs)
                updates.after_step(groups)
                for on_step in after:
                    on_step()
                return out
            return applied

        self._wrapped.append(Wrapped(optimizer, "apply", apply))
        return after

    def _prepare_fit(self, model: Any) -> None:
        """When ``fit`` begins: measure its optimizer's updates, and keep the loss that the
        model's ``compute_loss`` returns in training."""
        if getattr(model, "optimizer", None) is not None:
            self._measure(model.optimizer)

        def compute_loss(original: Callable[..., Any]) -> Callable[..., Any]:
            @functools.wraps(original)  # Keras reads its signature (a training= argument?)
            def computed(*args: Any, **kwargs: Any) -> Any:
                loss = original(*args, **kwargs)
                if kwargs.get("training", True):
                    self._loss = loss
                return loss
            return computed

        if not any(w.obj is model and w.attr == "compute_loss" for w in self._wrapped):
            self._wrapped.append(Wrapped(model, "compute_loss", compute_loss))

    def _batch_loss(self) -> float | None:
        """The loss of the batch just trained, as a number (one read), or None."""
        loss, self._loss = self._loss, None
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            return None
        return float(loss.detach())

    def detach(self) -> None:
        """Unwrap the optimizers and the model, then everything the torch adapter installed."""
        while self._wrapped:
            self._wrapped.pop().restore()
        self._applies.clear()
        self._loss = None
        super().detach()

    # -- Training capability ----------------------------------------------------------------

    def train_step(self, inputs: Any, loss_args: tuple[Any, ...], loss_fn: Any,
                   optimizer: Any) -> Sequence[Any] | None:
        """Zero the gradients, back-propagate ``loss_fn(model(inputs), *loss_args)``, and
        apply a Keras ``optimizer`` when given (as Keras's own train step does). Gradients
        stay on ``p.grad`` for ``close_step``."""
        if optimizer is not None:
            check_keras_optimizer(optimizer)
        super().train_step(inputs, loss_args, loss_fn, None)
        if optimizer is not None:
            variables = self._keras.model.trainable_variables
            with torch.no_grad():
                optimizer.apply([v.value.grad for v in variables], variables)
        return None

    def callback(self, **options: Any) -> Any:
        """Return a Keras callback bound to this Watcher (``model.fit(callbacks=[...])``).

        Args:
            **options: ``stop_on=``, ``log=`` and ``every_tensor=`` of
                :class:`graddebug_keras.callbacks.GradDebugCallback`.

        Raises:
            ConfigError: An option that is not the callback's.
        """
        return build_callback(self._ctx, self._prepare_fit, options, loss=self._batch_loss)


class _ParamGroups:
    """A Keras model's trainable variables in the one shape of a torch optimizer that the
    update watch reads: ``param_groups``, a list of dicts with their ``params`` (the variables'
    torch tensors, which Keras updates in place)."""

    def __init__(self, model: Any) -> None:
        self._model = model

    @property
    def param_groups(self) -> list[dict[str, list[torch.Tensor]]]:
        """One group of every trainable variable's tensor, read anew (layers may be added)."""
        return [{"params": [v.value for v in self._model.trainable_variables]}]

