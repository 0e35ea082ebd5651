"""Mid-training references: small seeded models trained on real data with a realistic recipe.

Shared by the mid-training tests and ``benchmarks/calibrate_history.py``. Three models, in both
frameworks:

- ``gpt``: a pre-LayerNorm character-level GPT (torch: 4 blocks, d_model 64, 4 heads, context
  32; Keras: 2 blocks, otherwise the same) on the source text of a few standard-library
  modules, read from disk with :func:`inspect.getsource`;
- ``cnn``: three conv + BatchNorm + ReLU blocks and a Linear + ReLU head on the 8x8 images of
  :func:`sklearn.datasets.load_digits`;
- ``tanh_mlp``: a 6-layer tanh MLP on the same digits.

The recipe is the usual one: AdamW (weight decay 0.01), linear warmup of the learning rate
from 0 over :data:`WARMUP` steps then cosine decay to 0 at the last step, gradient clipping at
global norm 1.0 (torch: ``clip_grad_norm_`` between ``backward()`` and ``opt.step()``; Keras:
``global_clipnorm=1.0``), dropout on, minibatches drawn with a seeded generator. The torch
optimizers hold one parameter group per layer (named ``name``, with its own ``base_lr``), so
that a fault can set one layer's learning rate.

:func:`run_torch` and :func:`run_keras` train one reference under ``graddebug.watch(model)``
and return a :class:`Run`. A ``fault(step, model, optimizer)`` callable runs before each step's
forward pass; the injectors at the end of this module build such faults, each a :class:`Fault`
that names its true source layer and its cause.

Wall time of 500 steps under ``graddebug.watch``, measured on the shared 2-core CPU (torch
2.13 on 1 thread, TF 2.21, Keras 3.15) while other test suites ran on it: torch GPT 41-50 s,
CNN 9-12 s, tanh MLP 3-4.5 s; Keras ``fit`` GPT 62 s, CNN 19-36 s, tanh MLP 13-16 s; Keras tape
loop GPT 53-57 s, CNN 16-17 s, tanh MLP 9-13 s (Keras times include tracing). Collecting
``dbg.findings()`` after every step adds about 55 ms a step (tanh MLP 4.5 s -> 32 s, CNN
12 s -> 34 s). The GPT's 13 dropout calls a step are about a quarter of its forward and
backward time on this CPU. TensorFlow is imported only by the Keras functions.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import math
import string
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch import nn
from torch.nn import functional as F

import graddebug

STEPS = 500
"""Training steps of a reference run."""
WARMUP = 50
"""Steps of linear warmup from a learning rate of 0."""
WEIGHT_DECAY = 0.01
CLIP_NORM = 1.0
"""Global gradient norm that clipping keeps the gradients under."""
CONTEXT = 32
"""Characters in one GPT sample."""
TEXT_MODULES = ("textwrap", "string", "functools", "heapq", "bisect", "fnmatch", "shlex",
                "copy", "glob", "tokenize")
"""Standard-library modules whose source is the GPT's corpus (about 250 kB)."""

Fault = Callable[[int, Any, Any], None]
"""``fault(step, model, optimizer)``: runs before the forward pass of every step."""


# -- data -----------------------------------------------------------------------------------------


@functools.cache
def corpus() -> tuple[str, str]:
    """The GPT's corpus and its alphabet.

    Returns:
        The text (characters outside ``string.printable`` replaced by ``"?"``) and its sorted
        distinct characters.
    """
    allowed = set(string.printable)
    parts = [inspect.getsource(importlib.import_module(m)) for m in TEXT_MODULES]
    text = "".join(c if c in allowed else "?" for c in "\n".join(parts))
    return text, "".join(sorted(set(text)))


@functools.cache
def tokens() -> np.ndarray:
    """The corpus as int64 character indices."""
    text, alphabet = corpus()
    index = {c: i for i, c in enumerate(alphabet)}
    return np.fromiter((index[c] for c in text), dtype=np.int64, count=len(text))


@functools.cache
def digits() -> tuple[np.ndarray, np.ndarray]:
    """``load_digits``: the 1,797 images as float32 pixels in [0, 1] (N, 64) and their labels."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    return (bunch.data / 16.0).astype(np.float32), bunch.target.astype(np.int64)


def standardized(pixels: np.ndarray) -> np.ndarray:
    """Pixels with zero mean and unit variance per feature (constant features stay 0)."""
    std = pixels.std(axis=0)
    return ((pixels - pixels.mean(axis=0)) / np.where(std > 0, std, 1.0)).astype(np.float32)


def batch_indices(name: str, steps: int, batch: int, seed: int) -> np.ndarray:
    """The ``(steps, batch)`` sample indices of a run: GPT window starts or digit rows.

    Drawn from ``numpy.random.default_rng(seed)``, so that both frameworks see the same
    minibatches.
    """
    rng = np.random.default_rng(seed)
    high = len(tokens()) - CONTEXT - 1 if name == "gpt" else len(digits()[1])
    return rng.integers(0, high, (steps, batch))


def arrays(name: str, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Inputs and targets of the samples ``indices`` (any shape), in the model's layout.

    GPT: (..., CONTEXT) input characters and the next characters; CNN: (..., 1, 8, 8)
    images (channels first); tanh MLP: (..., 64) standardized pixels.
    """
    if name == "gpt":
        windows = indices[..., None] + np.arange(CONTEXT + 1)
        text = tokens()[windows]
        return text[..., :-1], text[..., 1:]
    pixels, labels = digits()
    if name == "cnn":
        return pixels[indices].reshape(*indices.shape, 1, 8, 8), labels[indices]
    return standardized(pixels)[indices], labels[indices]


def lr_factor(step: int, steps: int, warmup: int = WARMUP) -> float:
    """The schedule: ``step / warmup`` during warmup, then cosine decay to 0 at ``steps - 1``."""
    if step < warmup:
        return step / warmup
    span = max(steps - 1 - warmup, 1)
    return 0.5 * (1.0 + math.cos(math.pi * min(step - warmup, span) / span))


# -- torch models ---------------------------------------------------------------------------------


class Attention(nn.Module):
    """Causal multi-head self-attention, with two switchable bugs.

    Attributes:
        detach: Cut the graph: the heads' output is detached before ``proj``, so ``qkv``
            gets no gradient.
        masked_row: A query position whose mask row is all ``-inf`` (softmax of it is NaN),
            or None.
    """

    def __init__(self, d_model: int, heads: int, context: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.attn_drop = nn.Dropout(dropout)
        self.proj = nn.Linear(d_model, d_model)
        self.register_buffer(
            "mask", torch.full((context, context), -math.inf).triu(1), persistent=False)
        self.detach = False
        self.masked_row: int | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2)
                   for z in self.qkv(x).split(c, dim=2))
        mask = self.mask[:t, :t]
        if self.masked_row is not None:
            mask = mask.clone()
            mask[self.masked_row] = -math.inf
        att = self.attn_drop(torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(c // self.heads)
                                           + mask, dim=-1))
        y = (att @ v).transpose(1, 2).reshape(b, t, c)
        return self.proj(y.detach() if self.detach else y)


class MLP(nn.Module):
    """``fc`` (4x wider), GELU, ``proj``."""

    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.act = nn.GELU()
        self.proj = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.act(self.fc(x)))


class Block(nn.Module):
    """Pre-LayerNorm transformer block with residual dropout."""

    def __init__(self, d_model: int, heads: int, context: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = Attention(d_model, heads, context, dropout)
        self.drop1 = nn.Dropout(dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model)
        self.drop2 = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop1(self.attn(self.ln1(x)))
        return x + self.drop2(self.mlp(self.ln2(x)))


class CharGPT(nn.Module):
    """A character-level GPT: token and position embeddings, pre-LN blocks, a final LN and an
    untied head. GPT-2's initialisation (normal 0.02, residual projections scaled by
    ``1/sqrt(2 * blocks)``)."""

    def __init__(self, vocab: int, blocks: int = 4, d_model: int = 64, heads: int = 4,
                 context: int = CONTEXT, dropout: float = 0.1) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(context, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(
            Block(d_model, heads, context, dropout) for _ in range(blocks))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        for name, p in self.named_parameters():
            if name.endswith("weight") and p.dim() == 2:
                std = 0.02 / math.sqrt(2 * blocks) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, 0.0, std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.drop(self.tok(ids) + self.pos(positions))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class DigitsCNN(nn.Module):
    """Three conv + BatchNorm + ReLU blocks on 1x8x8 digits, then a Linear + ReLU head
    (``fc``, ``act_fc``), dropout and the classifier (``head``)."""

    def __init__(self, classes: int = 10, dropout: float = 0.1) -> None:
        super().__init__()
        self.conv1, self.bn1, self.act1 = nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), \
            nn.ReLU()
        self.conv2, self.bn2, self.act2 = nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), \
            nn.ReLU()
        self.pool = nn.MaxPool2d(2)
        self.conv3, self.bn3, self.act3 = nn.Conv2d(32, 32, 3, padding=1), nn.BatchNorm2d(32), \
            nn.ReLU()
        self.gap = nn.AdaptiveAvgPool2d(1)
        self.fc, self.act_fc = nn.Linear(32, 64), nn.ReLU()
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(64, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act2(self.bn2(self.conv2(self.act1(self.bn1(self.conv1(x))))))
        x = self.act3(self.bn3(self.conv3(self.pool(x))))
        x = self.act_fc(self.fc(self.gap(x).flatten(1)))
        return self.head(self.drop(x))


def tanh_mlp(width: int = 64, depth: int = 6, classes: int = 10,
             dropout: float = 0.1) -> nn.Sequential:
    """``depth`` Linear layers (``fc1`` ... ``fc6``) with tanh between them (``tanh1`` ...),
    Glorot-initialised with tanh's gain, and dropout before the last."""
    layers: dict[str, nn.Module] = {}
    for i in range(1, depth + 1):
        linear = nn.Linear(width, classes if i == depth else width)
        nn.init.xavier_uniform_(linear.weight, gain=nn.init.calculate_gain("tanh"))
        nn.init.zeros_(linear.bias)
        if i == depth:
            layers["drop"] = nn.Dropout(dropout)
        layers[f"fc{i}"] = linear
        if i < depth:
            layers[f"tanh{i}"] = nn.Tanh()
    return nn.Sequential(OrderedDict(layers))


@dataclass(frozen=True)
class Reference:
    """One healthy reference: a model, its data and its recipe.

    Attributes:
        name: ``"gpt"``, ``"cnn"`` or ``"tanh_mlp"``.
        batch: Samples per minibatch.
        lr: Peak learning rate (reached at the end of warmup).
        first: The model's first layer, where data enters (torch names).
    """

    name: str
    batch: int
    lr: float
    first: str


REFERENCES: dict[str, Reference] = {r.name: r for r in (
    Reference("gpt", batch=32, lr=3e-3, first="tok"),
    Reference("cnn", batch=64, lr=3e-3, first="conv1"),
    Reference("tanh_mlp", batch=64, lr=1e-3, first="fc1"),
)}


def build_torch(name: str) -> nn.Module:
    """A fresh torch model of reference ``name`` (seed the global RNG first)."""
    if name == "gpt":
        return CharGPT(vocab=len(corpus()[1]))
    if name == "cnn":
        return DigitsCNN()
    if name == "tanh_mlp":
        return tanh_mlp()
    raise KeyError(f"no reference named {name!r}; choose one of {sorted(REFERENCES)}")


def layer_groups(model: nn.Module, lr: float) -> list[dict[str, Any]]:
    """One AdamW parameter group per module that owns parameters, named after it, with its
    ``base_lr`` (the schedule multiplies it into ``lr`` every step)."""
    return [{"params": params, "name": name, "base_lr": lr}
            for name, module in model.named_modules()
            if (params := list(module.parameters(recurse=False)))]


# -- runs -----------------------------------------------------------------------------------------


@dataclass
class Run:
    """One training run of a reference under ``graddebug.watch``.

    Attributes:
        name: The reference.
        framework: ``"torch"``, ``"keras-fit"`` or ``"keras-tape"``.
        seed: Seed of the initialisation, the dropout masks and the minibatches.
        model: The trained model.
        optimizer: Its optimizer.
        watcher: The exited Watcher (its frames and findings stay readable).
        losses: The batch loss of every step (the training forward, dropout on).
        seconds: Wall time of the training loop.
        findings_by_step: ``dbg.findings()`` after each step, where asked for.
        updates: Where asked for, the harness's own measurement of every parameter at every
            step: ``step, layer, tensor, numel, weight_norm`` (before the update) and
            ``update_norm`` (``||w_after - w_before||``), exact, in float64.
    """

    name: str
    framework: str
    seed: int
    model: Any
    optimizer: Any
    watcher: Any
    losses: list[float]
    seconds: float
    findings_by_step: list[pd.DataFrame] | None = None
    updates: pd.DataFrame | None = None

    def frame(self) -> pd.DataFrame:
        """``dbg.frame()`` of the run."""
        return self.watcher.frame()

    def findings(self) -> pd.DataFrame:
        """``dbg.findings()`` at the end of the run."""
        return self.watcher.findings()


def _takes_loss(dbg: Any) -> bool:
    """Whether ``dbg.step`` accepts ``loss=`` (then the loss-spike rule sees the loss)."""
    return "loss" in inspect.signature(dbg.step).parameters


_UPDATE_COLUMNS = ["step", "layer", "tensor", "numel", "weight_norm", "update_norm"]


def run_torch(name: str, steps: int = STEPS, *, seed: int = 0, fault: Fault | None = None,
              findings_each_step: bool = False, measure_updates: bool = False,
              watch_options: dict[str, Any] | None = None, threads: int | None = 1,
              schedule: int | None = None) -> Run:
    """Train torch reference ``name`` for ``steps`` steps under ``graddebug.watch(model)``.

    Each step: ``fault`` (if any), the scheduled learning rates, the minibatch, forward,
    ``zero_grad``, ``backward``, ``clip_grad_norm_``, ``opt.step()``, ``dbg.step()`` (with
    ``loss=`` where the Watcher takes it).

    Args:
        name: ``"gpt"``, ``"cnn"`` or ``"tanh_mlp"``.
        steps: Training steps; the schedule reaches 0 at the last one.
        seed: Seeds the model's initialisation, the dropout masks and the minibatches.
        fault: ``fault(step, model, optimizer)``, called before each step's forward pass.
        findings_each_step: Collect ``dbg.findings()`` after every ``dbg.step()`` (each call
            diagnoses the whole run so far: it costs time).
        measure_updates: Measure every parameter's weight and update norms in the loop.
        watch_options: Keyword options for ``graddebug.watch`` (none: its defaults).
        threads: torch's intra-op threads for the run (restored after it); None leaves them.
            One by default: on the shared 2-core CPU, busy with other work, the GPT took
            1.45 s a step on 2 threads against 0.14 s on 1.
        schedule: The length of run the schedule is planned for (None: ``steps``): a run
            stopped early, on a learning rate that is still near its peak.

    Returns:
        The run.
    """
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _run_torch(name, steps, seed, fault, findings_each_step, measure_updates,
                          watch_options or {}, schedule or steps)
    finally:
        torch.set_num_threads(previous)


def _run_torch(name: str, steps: int, seed: int, fault: Fault | None,
               findings_each_step: bool, measure_updates: bool,
               watch_options: dict[str, Any], schedule: int) -> Run:
    ref = REFERENCES[name]
    torch.manual_seed(seed)
    model = build_torch(name)
    model.train()
    opt = torch.optim.AdamW(layer_groups(model, ref.lr), lr=ref.lr, weight_decay=WEIGHT_DECAY)
    x_all, y_all = arrays(name, batch_indices(name, steps, ref.batch, seed))
    named = [(layer, tensor, p) for layer, m in model.named_modules()
             for tensor, p in m.named_parameters(recurse=False)]
    losses: list[float] = []
    by_step: list[pd.DataFrame] | None = [] if findings_each_step else None
    rows: list[tuple[int, str, str, int, float, float]] = []
    with graddebug.watch(model, **watch_options) as dbg:
        step_kw = _takes_loss(dbg)
        start = time.perf_counter()
        for step in range(steps):
            if fault is not None:
                fault(step, model, opt)
            factor = lr_factor(step, schedule)
            for group in opt.param_groups:
                group["lr"] = group["base_lr"] * factor
            x, y = torch.from_numpy(x_all[step]), torch.from_numpy(y_all[step])
            logits = model(x)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), CLIP_NORM)
            before = [p.detach().clone() for _, _, p in named] if measure_updates else []
            opt.step()
            value = loss.item()
            losses.append(value)
            if step_kw:
                dbg.step(loss=value)
            else:
                dbg.step()
            if measure_updates:
                rows += _torch_updates(step, named, before)
            if by_step is not None:
                by_step.append(dbg.findings())
        seconds = time.perf_counter() - start
    updates = pd.DataFrame(rows, columns=_UPDATE_COLUMNS) if measure_updates else None
    return Run(name, "torch", seed, model, opt, dbg, losses, seconds, by_step, updates)


def _torch_updates(step: int, named: Sequence[tuple[str, str, torch.Tensor]],
                   before: Sequence[torch.Tensor]
                   ) -> list[tuple[int, str, str, int, float, float]]:
    with torch.no_grad():
        weights = torch.stack([b.double().norm() for b in before]).tolist()
        moves = torch.stack([(p.double() - b.double()).norm()
                             for (_, _, p), b in zip(named, before, strict=True)]).tolist()
    return [(step, layer, tensor, p.numel(), w, u)
            for (layer, tensor, p), w, u in zip(named, weights, moves, strict=True)]


# -- Keras ----------------------------------------------------------------------------------------


@functools.cache
def _keras_parts() -> Any:
    """The Keras classes of this module, defined on first use so that importing the module
    does not import TensorFlow."""
    import keras
    from keras import ops

    class Positions(keras.layers.Layer):
        """Adds a learned position embedding to a (batch, time, d_model) input."""

        def __init__(self, context: int, d_model: int, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.table = self.add_weight(
                shape=(context, d_model), name="embeddings",
                initializer=keras.initializers.RandomNormal(stddev=0.02))

        def call(self, x: Any) -> Any:
            return x + self.table[: ops.shape(x)[1]]

    class BatchLoss(keras.metrics.Metric):
        """The mean cross-entropy of the last batch (fit's ``loss`` log is a running mean)."""

        def __init__(self, name: str = "batch_loss", **kwargs: Any) -> None:
            super().__init__(name=name, **kwargs)
            self.value = self.add_variable(shape=(), initializer="zeros", name="value")

        def update_state(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> None:
            self.value.assign(ops.mean(keras.losses.sparse_categorical_crossentropy(
                y_true, y_pred, from_logits=True)))

        def result(self) -> Any:
            return self.value

        def reset_state(self) -> None:
            self.value.assign(0.0)

    class WarmupCosine(keras.optimizers.schedules.LearningRateSchedule):
        """:func:`lr_factor` times ``peak * boost``; ``boost`` is a variable a fault sets."""

        def __init__(self, peak: float, steps: int, warmup: int = WARMUP) -> None:
            self.peak, self.steps, self.warmup = peak, steps, warmup
            self.boost = keras.Variable(1.0, trainable=False, name="lr_boost")

        def __call__(self, step: Any) -> Any:
            step = ops.cast(step, "float32")
            span = float(max(self.steps - 1 - self.warmup, 1))
            decay = ops.minimum(ops.maximum(step - self.warmup, 0.0), span) / span
            cosine = 0.5 * (1.0 + ops.cos(math.pi * decay))
            factor = ops.where(step < self.warmup, step / self.warmup, cosine)
            return self.peak * self.boost * factor

        def get_config(self) -> dict[str, Any]:
            return {"peak": self.peak, "steps": self.steps, "warmup": self.warmup}

    return Positions, BatchLoss, WarmupCosine


def build_keras(name: str) -> Any:
    """A fresh Keras model of reference ``name`` (call ``keras.utils.set_random_seed`` first).

    Layer names follow the torch models where they can (``fc``, ``head``, ``b0_fc``...); the
    Keras GPT has 2 blocks and uses ``MultiHeadAttention`` with a causal mask.
    """
    import keras
    from keras import layers

    positions_cls = _keras_parts()[0]
    normal = keras.initializers.RandomNormal(stddev=0.02)
    if name == "gpt":
        d, blocks, vocab = 64, 2, len(corpus()[1])
        ids = keras.Input((CONTEXT,), dtype="int32")
        x = layers.Embedding(vocab, d, embeddings_initializer=normal, name="tok")(ids)
        x = layers.Dropout(0.1, name="drop")(positions_cls(CONTEXT, d, name="pos")(x))
        for b in range(blocks):
            h = layers.LayerNormalization(epsilon=1e-5, name=f"b{b}_ln1")(x)
            h = layers.MultiHeadAttention(4, d // 4, dropout=0.1, kernel_initializer=normal,
                                          name=f"b{b}_attn")(h, h, use_causal_mask=True)
            x = layers.Add(name=f"b{b}_add1")([x, layers.Dropout(0.1, name=f"b{b}_drop1")(h)])
            h = layers.LayerNormalization(epsilon=1e-5, name=f"b{b}_ln2")(x)
            h = layers.Dense(4 * d, activation="gelu", kernel_initializer=normal,
                             name=f"b{b}_fc")(h)
            h = layers.Dense(d, kernel_initializer=keras.initializers.RandomNormal(
                stddev=0.02 / math.sqrt(2 * blocks)), name=f"b{b}_proj")(h)
            x = layers.Add(name=f"b{b}_add2")([x, layers.Dropout(0.1, name=f"b{b}_drop2")(h)])
        x = layers.LayerNormalization(epsilon=1e-5, name="ln_f")(x)
        out = layers.Dense(vocab, use_bias=False, kernel_initializer=normal, name="head")(x)
        return keras.Model(ids, out, name="gpt")
    if name == "cnn":
        x = images = keras.Input((8, 8, 1))
        for i, width in enumerate((16, 32, 32), start=1):
            if i == 3:
                x = layers.MaxPooling2D(2, name="pool")(x)
            x = layers.Conv2D(width, 3, padding="same", name=f"conv{i}")(x)
            x = layers.BatchNormalization(momentum=0.9, epsilon=1e-5, name=f"bn{i}")(x)
            x = layers.ReLU(name=f"act{i}")(x)
        x = layers.GlobalAveragePooling2D(name="gap")(x)
        x = layers.ReLU(name="act_fc")(layers.Dense(64, name="fc")(x))
        out = layers.Dense(10, name="head")(layers.Dropout(0.1, name="drop")(x))
        return keras.Model(images, out, name="cnn")
    if name == "tanh_mlp":
        glorot = keras.initializers.VarianceScaling(25 / 9, "fan_avg", "uniform")
        stack: list[Any] = [keras.Input((64,))]
        for i in range(1, 7):
            if i == 6:
                stack.append(layers.Dropout(0.1, name="drop"))
            stack.append(layers.Dense(10 if i == 6 else 64, kernel_initializer=glorot,
                                      name=f"fc{i}"))
            if i < 6:
                stack.append(layers.Activation("tanh", name=f"tanh{i}"))
        return keras.Sequential(stack, name="tanh_mlp")
    raise KeyError(f"no reference named {name!r}; choose one of {sorted(REFERENCES)}")


def run_keras(name: str, steps: int = STEPS, *, seed: int = 0, mode: str = "fit",
              fault: Fault | None = None, measure_updates: bool = False,
              watch_options: dict[str, Any] | None = None, schedule: int | None = None) -> Run:
    """Train Keras reference ``name`` for ``steps`` steps under ``graddebug.watch(model)``.

    ``mode="fit"``: ``model.fit`` over exactly ``steps`` minibatches with
    ``callbacks=[harness, dbg.callback()]``; the harness callback calls ``fault`` in
    ``on_train_batch_begin``. ``mode="tape"``: a ``tf.function`` train step with a
    ``tf.GradientTape`` (traced inside the watch block), then ``dbg.step(grads)``. Either way
    the optimizer is AdamW with the warmup-cosine schedule and ``global_clipnorm=1.0``.

    Args:
        name: ``"gpt"``, ``"cnn"`` or ``"tanh_mlp"``.
        steps: Training steps.
        seed: Seeds the initialisation, the dropout masks and the minibatches.
        mode: ``"fit"`` or ``"tape"``.
        fault: ``fault(step, model, optimizer)``, called before each step's forward pass.
        measure_updates: Measure every variable's weight and update norms in the loop.
        watch_options: Keyword options for ``graddebug.watch`` (none: its defaults).
        schedule: The length of run the schedule is planned for (None: ``steps``).

    Returns:
        The run.

    Raises:
        ValueError: ``mode`` is neither ``"fit"`` nor ``"tape"``.
    """
    import keras
    import tensorflow as tf

    if mode not in ("fit", "tape"):
        raise ValueError(f"mode must be 'fit' or 'tape', not {mode!r}")
    ref = REFERENCES[name]
    _, batch_loss_cls, schedule_cls = _keras_parts()
    keras.utils.set_random_seed(seed)
    model = build_keras(name)
    opt = keras.optimizers.AdamW(learning_rate=schedule_cls(ref.lr, schedule or steps),
                                 weight_decay=WEIGHT_DECAY, global_clipnorm=CLIP_NORM)
    x_all, y_all = arrays(name, batch_indices(name, steps, ref.batch, seed))
    if name == "cnn":
        x_all = np.moveaxis(x_all, 2, -1)  # channels last
    xs = x_all.reshape(-1, *x_all.shape[2:])
    ys = y_all.reshape(-1, *y_all.shape[2:])
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    harness = _KerasHarness(fault, measure_updates)
    with graddebug.watch(model, **(watch_options or {})) as dbg:
        harness.set_model(model)
        start = time.perf_counter()
        if mode == "fit":
            model.compile(optimizer=opt, loss=loss_fn, metrics=[batch_loss_cls()])
            model.fit(xs, ys, batch_size=ref.batch, epochs=1, shuffle=False, verbose=0,
                      callbacks=[harness.callback(), dbg.callback()])
        else:
            step_kw = _takes_loss(dbg)

            @tf.function
            def train_step(x: Any, y: Any) -> Any:
                with tf.GradientTape() as tape:
                    loss = loss_fn(y, model(x, training=True))
                grads = tape.gradient(loss, model.trainable_variables)
                opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
                return grads, loss

            for step in range(steps):
                harness.begin(step, opt)
                grads, loss = train_step(x_all[step], y_all[step])
                value = float(loss)
                if step_kw:
                    dbg.step(grads, loss=value)
                else:
                    dbg.step(grads)
                harness.end(step, value)
        seconds = time.perf_counter() - start
    return Run(name, f"keras-{mode}", seed, model, opt, dbg, harness.losses, seconds, None,
               harness.updates())


class _KerasHarness:
    """Calls the fault, measures the weights and keeps the batch losses of a Keras run."""

    def __init__(self, fault: Fault | None, measure: bool) -> None:
        self.fault, self.measure = fault, measure
        self.losses: list[float] = []
        self.rows: list[tuple[int, str, str, int, float, float]] = []
        self._before: list[np.ndarray] = []
        self.model: Any = None

    def set_model(self, model: Any) -> None:
        """The model the fault and the measurements act on."""
        self.model = model

    def begin(self, step: int, optimizer: Any) -> None:
        """Before the step's forward pass: the fault, then the weights it starts from."""
        if self.fault is not None:
            self.fault(step, self.model, optimizer)
        if self.measure:
            self._before = [np.array(v.numpy(), np.float64)
                            for v in self.model.trainable_variables]

    def end(self, step: int, loss: float) -> None:
        """After the step's update: its batch loss and every variable's move."""
        self.losses.append(loss)
        if not self.measure:
            return
        for v, was in zip(self.model.trainable_variables, self._before, strict=True):
            layer, _, tensor = v.path.rpartition("/")
            self.rows.append((step, layer, tensor, was.size, float(np.linalg.norm(was)),
                              float(np.linalg.norm(np.asarray(v.numpy(), np.float64) - was))))

    def updates(self) -> pd.DataFrame | None:
        """The measurements as :attr:`Run.updates`, or None when not asked for."""
        return pd.DataFrame(self.rows, columns=_UPDATE_COLUMNS) if self.measure else None

    def callback(self) -> Any:
        """The harness as a Keras callback for ``fit``."""
        import keras

        harness = self

        class Harness(keras.callbacks.Callback):
            def on_train_batch_begin(self, batch: int, logs: dict[str, Any] | None = None
                                     ) -> None:
                harness.begin(batch, self.model.optimizer)

            def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None
                                   ) -> None:
                harness.end(batch, float((logs or {}).get("batch_loss", math.nan)))

        return Harness()


# -- fault injectors ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Injected:
    """A fault, with the diagnosis it should get.

    Attributes:
        name: Short name of the fault.
        at: The first step the fault changes (it acts before that step's forward pass).
        source: The layer that is the true source (torch or Keras name), or None when no
            single layer is (the optimizer's learning rate for every layer).
        cause: The ``cause`` a finding about it should carry: ``data``, ``optimizer``,
            ``layer``, ``numerics`` or ``graph``.
        apply: ``apply(model, optimizer)``, run before the forward pass of step ``at`` (and
            of the ``repeat - 1`` steps after it).
        frameworks: Where it applies: ``"torch"``, ``"keras"`` or both.
        repeat: ``apply`` runs before each of this many steps from ``at`` (a fault that
            builds up over several steps).
    """

    name: str
    at: int
    source: str | None
    cause: str
    apply: Callable[[Any, Any], None] = field(repr=False)
    frameworks: tuple[str, ...] = ("torch", "keras")
    repeat: int = 1

    def __call__(self, step: int, model: Any, optimizer: Any) -> None:
        """The ``fault(step, model, optimizer)`` of :func:`run_torch` and :func:`run_keras`."""
        if self.at <= step < self.at + self.repeat:
            self.apply(model, optimizer)


def _is_torch(model: Any) -> bool:
    return isinstance(model, nn.Module)


def _keras_variable(model: Any, layer: str, tensor: str) -> Any:
    for candidate in model._flatten_layers(include_self=False, recursive=True):
        if candidate.name == layer:
            for v in candidate.trainable_variables:
                if v.name == tensor:
                    return v
    raise KeyError(f"no variable {tensor!r} in a layer named {layer!r} of {model.name!r}")


def _change_weight(model: Any, layer: str, tensor: str,
                   change: Callable[[np.ndarray], np.ndarray]) -> None:
    """Replace one parameter by ``change(values)``, in either framework."""
    if _is_torch(model):
        p = getattr(model.get_submodule(layer), tensor)
        with torch.no_grad():
            p.copy_(torch.from_numpy(change(p.detach().numpy().copy())))
    else:
        v = _keras_variable(model, layer, "kernel" if tensor == "weight" else tensor)
        v.assign(change(np.array(v.numpy())))


def nan_weight(layer: str, at: int, tensor: str = "weight") -> Injected:
    """One entry of ``layer``'s weight set to NaN at step ``at``.

    True source: ``layer``. Cause: ``layer`` (the layer's own weights went bad; the forward
    pass then carries NaN from that layer on, and the optimizer spreads it to every weight).
    """
    def apply(model: Any, optimizer: Any) -> None:
        def poison(w: np.ndarray) -> np.ndarray:
            w.flat[0] = np.nan
            return w
        _change_weight(model, layer, tensor, poison)

    return Injected("nan_weight", at, layer, "layer", apply)


def scale_weight(layer: str, factor: float, at: int, tensor: str = "weight",
                 name: str = "scale_weight") -> Injected:
    """``layer``'s weight multiplied by ``factor`` at step ``at``.

    True source: ``layer``. Cause: ``layer`` (a weight far too large or too small).
    """
    def apply(model: Any, optimizer: Any) -> None:
        _change_weight(model, layer, tensor, lambda w: w * factor)

    return Injected(name, at, layer, "layer", apply)


def mlp_weight_shrink(at: int, layer: str = "fc3") -> Injected:
    """A tanh-MLP weight x1e-4: the signal after it is 1e-4 times smaller, so the gradients
    of the layers above it (their inputs) and below it (back through it) shrink by about 1e4.

    True source: ``layer`` (default ``fc3`` of ``tanh_mlp``). Cause: ``layer``.
    """
    return scale_weight(layer, 1e-4, at, name="mlp_weight_shrink")


def conv_before_batchnorm(at: int, layer: str = "conv2") -> Injected:
    """A conv weight x1e4 in front of its BatchNorm: the forward pass is unchanged (BatchNorm
    divides the scale out), the conv's weight gradient drops by 1e4 and its update/weight
    ratio with it: the layer stops learning.

    True source: ``layer`` (default ``conv2`` of ``cnn``). Cause: ``layer``.
    """
    return scale_weight(layer, 1e4, at, name="conv_before_batchnorm")


def gpt_fc_blowup(at: int, block: int = 1) -> Injected:
    """The GPT's MLP ``fc`` weight x1e4 in one block: that block's MLP output, and the
    residual stream from it on, grow by about 1e4 in the forward pass. In this pre-LN model the
    LayerNorms after it divide the scale out, so the gradients do not explode: measured at
    step 25 of 30, the gradients at the outputs of the later blocks' branches and of ``fc``
    itself fell by 1e3-1e4 (``fc.weight`` from 0.040 to 2.3e-5), ``proj.weight``'s rose 8x,
    and ``fc``'s update/weight ratio collapsed (Adam's step is the same, the weight 1e4x).

    True source: ``blocks.{block}.mlp.fc`` (torch) or ``b{block}_fc`` (Keras). Cause:
    ``layer``. Use :func:`scale_weight` with the Keras name for the Keras GPT.
    """
    return scale_weight(f"blocks.{block}.mlp.fc", 1e4, at, name="gpt_fc_blowup")


def tanh_saturate(at: int, layer: str = "fc2") -> Injected:
    """A tanh-MLP weight x1e3: the tanh after it saturates (its derivative is ~0), so the
    gradients below it vanish.

    True source: ``layer`` (default ``fc2`` of ``tanh_mlp``). Cause: ``layer``.
    """
    return scale_weight(layer, 1e3, at, name="tanh_saturate")


def dead_relu_bias(at: int, layer: str = "fc", value: float = -50.0) -> Injected:
    """The bias of the Linear before a ReLU set to ``value``: every unit of the ReLU after it
    (``act_fc``) outputs 0, for every sample, from then on.

    True source: ``layer`` (default ``fc`` of ``cnn``). Cause: ``layer``.
    """
    def apply(model: Any, optimizer: Any) -> None:
        _change_weight(model, layer, "bias", lambda b: np.full_like(b, value))

    return Injected("dead_relu_bias", at, layer, "layer", apply)


def lr_boost(at: int, factor: float = 1e4) -> Injected:
    """The learning rate of every layer multiplied by ``factor`` from step ``at`` on (torch:
    every group's ``base_lr``; Keras: the schedule's ``boost`` variable).

    True source: None (no single layer: every layer's update jumps together). Cause:
    ``optimizer``.
    """
    def apply(model: Any, optimizer: Any) -> None:
        if _is_torch(model):
            for group in optimizer.param_groups:
                group["base_lr"] *= factor
        else:
            boost = optimizer._learning_rate.boost  # the WarmupCosine of run_keras
            boost.assign(boost.numpy() * factor)

    return Injected("lr_boost", at, None, "optimizer", apply)


def _groups_of(optimizer: Any, layer: str) -> list[dict[str, Any]]:
    """The parameter groups of ``layer`` in an optimizer of :func:`run_torch`."""
    groups = [g for g in optimizer.param_groups if g.get("name") == layer]
    if not groups:
        raise KeyError(f"no parameter group named {layer!r}")
    return groups


def freeze_layer(layer: str, at: int) -> Injected:
    """A freezing bug: the learning rate of ``layer``'s parameter group set to 0 from step
    ``at`` on (its ``base_lr``; AdamW's decoupled weight decay is scaled by it too, so the
    layer's weights stop changing at all). Torch only: the optimizers of :func:`run_torch`
    hold one group per layer.

    True source: ``layer``. Cause: ``optimizer``.
    """
    def apply(model: Any, optimizer: Any) -> None:
        for group in _groups_of(optimizer, layer):
            group["base_lr"] = 0.0

    return Injected("freeze_layer", at, layer, "optimizer", apply, ("torch",))


def lr_divide(layer: str, at: int, factor: float = 7.0) -> Injected:
    """A learning-rate bug in one layer: the ``base_lr`` of ``layer``'s parameter group
    divided by ``factor`` from step ``at`` on (AdamW's decoupled weight decay with it), while
    every other layer keeps its schedule. The layer's update/weight ratio falls ``factor``
    times and stays there: a sustained shift, smaller than ``history_factor`` (10) and larger
    than ``history_sustain_factor`` (6) at the default 7. Torch only: the optimizers of
    :func:`run_torch` hold one group per layer.

    True source: ``layer``. Cause: ``optimizer``.
    """
    def apply(model: Any, optimizer: Any) -> None:
        for group in _groups_of(optimizer, layer):
            group["base_lr"] /= factor

    return Injected("lr_divide", at, layer, "optimizer", apply, ("torch",))


def gradual_shrink(layer: str, at: int, factor: float = 3.0, steps: int = 3) -> Injected:
    """``layer``'s weight divided by ``factor`` before each of ``steps`` steps from ``at``:
    the weight falls ``factor ** steps`` times in all (27 at the defaults), never
    ``history_factor`` (10) times from one step to the next: the rule for weights edited
    outside the optimizer sees it over its last ``history_sustain_steps`` steps. Measured on
    ``tanh_mlp``'s ``fc3`` at step 70 of a 500-step schedule: the gradients below it do not
    fall 27x (the loss rises and clipping rescales every gradient), they fall 4x net of the
    loss side, while ``fc3``'s own gradient rises 10x and its update/weight ratio 12.6x by
    the second step (Adam's update keeps its size, the weight shrinks).

    True source: ``layer``. Cause: ``layer``.
    """
    def apply(model: Any, optimizer: Any) -> None:
        _change_weight(model, layer, "weight", lambda w: w / factor)

    return Injected("gradual_shrink", at, layer, "layer", apply, repeat=steps)


def inf_pixel(at: int, layer: str = "conv1", pixel: int = 27) -> Injected:
    """One pixel of one image set to +Inf in the batch of step ``at`` (that batch only), for
    the digits models: a forward pre-hook on the model, registered first so that it runs
    before graddebug's input check, rewrites the input once and removes itself. Torch only.

    True source: the input, which enters at ``layer`` (``conv1`` for ``cnn``, ``fc1`` for
    ``tanh_mlp``). Cause: ``data``.
    """
    def apply(model: Any, optimizer: Any) -> None:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
            handle.remove()
            x = args[0].clone()
            x.view(x.shape[0], -1)[0, pixel] = math.inf
            return (x, *args[1:])

        handle = model.register_forward_pre_hook(hook, prepend=True)

    return Injected("inf_pixel", at, layer, "data", apply, ("torch",))


def detach_attention(at: int, block: int = 1) -> Injected:
    """A ``.detach()`` switched on inside one GPT attention block from step ``at`` on: the
    heads' output is detached before ``proj``, so ``qkv`` gets no gradient. Torch only.

    True source: ``blocks.{block}.attn.qkv`` (the layer behind the cut). Cause: ``graph``.
    """
    def apply(model: Any, optimizer: Any) -> None:
        model.blocks[block].attn.detach = True

    return Injected("detach_attention", at, f"blocks.{block}.attn.qkv", "graph", apply,
                    ("torch",))


def masked_attention_row(at: int, block: int = 1, row: int = 5) -> Injected:
    """One row of one GPT attention mask made all ``-inf`` from step ``at`` on: the softmax of
    that row is NaN (0/0), in the forward pass. Torch only.

    True source: ``blocks.{block}.attn`` (the softmax inside it, between its children; the
    first child to receive the NaN is ``blocks.{block}.attn.attn_drop``). Cause: ``numerics``.
    """
    def apply(model: Any, optimizer: Any) -> None:
        model.blocks[block].attn.masked_row = row

    return Injected("masked_attention_row", at, f"blocks.{block}.attn", "numerics", apply,
                    ("torch",))


def catalogue(at: int = 250) -> list[tuple[str, Injected]]:
    """Every injector on the torch reference it is meant for, acting at step ``at``."""
    return [
        ("gpt", nan_weight("blocks.1.mlp.fc", at)),
        ("gpt", detach_attention(at)),
        ("gpt", masked_attention_row(at)),
        ("cnn", inf_pixel(at)),
        ("tanh_mlp", inf_pixel(at, layer="fc1")),
        ("gpt", lr_boost(at)),
        ("tanh_mlp", mlp_weight_shrink(at)),
        ("cnn", conv_before_batchnorm(at)),
        ("gpt", gpt_fc_blowup(at)),
        ("tanh_mlp", tanh_saturate(at)),
        ("cnn", dead_relu_bias(at)),
        ("cnn", freeze_layer("conv2", at)),
        ("gpt", freeze_layer("blocks.2.mlp.fc", at)),
    ]
