"""Step-time overhead of graddebug on PyTorch: watched over plain, median over pairs of steps.

Run by hand (it is a benchmark, not a test)::

    python benchmarks/overhead_torch.py                       # all workloads, both configs
    python benchmarks/overhead_torch.py --rounds 15 --steps-per-round 10 --workloads mlp
    python benchmarks/overhead_torch.py --profile --workloads transformer
    python benchmarks/overhead_torch.py --compile --workloads mlp,transformer,resnet18

A training step is ``zero_grad, forward, loss, backward, SGD step`` and, when watched,
``dbg.step()`` right after ``backward`` (as the library documents). The plain and the watched side
are twins: two copies of one model, each with its own optimizer, on the same batch, in one
process. Steps are timed one by one in pairs, one plain step of the plain twin and one watched
step of the watched twin back to back, the order flipping from pair to pair; load from elsewhere
on a shared machine comes in bursts far longer than a step, so both steps of a pair meet the same
load and the pair's ratio cancels it. A round is a run of such pairs under one config; the
configs take turns round by round, and the order of the first pair flips from one round to the
next and from one config to the next. Each configuration builds one ``Watcher`` for the watched
twin and enters it around every round, so the plain twin never carries a graddebug hook, and the
one-off cost of entering and leaving (attaching and removing hooks) is timed separately, not
charged to the steps, because a real run enters once for thousands of steps. The ratio of a config
is the median over all its pairs of the watched step's time over the plain one's. Config (c)
records one step in 10, which a median would hide: its ratio is the mean over the positions of
a round of each position's median pair ratio over the rounds (``position_ratio``). Config (n)
runs the watched twin plain too: its ratio is the method's own bias and noise. Next to each
ratio the table gives its 95% bootstrap interval (the rounds resampled with replacement, the
ratio taken again from each resample), and the result column says ``pass`` or ``FAIL`` only
when the whole interval lies on one side of the target, ``within noise`` when it holds the
target.

With ``--compile`` both sides run ``torch.compile``d models, and the script also counts the graph
breaks and compiled graphs of a few steps, plain and under each config, each from a clean dynamo
state (``torch._dynamo.utils.counters``, backend "eager": breaks are dynamo's). Dynamo does not
guard on hooks added to a module after a hook-free graph of its class was compiled
(``torch._dynamo.config.skip_nnmodule_hook_guards``), so the watched side is a copy of the model
under a subclass of its class, compiled apart: sharing one model, the plain rounds' graph would
serve the watched rounds too, without graddebug's hooks. For the same reason each config gets a
compiled watched copy of its own: a config without graddebug, such as (n), would have dynamo
compile a hook-free graph that the next config's rounds would run. The ``rows/step`` column
shows that the watched rounds recorded.

Before any model is built the script fixes glibc's malloc thresholds (``ratios.steady_allocator``;
``--default-allocator`` leaves them). Left to glibc, the twins settle into different page-fault
patterns, set by the order in which the process allocated and freed before: in one measured run
the plain twin took no minor page fault a step and the watched twin 200-320, with graddebug and
with the hand-written floor (g) alike, and compiled twins with no graddebug at all read 0.85 to
1.14 of each other from one pair to the next. With the thresholds fixed, both twins take none.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import cProfile
import gc
import json
import math
import platform
import pstats
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from torch import Tensor, nn
from torch._dynamo.utils import counters
from torch.utils.hooks import RemovableHandle

import graddebug
from graddebug import Watcher
from graddebug_torch.outputs import KEEPS_FINITE, flatten, watched_by_default
from graddebug_torch.stats import DotSums

sys.path.insert(0, str(Path(__file__).resolve().parent))  # ratios.py, also when loaded by path
from ratios import (
    BOOTSTRAP_RESAMPLES,
    alternate,
    bootstrap_interval,
    pair_ratios,
    pairs_estimator,
    quartiles,
    steady_allocator,
    verdict,
)

LossFn = Callable[[Tensor, Tensor], Tensor]

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "overhead_torch.json"
COMPILED_JSON = DEFAULT_JSON.with_name("overhead_torch_compile.json")
WORKLOADS: tuple[str, ...] = ("mlp", "cnn", "transformer", "resnet18", "gpt2")
DEFAULT_WORKLOADS: tuple[str, ...] = ("mlp", "cnn", "transformer")
CENSUS_STEPS = 3
"""Steps run to count graph breaks and compiled graphs (a recompile shows from the second)."""
GRADDEBUG_DIRS: tuple[str, ...] = ("/graddebug/", "/graddebug_torch/")
# The functions through which graddebug's work enters a training step.
ENTRY_POINTS: tuple[str, ...] = ("_on_forward", "_on_grad", "_on_param_grad", "step")


@dataclass(frozen=True)
class Config:
    """One way of watching a model.

    Attributes:
        key: Short name used on the command line and in the JSON.
        label: What it records, for the table.
        options: Keyword options of ``graddebug.watch``.
        target: The largest acceptable median ratio of step times, watched over plain.
    """

    key: str
    label: str
    options: dict[str, Any]
    target: float


CONFIGS: tuple[Config, ...] = (
    Config("a", "(a) params", {"outputs": False}, 1.05),
    Config("b", "(b) params+outputs", {}, 1.15),
    Config("c", "(c) = (b), every 10th", {"every": 10}, 1.03),
    # Op-level capture must stay below detect_anomaly (d), the peer that names the op behind a
    # NaN: (d) measured 1.34x-1.73x here, 1.34x on the CNN. (d) itself is not judged.
    Config("o", "(o) = (b) + ops=True", {"ops": True}, 1.34),
    Config("d", "(d) torch.autograd.detect_anomaly(), no graddebug", {"anomaly": True},
           math.inf),
    # The floor of parameter capture: what any tool must do at least, one fused norm pass over
    # the parameter gradients and one host sync. (a) is judged by its distance to it.
    Config("f", "(f) floor: one _foreach_norm pass, no graddebug", {"floor": True}, math.inf),
    # The floor of output capture: (f), and the sentinel of every output (b) records, taken by
    # hand-written hooks with graddebug's own reductions. (b)'s distance to it is graddebug's
    # bookkeeping; the floor's own distance to (f) is what hooks and reductions cost.
    Config("g", "(g) floor of (b): (f) + hand-written output hooks, no graddebug",
           {"outputs_floor": True}, math.inf),
    # The method's own reading of a monitor that costs nothing: both twins plain.
    Config("n", "(n) null: both twins plain, no graddebug", {"null": True}, math.inf),
)


class _StandIn:
    """Stands for a Watcher in the configs without graddebug: entered once around a round on
    the watched twin, ``step()`` after each backward pass, and no rows or findings."""

    every = 1

    def __enter__(self) -> _StandIn:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def per_step(self) -> contextlib.AbstractContextManager[object]:
        """A context around each watched step; none here."""
        return contextlib.nullcontext()

    def step(self) -> None:
        """Nothing to close."""

    def frame(self) -> list[object]:
        return []

    def findings(self) -> list[object]:
        return []


class _Null(_StandIn):
    """Config (n): the watched twin runs plain too. Its ratio is the method's own bias and
    noise, what a perfect monitor that costs nothing would read."""


class _Anomaly(_StandIn):
    """Config (d): ``torch.autograd.detect_anomaly()``, the peer that names the op behind a
    NaN, for comparison. Anomaly mode is global, so it is set around each watched step only,
    never around the plain twin's steps in between."""

    def per_step(self) -> contextlib.AbstractContextManager[object]:
        """Anomaly mode around one watched step."""
        return torch.autograd.detect_anomaly(check_nan=True)


class _Floor(_StandIn):
    """Config (f): after each backward pass, the norms of every parameter gradient in one
    ``torch._foreach_norm`` pass, read to the host in one sync."""

    def __init__(self, model: nn.Module) -> None:
        self._params = [p for p in model.parameters() if p.requires_grad]

    def step(self) -> list[float]:
        """Measure the parameter gradients, as the cheapest parameter capture would.

        Returns:
            The norms, in parameter order.
        """
        return self._read([])

    def _read(self, scalars: list[Tensor]) -> list[float]:
        """The parameter gradients' norms, then ``scalars``, in one sync."""
        grads = [p.grad for p in self._params if p.grad is not None]
        values: list[float] = torch.cat([torch.stack(torch._foreach_norm(grads)),
                                         *([torch.stack(scalars)] if scalars else [])]).tolist()
        return values


class _OutputsFloor(_Floor):
    """Config (g): (f), and what (b) measures of layer outputs on a step that is not full, by
    hand: a forward hook on each module (b) watches (leaf modules and those with parameters of
    their own) hooks the gradient of each floating output that needs one, for its sum of
    squares and its sum, and sums the output itself where the module could make a NaN or Inf
    (graddebug's forward check). The reductions are graddebug's (``DotSums``); no rows, no
    records, one sync with (f)'s norms."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self._modules = [m for m in model.modules() if watched_by_default(m)]
        self._sums = DotSums()
        self._handles: list[RemovableHandle] = []
        self._scalars: list[Tensor] = []

    def __enter__(self) -> _OutputsFloor:
        self._handles = [m.register_forward_hook(self._forward) for m in self._modules]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._scalars.clear()

    def _forward(self, module: nn.Module, args: Any, output: Any) -> None:
        for _, tensor in flatten(output):  # the outputs (b) watches
            if not (tensor.is_floating_point() and tensor.requires_grad):
                continue
            if type(module) not in KEEPS_FINITE:
                self._scalars.append(self._sums.total(tensor.detach()))
            tensor.register_hook(self._backward)

    def _backward(self, grad: Tensor) -> None:
        self._scalars += self._sums.sentinel(grad)

    def step(self) -> list[float]:
        """Read the parameter gradients' norms and the outputs' sums in one sync.

        Returns:
            The norms in parameter order, then each forward sum and each gradient's sum of
            squares and sum, in the order they were taken.
        """
        values = self._read(self._scalars)
        self._scalars = []
        return values


def _watcher(model: nn.Module, config: Config) -> Any:
    if config.options.get("null"):
        return _Null()
    if config.options.get("anomaly"):
        return _Anomaly()
    if config.options.get("floor"):
        return _Floor(model)
    if config.options.get("outputs_floor"):
        return _OutputsFloor(model)
    return graddebug.watch(model, **config.options)


@dataclass
class Workload:
    """A model with a fixed batch, its optimizer and its loss.

    Attributes:
        name: Short name (``mlp``, ``cnn``, ``transformer``).
        description: Model and batch, in words.
        model: The model, in training mode.
        optimizer: Plain SGD over the model's parameters.
        inputs: One batch of inputs, reused every step.
        target: The matching targets.
        loss_fn: ``loss_fn(output, target) -> scalar``.
    """

    name: str
    description: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    inputs: Tensor
    target: Tensor
    loss_fn: LossFn


@dataclass
class Result:
    """The measurements of one (workload, config) pair.

    Attributes:
        workload: Workload name.
        config: Config key.
        label: Config label.
        target: The ratio the config must stay under.
        plain_ms: Median over the rounds paired with this config of the plain step time (ms).
        watched_ms: Median over rounds of the watched step time (ms).
        ratio: Median over every pair of (watched / plain) step time; with ``every=N``, the
            :func:`position_ratio` over the positions of a round.
        ratio_q1: First quartile of the per-round ratios.
        ratio_q3: Third quartile of the per-round ratios.
        ratio_low: Lower end of the 95% bootstrap interval of ``ratio`` (the rounds resampled
            with replacement, ``ratio`` taken again from each resample).
        ratio_high: Its upper end.
        ratio_best: Fastest watched round over fastest plain round (round medians; with
            ``every=N``, round means); on a busy machine it shows
            the overhead with the least interference.
        passed: ``ratio <= target``.
        verdict: ``"pass"`` when the whole interval lies under the target, ``"FAIL"`` when it
            lies above, ``"within noise"`` when it holds the target.
        rows_per_step: Frame rows (recorded tensors) per watched step.
        findings: Findings the watcher raised over the run (a healthy model should give 0).
        enter_exit_ms: Median time to enter and leave the ``with`` block (not in the ratio).
        round_ratios: Every round's ratio, in round order: the median of its pairs' ratios;
            with ``every=N``, its mean watched step over its mean plain step.
        plain_round_ms: Every plain round's median step time (ms).
        watched_round_ms: Every watched round's median step time (ms); with ``every=N``,
            the rounds' means (ms).
        plain_steps_ms: Every plain step's time (ms), per round, in pair order.
        watched_steps_ms: Every watched step's time (ms), per round: its k-th step ran
            right before or after the k-th plain step of the round.
        compiled: Both sides ran under ``torch.compile``.
        graph_breaks_plain: Graph breaks over the census steps of the plain compiled model
            (-1 when not compiled).
        graph_breaks_watched: The same, watched under this config.
        graphs_plain: Graphs dynamo compiled over the census steps, plain (-1: not compiled).
        graphs_watched: The same, watched under this config.
    """

    workload: str
    config: str
    label: str
    target: float
    plain_ms: float = math.nan
    watched_ms: float = math.nan
    ratio: float = math.nan
    ratio_q1: float = math.nan
    ratio_q3: float = math.nan
    ratio_low: float = math.nan
    ratio_high: float = math.nan
    ratio_best: float = math.nan
    passed: bool = False
    verdict: str = ""
    rows_per_step: float = math.nan
    findings: int = 0
    enter_exit_ms: float = math.nan
    round_ratios: list[float] = field(default_factory=list)
    plain_round_ms: list[float] = field(default_factory=list)
    watched_round_ms: list[float] = field(default_factory=list)
    plain_steps_ms: list[list[float]] = field(default_factory=list)
    watched_steps_ms: list[list[float]] = field(default_factory=list)
    compiled: bool = False
    graph_breaks_plain: int = -1
    graph_breaks_watched: int = -1
    graphs_plain: int = -1
    graphs_watched: int = -1


# -- workloads ---------------------------------------------------------------------------------


def _mlp() -> tuple[nn.Module, Tensor, Tensor, LossFn, str]:
    layers: list[nn.Module] = []
    for _ in range(16):
        layers += [nn.Linear(512, 512), nn.ReLU()]
    x, y = torch.randn(128, 512), torch.randn(128, 512)
    return nn.Sequential(*layers), x, y, nn.functional.mse_loss, "16 x (Linear 512 + ReLU), b=128"


def _cnn() -> tuple[nn.Module, Tensor, Tensor, LossFn, str]:
    def block(c_in: int, c_out: int) -> list[nn.Module]:
        return [nn.Conv2d(c_in, c_out, 3, padding=1), nn.BatchNorm2d(c_out), nn.ReLU()]

    model = nn.Sequential(
        *block(3, 32), nn.MaxPool2d(2),
        *block(32, 64), nn.MaxPool2d(2),
        *block(64, 64), nn.AdaptiveAvgPool2d(1),
        nn.Flatten(), nn.Linear(64, 10),
    )
    x, y = torch.randn(64, 3, 32, 32), torch.randint(0, 10, (64,))
    return model, x, y, nn.functional.cross_entropy, "3 x (Conv+BN+ReLU) 3-32-64-64, b=64, 32x32"


def _transformer() -> tuple[nn.Module, Tensor, Tensor, LossFn, str]:
    layer = nn.TransformerEncoderLayer(
        d_model=256, nhead=4, dim_feedforward=1024, batch_first=True
    )
    model = nn.TransformerEncoder(layer, num_layers=4, enable_nested_tensor=False)
    x, y = torch.randn(16, 64, 256), torch.randn(16, 64, 256)
    return model, x, y, nn.functional.mse_loss, "TransformerEncoder d256 h4 L4 ff1024, b=16 s=64"


class _BasicBlock(nn.Module):
    """torchvision's ResNet ``BasicBlock``: two 3x3 conv-BN pairs and a (projected) shortcut."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.downsample = None if stride == 1 and c_in == c_out else nn.Sequential(
            nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x: Tensor) -> Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class ResNet18(nn.Module):
    """torchvision's ``resnet18`` layout (module names and shapes), built here so that the
    benchmark needs no torchvision."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        widths = (64, 128, 256, 512)
        for i, width in enumerate(widths):
            c_in = widths[max(i - 1, 0)]
            stride = 1 if i == 0 else 2
            setattr(self, f"layer{i + 1}", nn.Sequential(
                _BasicBlock(c_in, width, stride), _BasicBlock(width, width, 1)))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(512, classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        for i in range(1, 5):
            x = getattr(self, f"layer{i}")(x)
        return self.fc(self.avgpool(x).flatten(1))


def _resnet18() -> tuple[nn.Module, Tensor, Tensor, LossFn, str]:
    x, y = torch.randn(16, 3, 64, 64), torch.randint(0, 10, (16,))
    return (ResNet18(), x, y, nn.functional.cross_entropy,
            "ResNet-18 (torchvision layout), b=16, 64x64, 10 classes")


def _gpt2() -> tuple[nn.Module, Tensor, Tensor, LossFn, str]:
    import transformers  # an optional workload: only this one needs transformers

    # No key-value cache, as in training: under torch.compile (torch 2.13) a tensor hook traced
    # after the cache's update loses the cache's attributes, and dynamo falls back to eager.
    config = transformers.GPT2Config(n_layer=4, n_embd=128, n_head=4, vocab_size=512,
                                     n_positions=64, bos_token_id=0, eos_token_id=0,
                                     use_cache=False)
    tokens = torch.randint(0, 512, (8, 64))

    def loss(output: Any, target: Tensor) -> Tensor:
        logits: Tensor = output.logits
        return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())

    return (transformers.GPT2LMHeadModel(config), tokens, tokens, loss,
            "GPT-2 (transformers) L4 d128 h4, b=8 s=64, vocab 512")


_BUILDERS: dict[str, Callable[[], tuple[nn.Module, Tensor, Tensor, LossFn, str]]] = {
    "mlp": _mlp,
    "cnn": _cnn,
    "transformer": _transformer,
    "resnet18": _resnet18,
    "gpt2": _gpt2,
}


def build_workload(name: str, device: torch.device, seed: int = 0) -> Workload:
    """Build a workload from a fixed seed.

    Args:
        name: One of :data:`WORKLOADS`.
        device: Where the model and the batch live.
        seed: Seed for the weights and the batch.

    Returns:
        The workload, with its model in training mode.
    """
    torch.manual_seed(seed)
    model, x, y, loss_fn, description = _BUILDERS[name]()
    model = model.to(device).train()
    # A small learning rate keeps the shared weights sane over hundreds of steps.
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    return Workload(name, description, model, optimizer, x.to(device), y.to(device), loss_fn)


def twin(work: Workload, apart: bool = False) -> Workload:
    """A copy of ``work``'s model with its own optimizer, on the same batch and loss.

    Args:
        work: The workload to copy; its weights are copied as they are now.
        apart: Give the copy a subclass of the model's class, so that dynamo compiles its
            graphs apart from those of the original's class: dynamo would otherwise reuse a
            hook-free graph of the class for a watched copy, without graddebug's hooks.

    Returns:
        The copy's workload.
    """
    model = copy.deepcopy(work.model)
    if apart:
        cls = type(model)
        model.__class__ = type(f"Watched{cls.__name__}", (cls,), {})
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    return Workload(work.name, work.description, model, optimizer, work.inputs, work.target,
                    work.loss_fn)


def compiled_copy(work: Workload, apart: bool) -> Workload:
    """A ``torch.compile``d :func:`twin` of ``work``."""
    copied = twin(work, apart)
    copied.model = torch.compile(copied.model)
    return copied


def graph_census(name: str, options: dict[str, Any] | None, device: torch.device
                 ) -> tuple[int, int]:
    """Graph breaks and compiled graphs of :data:`CENSUS_STEPS` steps of a compiled workload,
    from a clean dynamo state; dynamo alone traces (backend "eager"), since breaks are its.

    Args:
        name: Workload name.
        options: ``graddebug.watch`` options, or None for plain steps.
        device: Where to run.

    Returns:
        ``(graph breaks, graphs)`` as ``torch._dynamo.utils.counters`` counts them.
    """
    work = build_workload(name, device)
    torch._dynamo.reset()
    counters.clear()
    work.model = torch.compile(work.model, backend="eager")
    if options is None:
        for _ in range(CENSUS_STEPS):
            train_step(work, None)
    else:
        with graddebug.watch(work.model, **options) as dbg:
            for _ in range(CENSUS_STEPS):
                train_step(work, dbg)
    breaks = sum(counters["graph_break"].values())
    graphs = counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    return breaks, graphs


# -- timing ------------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_step(work: Workload, dbg: Watcher | None) -> None:
    """Run one training step, closing the watcher's step after ``backward`` when given.

    Args:
        work: The workload to train.
        dbg: An entered watcher, or None for a plain step.
    """
    work.optimizer.zero_grad(set_to_none=True)
    loss = work.loss_fn(work.model(work.inputs), work.target)
    torch.autograd.backward(loss)
    if dbg is not None:
        dbg.step()
    work.optimizer.step()


def timed_step(work: Workload, dbg: Any, device: torch.device) -> float:
    """Run and time one :func:`train_step`, in seconds, the device synchronised at its end."""
    start = time.perf_counter()
    train_step(work, dbg)
    _sync(device)
    return time.perf_counter() - start


def step_times(work: Workload, steps: int, dbg: Watcher | None,
               device: torch.device) -> list[float]:
    """Time ``steps`` consecutive training steps one by one; return their times, in seconds.

    Args:
        work: The workload to train.
        steps: How many steps the round has.
        dbg: An entered watcher, or None for plain steps.
        device: The workload's device, synchronised around every step.
    """
    # Collect leftovers from the previous round outside the clock; collections the round itself
    # triggers stay in, because they are part of its cost.
    gc.collect()
    _sync(device)
    return [timed_step(work, dbg, device) for _ in range(steps)]


def time_steps(work: Workload, steps: int, dbg: Watcher | None, device: torch.device) -> float:
    """The median of :func:`step_times`, so that a burst of load from elsewhere on a shared
    machine that hits one or two steps does not decide the round."""
    return statistics.median(step_times(work, steps, dbg, device))


def time_pairs(plain: Workload, watched: Workload, steps: int, watcher: Any,
               device: torch.device, watched_first: bool) -> tuple[list[float], list[float], float]:
    """Enter ``watcher`` on the watched twin, time ``steps`` pairs of single steps, leave it.

    A pair is one plain step of ``plain`` and one watched step of ``watched``, back to back,
    the order within the pairs flipping from one pair to the next (:func:`ratios.alternate`).

    Args:
        plain: The plain twin, never watched.
        watched: The watched twin, the model ``watcher`` was built for.
        steps: How many pairs the round has.
        watcher: A Watcher (or a stand-in) for ``watched.model``, not entered.
        device: The workloads' device.
        watched_first: Whether the round's first pair starts with the watched step.

    Returns:
        The plain and the watched steps' times in pair order, in seconds, and the seconds spent
        entering plus leaving ``watcher``.

    Raises:
        RuntimeError: graddebug left a hook on a model, so later rounds would be unfair.
    """
    # Collect leftovers from the previous round outside the clock; collections the round itself
    # triggers stay in, because they are part of its cost.
    gc.collect()
    per_step = getattr(watcher, "per_step", contextlib.nullcontext)
    start = time.perf_counter()
    with watcher as dbg:
        entered = time.perf_counter()
        _sync(device)

        def watched_step() -> float:
            with per_step():  # entered and left outside the step's clock
                return timed_step(watched, dbg, device)

        plain_times, watched_times = alternate(lambda: timed_step(plain, None, device),
                                               watched_step, steps, watched_first)
        leaving = time.perf_counter()
    enter_exit = (entered - start) + (time.perf_counter() - leaving)
    _check_no_hooks(watched.model)
    _check_no_hooks(plain.model)
    return plain_times, watched_times, enter_exit


def _check_no_hooks(model: nn.Module) -> None:
    for name, module in model.named_modules():
        if module._forward_hooks or module._forward_pre_hooks or module._backward_hooks:
            raise RuntimeError(f"graddebug left a module hook on {name or 'the model'!r}")
    for name, param in model.named_parameters():
        if param._post_accumulate_grad_hooks or param._backward_hooks:
            raise RuntimeError(f"graddebug left a gradient hook on parameter {name!r}")


def benchmark_workload(
    name: str,
    configs: Sequence[Config],
    rounds: int,
    steps: int,
    warmup: int,
    device: torch.device,
    console: Console,
    compiled: bool = False,
) -> list[Result]:
    """Measure every config on one workload, in pairs of a plain and a watched twin's steps.

    Args:
        name: Workload name.
        configs: The watch configurations to compare with plain training.
        rounds: Timed rounds per config.
        steps: Pairs of steps per round.
        warmup: Untimed rounds per config before the timed ones (under ``compiled``, they
            take the compilation).
        device: Where to run.
        console: For progress lines.
        compiled: Run both sides under ``torch.compile`` and count graph breaks.

    Returns:
        One result per config, in ``configs`` order.
    """
    work = build_workload(name, device)
    results = {c.key: Result(name, c.key, c.label, c.target, compiled=compiled)
               for c in configs}
    console.print(f"[bold]{name}[/bold]: {work.description}, "
                  f"{sum(p.numel() for p in work.model.parameters()):,} parameters")
    if compiled:
        plain_census = graph_census(name, None, device)
        for c in configs:
            res = results[c.key]
            res.graph_breaks_plain, res.graphs_plain = plain_census
            # (d), (f), (g) and (n) have no watcher
            options = (None if {"anomaly", "floor", "outputs_floor", "null"} & c.options.keys()
                       else c.options)
            res.graph_breaks_watched, res.graphs_watched = graph_census(name, options, device)
            console.print(f"  {c.label}: graph breaks {res.graph_breaks_plain} plain, "
                          f"{res.graph_breaks_watched} watched; graphs {res.graphs_plain} "
                          f"plain, {res.graphs_watched} watched", style="dim")
        plain_work = compiled_copy(work, False)
        # One compiled twin per config: dynamo recompiles a model when its forward hooks go
        # (a config without graddebug), and the graph it compiled without hooks would then
        # serve the next config's rounds, whose hooks it does not guard on (graddebug warns
        # of it): that config would time a model that records no layer output.
        watched_works = {c.key: compiled_copy(work, True) for c in configs}
    else:
        plain_work, shared = work, twin(work)
        watched_works = {c.key: shared for c in configs}
    watchers = {c.key: _watcher(watched_works[c.key].model, c) for c in configs}
    enter_exit: dict[str, list[float]] = {c.key: [] for c in configs}
    for r in range(-warmup, rounds):
        for i, config in enumerate(configs):
            watcher = watchers[config.key]
            # Flip the order every round, and from one config to the next, so that drift
            # favours neither side.
            plain, watched, enter = time_pairs(plain_work, watched_works[config.key], steps,
                                               watcher, device,
                                               watched_first=(r + i) % 2 == 1)
            if r < 0:
                continue
            res = results[config.key]
            res.plain_steps_ms.append([t * 1e3 for t in plain])
            res.watched_steps_ms.append([t * 1e3 for t in watched])
            # A median would hide the one recorded step in N: every= rounds show their mean.
            summary = statistics.fmean if watcher.every > 1 else statistics.median
            res.plain_round_ms.append(summary(plain) * 1e3)
            res.watched_round_ms.append(summary(watched) * 1e3)
            res.round_ratios.append(
                res.watched_round_ms[-1] / res.plain_round_ms[-1] if watcher.every > 1
                else statistics.median(pair_ratios(res.watched_steps_ms[-1],
                                                   res.plain_steps_ms[-1])))
            enter_exit[config.key].append(enter * 1e3)
        if r >= 0:
            line = "  ".join(
                f"{c.key}={results[c.key].round_ratios[-1]:.3f}" for c in configs
            )
            console.print(f"  round {r + 1:>2}/{rounds}  ratio {line}", style="dim")

    for config in configs:
        res = results[config.key]
        watcher = watchers[config.key]
        recorded_steps = (warmup + rounds) * steps
        res.plain_ms = statistics.median(res.plain_round_ms)
        res.watched_ms = statistics.median(res.watched_round_ms)
        estimate = pairs_estimator(res.watched_steps_ms, res.plain_steps_ms, watcher.every)
        res.ratio = estimate(range(rounds))
        res.ratio_low, res.ratio_high = bootstrap_interval(estimate, rounds)
        res.ratio_q1, res.ratio_q3 = quartiles(res.round_ratios)
        res.ratio_best = min(res.watched_round_ms) / min(res.plain_round_ms)
        res.passed = res.ratio <= config.target
        res.verdict = verdict(res.ratio_low, res.ratio_high, config.target)
        res.rows_per_step = len(watcher.frame()) / recorded_steps
        res.findings = len(watcher.findings())
        res.enter_exit_ms = statistics.median(enter_exit[config.key])
        if res.findings:
            found = watcher.findings()
            console.print(f"  [yellow]{config.label}: {res.findings} findings[/yellow] "
                          f"(issues: {sorted(set(found['issue']))}); first: "
                          f"{found['message'].iloc[0]}")
    return [results[c.key] for c in configs]


# -- output ------------------------------------------------------------------------------------


def results_table(results: Sequence[Result], title: str) -> Table:
    """Build the summary table.

    Args:
        results: One result per (workload, config).
        title: The table's title.

    Returns:
        A rich table with one row per result.
    """
    table = Table(title=title, title_justify="left")
    table.add_column("workload")
    table.add_column("config")
    compiled = any(res.compiled for res in results)
    columns = ["plain ms/step", "watched ms/step", "ratio", "95% interval", "best/best",
               "target", "rows/step"]
    if compiled:
        columns += ["breaks plain/watched", "graphs plain/watched"]
    for col in columns:
        table.add_column(col, justify="right")
    table.add_column("result")
    for res in results:
        colour = {"pass": "green", "FAIL": "red"}.get(res.verdict, "yellow")
        verdict = f"[{colour}]{res.verdict}[/{colour}]"
        cells = [res.workload, res.label, f"{res.plain_ms:.2f}", f"{res.watched_ms:.2f}",
                 f"{res.ratio:.3f}", f"{res.ratio_low:.3f}-{res.ratio_high:.3f}",
                 f"{res.ratio_best:.3f}", f"<={res.target:.2f}", f"{res.rows_per_step:.0f}"]
        if compiled:
            cells += [f"{res.graph_breaks_plain}/{res.graph_breaks_watched}",
                      f"{res.graphs_plain}/{res.graphs_watched}"]
        table.add_row(*cells, verdict)
    return table


def _git(*args: str) -> str:
    try:
        done = subprocess.run(["git", *args], cwd=Path(__file__).resolve().parent,
                              capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout.strip()


def environment() -> dict[str, Any]:
    """Describe the machine, the library versions and the commit measured, for the JSON file."""
    return {
        "git_commit": _git("rev-parse", "HEAD"),
        # Uncommitted changes to the library make the commit alone an incomplete description.
        "library_modified": bool(_git("status", "--porcelain", "--", "../src", "../adapters")),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "graddebug": graddebug.__version__,
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def write_json(path: Path, results: Sequence[Result], settings: dict[str, Any]) -> None:
    """Write the settings, the environment and every measurement to ``path``.

    Args:
        path: Output file; its folder is created.
        results: One result per (workload, config).
        settings: The command-line settings of the run.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "benchmark": "overhead_torch",
        "method": "twin models in one process; single steps timed in pairs (one plain, one "
                  "watched, back to back, the order flipping from pair to pair and round to "
                  "round); ratio: the median over every pair of watched/plain (with every=N: "
                  "for each position in the round, the median over the rounds of its pairs' "
                  "ratios, averaged over the positions); configs take turns round by round; "
                  "enter/exit of the with block not in the steps; ratio_low/ratio_high: 95% "
                  f"percentile bootstrap interval over {BOOTSTRAP_RESAMPLES} resamples of the "
                  "rounds (seed 0)",
        "settings": settings,
        "environment": environment(),
        "results": [asdict(r) for r in results],
    }
    path.write_text(json.dumps(payload, indent=2) + "\n")


# -- profiling ---------------------------------------------------------------------------------


def _is_graddebug(filename: str) -> bool:
    return any(d in filename.replace("\\", "/") for d in GRADDEBUG_DIRS)


def profile_workload(
    name: str, config: Config, steps: int, warmup_steps: int, device: torch.device, top: int,
    console: Console, dump: Path | None,
) -> None:
    """Run cProfile over the watched steps of one workload and print the hot spots.

    Prints the top ``top`` functions by own time, then graddebug's share of the step: the
    cumulative time of its entry points (hooks and ``Watcher.step``, torch kernels they launch
    included) and the own Python time of all its functions.

    Args:
        name: Workload name.
        config: The watch configuration to profile.
        steps: Profiled steps.
        warmup_steps: Unprofiled watched steps before them.
        device: Where to run.
        top: How many functions to list.
        console: Where to print.
        dump: Where to save the raw stats (for snakeviz), or None.
    """
    work = build_workload(name, device)
    plain = time_steps(work, max(steps // 2, 1), None, device) * 1e3
    with graddebug.watch(work.model, **config.options) as dbg:
        for _ in range(warmup_steps):
            train_step(work, dbg)
        _sync(device)
        gc.collect()
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(steps):
            train_step(work, dbg)
        _sync(device)
        profiler.disable()
    stats = pstats.Stats(profiler)
    if dump is not None:
        dump.parent.mkdir(parents=True, exist_ok=True)
        stats.dump_stats(str(dump))
    raw: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    total = stats.total_tt  # type: ignore[attr-defined]
    per_step = total / steps * 1e3

    console.rule(f"cProfile: {name}, config {config.label}, {steps} steps")
    console.print(f"profiled watched step: {per_step:.2f} ms (cProfile inflates Python calls); "
                  f"unprofiled plain step: {plain:.2f} ms")
    table = Table(title=f"top {top} functions by tottime", title_justify="left")
    for col in ("tottime ms/step", "% of step", "cumtime ms/step", "calls/step"):
        table.add_column(col, justify="right")
    table.add_column("function")
    rows = sorted(raw.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    for (filename, line, func), (_cc, ncalls, tottime, cumtime, _callers) in rows:
        where = _short(filename, line, func)
        style = "bold" if _is_graddebug(filename) else ""
        table.add_row(f"{tottime / steps * 1e3:.3f}", f"{100 * tottime / total:.1f}",
                      f"{cumtime / steps * 1e3:.3f}", f"{ncalls / steps:.0f}",
                      f"[{style}]{where}[/{style}]" if style else where)
    console.print(table)

    entries = Table(title="graddebug entry points (cumulative, kernels they launch included)",
                    title_justify="left")
    for col in ("cumtime ms/step", "% of step", "calls/step"):
        entries.add_column(col, justify="right")
    entries.add_column("function")
    inclusive = 0.0
    for (filename, line, func), (_cc, ncalls, _tt, cumtime, _callers) in raw.items():
        if _is_graddebug(filename) and func in ENTRY_POINTS:
            inclusive += cumtime
            entries.add_row(f"{cumtime / steps * 1e3:.3f}", f"{100 * cumtime / total:.1f}",
                            f"{ncalls / steps:.0f}", _short(filename, line, func))
    own = sum(v[2] for k, v in raw.items() if _is_graddebug(k[0]))
    console.print(entries)
    console.print(f"graddebug inclusive: {inclusive / steps * 1e3:.2f} ms/step "
                  f"({100 * inclusive / total:.1f}% of the profiled step); own Python "
                  f"(tottime in graddebug files): {own / steps * 1e3:.2f} ms/step "
                  f"({100 * own / total:.1f}%)")

    callees = Table(title="graddebug's heaviest callees (tottime inside graddebug callers)",
                    title_justify="left")
    for col in ("ms/step", "% of step", "calls/step"):
        callees.add_column(col, justify="right")
    callees.add_column("function")
    callees.add_column("called from")
    inner: list[tuple[float, float, str, str]] = []
    for (filename, line, func), (_cc, _n, _tt, _ct, callers) in raw.items():
        if _is_graddebug(filename):
            continue
        for caller, (_ccc, nc, tt, _ctt) in callers.items():
            if _is_graddebug(caller[0]):
                inner.append((tt, nc, _short(filename, line, func), caller[2]))
    for tt, nc, where, caller_name in sorted(inner, reverse=True)[:top]:
        callees.add_row(f"{tt / steps * 1e3:.3f}", f"{100 * tt / total:.1f}",
                        f"{nc / steps:.0f}", where, caller_name)
    console.print(callees)


def _short(filename: str, line: int, func: str) -> str:
    if filename == "~":
        return func
    parts = Path(filename).parts
    return f"{'/'.join(parts[-2:])}:{line}({func})"


# -- command line ------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the command line.

    Args:
        argv: Arguments without the program name; None reads ``sys.argv``.

    Returns:
        The parsed options.
    """
    parser = argparse.ArgumentParser(
        description="Step-time overhead of graddebug.watch on PyTorch (watched / plain).",
    )
    parser.add_argument("--rounds", type=int, default=15, help="timed rounds per config")
    parser.add_argument("--steps-per-round", type=int, default=10,
                        help="pairs of steps (one plain, one watched) in each round")
    parser.add_argument("--warmup", type=int, default=1,
                        help="untimed rounds per config before the timed ones")
    parser.add_argument("--workloads", default=None,
                        help=f"comma-separated, from {','.join(WORKLOADS)} (default: "
                             f"{','.join(DEFAULT_WORKLOADS)}; with --profile: mlp; gpt2 "
                             "needs transformers)")
    parser.add_argument("--configs", default="a,b",
                        help="comma-separated, from a,b,c,o,d,f,g,n (c: b recording every 10th "
                             "step; o: b with ops=True; d: detect_anomaly, no graddebug; "
                             "f: the floor, one _foreach_norm pass; g: f and hand-written "
                             "output hooks, the floor of b; n: both twins plain)")
    parser.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    parser.add_argument("--json", type=Path, default=None,
                        help=f"where to write results (default: {DEFAULT_JSON.name}, with "
                             f"--compile {COMPILED_JSON.name}, in {DEFAULT_JSON.parent})")
    parser.add_argument("--compile", action="store_true",
                        help="run both sides under torch.compile and count graph breaks")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch intra-op threads (default: torch's own choice); 1 keeps a "
                             "shared, busy machine from thrashing")
    parser.add_argument("--default-allocator", action="store_true",
                        help="leave glibc's malloc thresholds as they are (by default they are "
                             "fixed, see ratios.steady_allocator: otherwise the twins can "
                             "settle into different page-fault patterns)")
    parser.add_argument("--profile", action="store_true",
                        help="instead of timing, cProfile one workload under the last of "
                             "--configs (default: b)")
    parser.add_argument("--profile-steps", type=int, default=30, help="steps under cProfile")
    parser.add_argument("--top", type=int, default=25, help="functions listed by --profile")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.steps_per_round < 1 or args.warmup < 0:
        parser.error("--rounds and --steps-per-round must be >= 1, --warmup >= 0")
    names = args.workloads.split(",") if args.workloads else (
        ["mlp"] if args.profile else list(DEFAULT_WORKLOADS))
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        parser.error(f"unknown workloads {unknown!r}; choose from {', '.join(WORKLOADS)}")
    if args.profile and len(names) != 1:
        parser.error("--profile takes exactly one workload, e.g. --workloads transformer")
    if args.profile and args.compile:
        parser.error("--profile profiles eager steps; leave out --compile")
    if args.compile and args.warmup < 1:
        parser.error("--compile needs --warmup >= 1: the first round compiles")
    if args.json is None:
        args.json = COMPILED_JSON if args.compile else DEFAULT_JSON
    args.workload_names = names
    keys = args.configs.split(",")
    args.config_list = [c for c in CONFIGS if c.key in keys]
    if len(args.config_list) != len(keys):
        parser.error(f"--configs {args.configs!r}: choose from a,b,c,o,d,f,n")
    for config in args.config_list:
        every = config.options.get("every", 1)
        if args.steps_per_round % every and not args.profile:
            parser.error(f"--steps-per-round {args.steps_per_round}: {config.label} records one "
                         f"step in {every}, so a round must hold a multiple of {every} steps")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark (or the profile) and report.

    Args:
        argv: Arguments without the program name; None reads ``sys.argv``.

    Returns:
        The exit status: 0 (missing a target is reported, not an error).
    """
    args = parse_args(argv)
    # Before any model is built: the twins' buffers come from the allocator as it is set now.
    allocator = "default" if args.default_allocator or not steady_allocator() else "steady"
    if args.threads:
        torch.set_num_threads(args.threads)
    # Redirected output would otherwise wrap the table at 80 columns.
    console = Console(width=None if sys.stdout.isatty() else 132)
    device = torch.device(args.device)
    if args.profile:
        name = args.workload_names[0]
        dump = args.json.parent / f"profile_{name}_{args.config_list[-1].key}.prof"
        profile_workload(name, args.config_list[-1], args.profile_steps, args.steps_per_round,
                         device, args.top, console, dump)
        console.print(f"raw stats: {dump}")
        return 0

    env = environment()
    console.print(f"torch {env['torch']}, {env['torch_threads']} threads, device {device}; "
                  f"{args.rounds} rounds x {args.steps_per_round} pairs of steps, "
                  f"{args.warmup} warm-up round(s); allocator: {allocator}")
    results: list[Result] = []
    for name in args.workload_names:
        results += benchmark_workload(name, args.config_list, args.rounds, args.steps_per_round,
                                      args.warmup, device, console, args.compile)
    title = (f"graddebug overhead{' under torch.compile' if args.compile else ''}, "
             f"torch {env['torch']} on {device} "
             f"({env['torch_threads']} threads), median of {args.rounds} rounds x "
             f"{args.steps_per_round} pairs of steps")
    console.print(results_table(results, title))
    settings = {
        "rounds": args.rounds,
        "steps_per_round": args.steps_per_round,
        "warmup_rounds": args.warmup,
        "workloads": args.workload_names,
        "configs": [c.key for c in args.config_list],
        "device": str(device),
        "compile": args.compile,
        "census_steps": CENSUS_STEPS if args.compile else 0,
        "allocator": allocator,
    }
    write_json(args.json, results, settings)
    console.print(f"results: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
