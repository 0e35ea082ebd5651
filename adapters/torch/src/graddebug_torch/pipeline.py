"""Pipeline parallelism: a ``torch.distributed.pipelining`` schedule, watched whole.

``graddebug.watch(schedule)`` on every rank, with the schedule that runs this rank's stage
(``ScheduleGPipe``, ``Schedule1F1B``: one stage per rank), then ``schedule.step(...)`` and
``dbg.step()`` (or ``optimizer=``) as usual. The stage's module is watched: layers and
parameters keep the model's own names when each rank builds the whole model and deletes the
layers of the other stages (as torchtitan does).

Why the schedule and not the stage's module: a layer-output row depends on two things that the
module cannot tell. Each micro-batch's backward hands a layer's output the gradient of *that
micro-batch's* loss, and the rows pool the micro-batches as they pool a module called several
times (sums of squares add, ``absmax`` is the largest, a unit is dead if dead in every call).
With ``scale_grads=True`` (a loss that averages, the default) the schedule divides the
parameter gradients by the number of micro-batches M after the backward passes, and nothing
divides the outputs' gradients: they are those of M times the global batch's loss. Counting the
module's calls would give M (the shape inference pass of the first step aside), but not
whether the schedule scales; a wrong guess would be a row off by a factor M that looks right.
The schedule knows both, and they are read from it when each step closes.

The rows are those of one process trained on the global batch:

- a parameter row is the stage's own parameter's gradient as the optimizer applies it (after
  the schedule's scaling); the stage alone holds it;
- a layer-output (or tap, or op) row pools the micro-batches and, where the schedule scales,
  divides the gradient's values by M (norm, mean, std, ``absmax``, the norm before an
  intervention; kept arrays too);
- every row is whole (:data:`~graddebug.adapter.ranks.WHOLE`): the core combines the ranks'
  rows into their union, every stage's rows on every rank, in the model's order (stage ``s``
  runs on rank ``s``), so the findings and the run files hold each layer once.

The first ``schedule.step()`` runs torch's metadata inference: one forward and one backward
pass through the stage's module on one micro-batch's worth of placeholders. What graddebug
captured in the open step up to the end of each of those passes is dropped.

Refused, with a :class:`~graddebug.errors.ConfigError` that says what to do: a schedule that
runs several stages per rank (interleaved, zero-bubble V schedules), a pipeline group that does
not span the world (data-parallel replicas of each stage), a stage whose index is not its rank,
a stage module wrapped for data parallelism, and a ``clip_norm``/``clip_value`` intervention,
which would act on one micro-batch's gradient rather than the global batch's.
"""

from __future__ import annotations

import gc
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from torch import nn

from graddebug.adapter import StepResult, WatchContext, WatchOptions
from graddebug.capture.layers import keep_label
from graddebug.errors import ConfigError
from graddebug.records import Kind, Record
from graddebug_torch.adapter import TorchAdapter
from graddebug_torch.params import ParamRow
from graddebug_torch.sharding import RankRows

__all__ = ["PipelineAdapter", "StageRows", "claim", "is_schedule", "stage_of"]

_SCHEDULES = "torch.distributed.pipelining.schedules"
_STAGES = "torch.distributed.pipelining.stage"
# The stage's metadata inference (torch >= 2.10); older torches infer shapes under no_grad,
# where graddebug's hooks record nothing.
_INFERENCE = ("_forward_metadata_inference", "_backward_metadata_inference")
_PARAMETER = Kind.PARAMETER.value


def is_schedule(target: object) -> bool:
    """Whether ``target`` is a ``torch.distributed.pipelining`` schedule (checked only once
    the user imported the pipelining package)."""
    schedules = sys.modules.get(_SCHEDULES)
    if schedules is None:
        return False
    kinds = tuple(getattr(schedules, name) for name in ("PipelineScheduleSingle",
                                                         "PipelineScheduleMulti")
                  if isinstance(getattr(schedules, name, None), type))
    return bool(kinds) and isinstance(target, kinds)


def claim(target: object) -> type[PipelineAdapter] | None:
    """The adapter of a pipeline schedule; None for anything else.

    Raises:
        ConfigError: ``target`` is the module a pipeline stage runs: on its own it cannot say
            how many micro-batches ran nor whether the schedule scales the gradients.
    """
    if is_schedule(target):
        return PipelineAdapter
    index = _stage_index_running(target)
    if index is not None:
        raise ConfigError(
            f"watch({type(target).__name__}): it is the module of pipeline stage {index}, "
            "whose layer outputs get each micro-batch's gradient; the module alone cannot say "
            "how many micro-batches ran nor whether the schedule scales the gradients. Pass "
            "the schedule instead: graddebug.watch(schedule).")
    return None


def _stage_index_running(module: object) -> int | None:
    """The index of the live pipeline stage that runs ``module``, or None.

    Asked only once the user imported the pipelining package, once per ``watch``: the stage
    is found among the objects that refer to the module (tens of milliseconds for half a
    million live objects).
    """
    stages = sys.modules.get(_STAGES)
    base = getattr(stages, "_PipelineStageBase", None)
    if not isinstance(base, type) or not isinstance(module, nn.Module):
        return None
    for referrer in gc.get_referrers(module):
        # An instance, or its __dict__ where the interpreter keeps one.
        found = vars(referrer) if isinstance(referrer, base) else referrer
        if (isinstance(found, dict) and found.get("submod") is module
                and isinstance(found.get("stage_index"), int)):
            return int(found["stage_index"])
    return None


def stage_of(schedule: Any) -> Any:
    """The one stage a schedule runs on this rank.

    Raises:
        ConfigError: The schedule runs several stages on this rank, or none.
    """
    stage = getattr(schedule, "_stage", None)
    if stage is None:
        stages = getattr(schedule, "_stages", None) or []
        raise ConfigError(
            f"{type(schedule).__name__} runs {len(stages)} stages on this rank; graddebug "
            "watches schedules with one stage per rank (ScheduleGPipe, Schedule1F1B). Use one "
            "of those, or watch(stage.submod) on a single process.")
    return stage


def _check_placement(stage: Any) -> None:
    """Refuse a pipeline whose ranks' rows the core could not order or combine.

    Raises:
        ConfigError: The pipeline group does not span the world, the stage's index is not
            its rank, or the stage's module is wrapped for data parallelism.
    """
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    size = int(getattr(stage, "group_size", world))
    index = int(stage.stage_index)
    if size != world or int(stage.num_stages) != world:
        raise ConfigError(
            f"pipeline stage {index}: its group has {size} ranks and the pipeline "
            f"{stage.num_stages} stages in a world of {world}; graddebug combines pipelines "
            "whose stages are the whole world, one per rank (data-parallel replicas of each "
            "stage are not covered).")
    if index != rank:
        raise ConfigError(
            f"pipeline stage {index} runs on rank {rank}; graddebug orders the layers by rank, "
            "so stage s must run on rank s.")
    kind = type(stage.submod).__name__
    if kind in ("DistributedDataParallel", "FullyShardedDataParallel") or kind.startswith(
            ("FSDP", "Replicate")):
        raise ConfigError(
            f"pipeline stage {index}: its module is a {kind}; graddebug does not combine a "
            "pipeline with data parallelism. Watch a pipeline of plain modules.")


def _check_interventions(options: WatchOptions) -> None:
    """Refuse clips: they would act on one micro-batch's gradient, not the global batch's.

    Raises:
        ConfigError: An ``intervene=`` entry clips.
    """
    for name, spec in options.intervene.items():
        if spec.clip_norm is not None or spec.clip_value is not None:
            raise ConfigError(
                f"intervene={{{name!r}: ...}} clips, and under a pipeline schedule each "
                "micro-batch's backward would clip its own gradient, not the global batch's. "
                "Use mask= or scale=, or clip the parameters' gradients before the optimizer "
                "steps.")


class PipelineAdapter(TorchAdapter):
    """Watches the stage a pipeline schedule runs on this rank (see the module's docstring).

    Args:
        context: The Watcher.
        model: The schedule (``ScheduleGPipe``, ``Schedule1F1B``).
        params: Named tensors recorded as parameters, or None.
        options: The validated ``watch`` options.

    Raises:
        ConfigError: The schedule or its placement is not covered, or an intervention clips.
    """

    def __init__(self, context: WatchContext, model: Any, params: Mapping[str, Any] | None,
                 options: WatchOptions) -> None:
        stage = stage_of(model)
        _check_placement(stage)
        _check_interventions(options)
        if not isinstance(stage.submod, nn.Module):
            raise ConfigError(
                f"pipeline stage {stage.stage_index} runs a {type(stage.submod).__name__}, "
                "not a torch.nn.Module; graddebug watches stages built from modules.")
        super().__init__(context, stage.submod, params, options)
        self._schedule = model
        self._stage = stage
        self._patched: list[str] = []

    def attach(self) -> None:
        """Attach the module's hooks, and drop what they capture in the first step's
        metadata inference (each inference method of the stage wrapped on the instance)."""
        super().attach()
        if self._ranks is not None:
            layers = self._layers
            self._ranks = StageRows(
                self._ranks.layouts.world,
                lambda name: name in layers and layers[name].channels_first,
                self._ctx.warn_once, self._global_rows)
            self._watch.layouts = self._ranks.layouts
        stage = self._stage
        for name in _INFERENCE:
            method = getattr(stage, name, None)
            if callable(method) and name not in vars(stage):
                setattr(stage, name, self._dropping(method))
                self._patched.append(name)

    def _dropping(self, method: Callable[..., Any]) -> Callable[..., Any]:
        """``method``, then the open step's captures dropped."""
        drop = self._watch.drop_step

        def run(*args: Any, **kwargs: Any) -> Any:
            try:
                return method(*args, **kwargs)
            finally:
                drop()
        return run

    def detach(self) -> None:
        """Unwrap the stage's inference methods, then remove every hook."""
        stage = self._stage
        for name in self._patched:
            vars(stage).pop(name, None)
        self._patched.clear()
        super().detach()

    def close_step(self, step: int, grads: Sequence[Any] | None, record: bool) -> StepResult:
        """Close the step as the torch adapter does. With several ranks, :class:`StageRows`
        makes this stage's rows the global batch's before they are combined (or, while an
        exception unwinds, kept); alone, that is done here."""
        result = super().close_step(step, grads, record)
        return result if self._ranks is not None else self._global_rows(result)

    def _global_rows(self, result: StepResult) -> StepResult:
        """This stage's rows made the global batch's: the outputs' gradients divided by the
        number of micro-batches where the schedule scales the parameters' ones (kept arrays
        too), their shapes the global batch's."""
        schedule = self._schedule
        factor = 1.0
        if getattr(schedule, "scale_grads", True):
            factor = 1.0 / int(schedule._n_microbatches)
        first = _splits_first_dim(schedule)
        records = [r if r.kind == _PARAMETER else _global(r, factor, first)
                   for r in result.records]
        kept = result.kept
        if factor != 1.0:
            owned = {keep_label(p.layer, p.tensor) for p in self._params}
            kept = {label: array if label in owned else array * factor
                    for label, array in kept.items()}
        return replace(result, records=records, kept=kept)


class StageRows(RankRows):
    """The ranks' rows combined for pipeline stages: no rank's outputs are a data-parallel
    copy of another's (each stage holds its own layers), and each stage's rows are made the
    global batch's (``to_global``) before the collective.

    Args:
        world: The number of ranks.
        channels_first: Whether a layer's outputs hold their units on axis 1 (by name).
        warn: Warns once per key.
        to_global: Makes this stage's rows the global batch's.
    """

    def __init__(self, world: int, channels_first: Callable[[str], bool],
                 warn: Callable[[str, str], None],
                 to_global: Callable[[StepResult], StepResult]) -> None:
        super().__init__(world, channels_first, warn, data_parallel=False)
        self._to_global = to_global

    def combine(self, step: int, result: StepResult | None, params: Sequence[ParamRow]
                ) -> StepResult:
        """See :meth:`RankRows.combine`; ``result`` is made the global batch's first."""
        local = None
        try:
            local = self._to_global(result) if result is not None else None
        finally:  # the collective runs on every rank, whatever failed here
            combined = super().combine(step, local, params)
        return combined

    def local(self, result: StepResult, params: Sequence[ParamRow]) -> StepResult:
        """See :meth:`RankRows.local`; ``result`` is made the global batch's first."""
        return super().local(self._to_global(result), params)


def _splits_first_dim(schedule: Any) -> bool:
    """Whether the schedule splits its inputs into micro-batches along their first dimension
    (its default chunking), so that the outputs' micro-batches do too."""
    specs = getattr(schedule, "_args_chunk_spec", None)
    return specs is None or all(getattr(s, "split_dim", None) == 0 for s in specs)


def _global(record: Record, factor: float, first: bool) -> Record:
    """The row of an output pooled over the micro-batches: its gradient's values multiplied
    by ``factor``, and, where the micro-batches split the first dimension (``first``), its
    shape the global batch's rather than the first micro-batch's."""
    shape = record.shape
    dims = [int(d) for d in shape.strip("()").split(",") if d.strip()]
    rest = math.prod(dims[1:])
    if (first and dims and rest and record.numel != rest * dims[0]
            and record.numel % rest == 0):
        shape = str((record.numel // rest, *dims[1:]))
    return record._replace(shape=shape, norm=record.norm * factor, mean=record.mean * factor,
                           std=record.std * factor, absmax=record.absmax * factor,
                           pre_norm=record.pre_norm * factor)
