"""The model zoo: real third-party architectures from tiny configs, random init, no download.

Shared by ``tests/test_zoo_torch.py``, ``tests/test_zoo_tf.py`` and ``benchmarks/zoo.py``.
Frameworks are imported inside the functions, so importing this module costs nothing.

torchvision and timm are not in the zoo: the only torchvision wheel on the package mirror this
project installs from that matches torch 2.13 (0.28.0) is built against CUDA torch and fails to
import next to the CPU build (``operator torchvision::nms does not exist``), 0.29 requires
another torch, and timm imports torchvision. Their families are covered by transformers' own
ResNet, ConvNeXt and ViT and by the Keras applications.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

STEPS = 3
"""SGD steps per run: enough for the diagnoses that compare steps, small enough for 2 cores."""
LR = 1e-2
SEED = 0

# -- torch: transformers models from tiny configs -------------------------------------------------


@dataclass(frozen=True)
class TorchCase:
    """One torch architecture.

    Attributes:
        name: Short name (the test id and the README row).
        family: What kind of architecture it stands for.
        build: Returns the model, randomly initialised (call under a seed).
        batch: Returns the inputs (deterministic).
        loss: ``loss(model, batch)`` -> scalar loss tensor.
        early: A module near the input whose ``weight`` and output are checked against autograd.
        late: A module near the output, checked the same way.
    """

    name: str
    family: str
    build: Callable[[], Any]
    batch: Callable[[], dict[str, Any]]
    early: str
    late: str
    loss: Callable[[Any, dict[str, Any]], Any] = field(
        default=lambda model, batch: model(**batch).loss)


def _ids(shape: tuple[int, ...], high: int = 64, seed: int = 1) -> Any:
    import torch

    return torch.randint(0, high, shape, generator=torch.Generator().manual_seed(seed))


def _floats(shape: tuple[int, ...], seed: int = 2) -> Any:
    import torch

    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _causal_lm(kind: str) -> Callable[[], Any]:
    def build() -> Any:
        import transformers as t

        common = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                      max_position_embeddings=32, bos_token_id=0, eos_token_id=0,
                      pad_token_id=0)
        if kind == "llama":
            return t.LlamaForCausalLM(t.LlamaConfig(**common))
        return t.Qwen2ForCausalLM(t.Qwen2Config(**common))
    return build


def _gpt2() -> Any:
    import transformers as t

    return t.GPT2LMHeadModel(t.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64,
                                          n_positions=32, bos_token_id=0, eos_token_id=0))


def _bert() -> Any:
    import transformers as t

    return t.BertForSequenceClassification(t.BertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        vocab_size=64, max_position_embeddings=32, num_labels=3))


def _vit() -> Any:
    import transformers as t

    return t.ViTForImageClassification(t.ViTConfig(
        image_size=16, patch_size=4, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=2, intermediate_size=64, num_labels=3))


def _t5() -> Any:
    import transformers as t

    return t.T5ForConditionalGeneration(t.T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1))


def _whisper() -> Any:
    import transformers as t

    return t.WhisperForConditionalGeneration(t.WhisperConfig(
        vocab_size=64, d_model=32, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
        decoder_ffn_dim=64, num_mel_bins=8, max_source_positions=16, max_target_positions=16,
        pad_token_id=0, bos_token_id=0, eos_token_id=1, decoder_start_token_id=0))


def _resnet() -> Any:
    import transformers as t

    return t.ResNetForImageClassification(t.ResNetConfig(
        embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic",
        num_labels=3))


def _convnext() -> Any:
    import transformers as t

    return t.ConvNextForImageClassification(t.ConvNextConfig(
        num_stages=2, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3))


def _tokens() -> dict[str, Any]:
    ids = _ids((4, 8))
    return {"input_ids": ids, "labels": ids}


def _images(size: int) -> Callable[[], dict[str, Any]]:
    return lambda: {"pixel_values": _floats((4, 3, size, size)), "labels": _ids((4,), 3)}


TORCH_CASES: tuple[TorchCase, ...] = (
    TorchCase("gpt2", "decoder-only", _gpt2, _tokens,
              "transformer.h.0.attn.c_attn", "transformer.h.1.mlp.c_proj"),
    TorchCase("llama", "decoder-only", _causal_lm("llama"), _tokens,
              "model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"),
    TorchCase("qwen2", "decoder-only", _causal_lm("qwen2"), _tokens,
              "model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"),
    TorchCase("bert", "encoder-only", _bert,
              lambda: {"input_ids": _ids((4, 8)), "labels": _ids((4,), 3)},
              "bert.encoder.layer.0.attention.self.query", "classifier"),
    TorchCase("vit", "encoder-only (vision)", _vit, _images(16),
              "vit.embeddings.patch_embeddings.projection", "classifier"),
    TorchCase("t5", "encoder-decoder", _t5,
              lambda: {"input_ids": _ids((4, 8)), "labels": _ids((4, 6), seed=3)},
              "encoder.block.0.layer.0.SelfAttention.q",
              "decoder.block.1.layer.2.DenseReluDense.wo"),
    TorchCase("whisper", "encoder-decoder (speech)", _whisper,
              lambda: {"input_features": _floats((4, 8, 32)), "labels": _ids((4, 6), seed=3)},
              "model.encoder.conv1", "model.decoder.layers.0.fc2"),
    TorchCase("resnet", "CNN", _resnet, _images(32),
              "resnet.embedder.embedder.convolution", "classifier.1"),
    TorchCase("convnext", "CNN", _convnext, _images(32),
              "convnext.embeddings.patch_embeddings", "classifier"),
)
"""The transformers architectures of the zoo."""

TORCH_BY_NAME = {case.name: case for case in TORCH_CASES}


@dataclass
class TorchRun:
    """A finished torch run: the model after training, its Watcher (None unwatched), the
    hooks it had before watching, and the wall time of each step in seconds."""

    model: Any
    watcher: Any
    hooks_before: int
    times: list[float]


def torch_hook_count(model: Any) -> int:
    """Every hook a module or a parameter of ``model`` holds."""
    n = 0
    for m in model.modules():
        n += len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks)
        n += len(m._backward_pre_hooks)
    for p in model.parameters():
        n += len(getattr(p, "_post_accumulate_grad_hooks", None) or {})
        n += len(p._backward_hooks or {})
    return n


def build_torch(case: TorchCase) -> Any:
    """The case's model, initialised under :data:`SEED`, in training mode."""
    import torch

    torch.manual_seed(SEED)
    model = case.build()
    model.train()
    return model


def train_torch(case: TorchCase, *, watch: bool, steps: int = STEPS,
                mutate: Callable[[Any], None] | None = None, **options: Any) -> TorchRun:
    """Train the case with SGD, watched or not, from the same init and the same dropout masks.

    Args:
        case: The architecture.
        watch: Run inside ``graddebug.watch(model, **options)`` with ``dbg.step()`` per step.
        steps: Optimizer steps.
        mutate: Applied to the model before training (the broken variants).
    """
    import torch

    import graddebug

    model = build_torch(case)
    if mutate is not None:
        mutate(model)
    batch = case.batch()
    hooks = torch_hook_count(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    times: list[float] = []
    context = graddebug.watch(model, **options) if watch else contextlib.nullcontext()
    with context as dbg:
        for i in range(steps):
            torch.manual_seed(1000 + i)  # the same dropout masks in both runs
            start = time.perf_counter()
            case.loss(model, batch).backward()
            if dbg is not None:
                dbg.step()
            opt.step()
            opt.zero_grad()
            times.append(time.perf_counter() - start)
    return TorchRun(model, dbg, hooks, times)


def torch_reference(case: TorchCase) -> dict[tuple[str, str], float]:
    """Norms of the first step's gradients by ``torch.autograd.grad``, without graddebug:
    ``{(layer, "weight"): ..., (layer, "output"): ...}`` for the early and the late module."""
    import torch

    model = build_torch(case)
    batch = case.batch()
    modules = dict(model.named_modules())
    outputs: dict[str, Any] = {}
    handles = [modules[name].register_forward_hook(
        lambda m, args, out, name=name: outputs.__setitem__(name, out))
        for name in (case.early, case.late)]
    torch.manual_seed(1000)
    loss = case.loss(model, batch)
    for handle in handles:
        handle.remove()
    names = (case.early, case.late)
    wanted = [modules[n].weight for n in names] + [outputs[n] for n in names]
    grads = torch.autograd.grad(loss, wanted)
    keys = [(n, "weight") for n in names] + [(n, "output") for n in names]
    return {key: float(g.double().norm()) for key, g in zip(keys, grads, strict=True)}


# -- TensorFlow: Keras applications --------------------------------------------------------------


@dataclass(frozen=True)
class KerasCase:
    """One Keras application, ``weights=None``, small inputs.

    Attributes:
        name: The application (``"ResNet50"``).
        size: Input height and width.
        early: A layer near the input: its kernel and output are checked against
            ``tape.gradient``.
        late: A layer near the output: its kernel is checked.
        late_output: A layer near the output whose output is checked (the softmax output of
            ``predictions`` is not on the loss's path: Keras computes the cross-entropy from
            the logits it carries).
        preprocess: The ``keras.applications`` module whose ``preprocess_input`` the images
            go through, as the application's documentation asks.
    """

    name: str
    size: int
    early: str
    late: str
    late_output: str
    preprocess: str
    family: str = "CNN (Keras applications)"


KERAS_CASES: tuple[KerasCase, ...] = (
    KerasCase("ResNet50", 32, "conv1_conv", "predictions", "conv5_block3_out", "resnet50"),
    KerasCase("MobileNetV2", 32, "Conv1", "predictions", "out_relu", "mobilenet_v2"),
    KerasCase("EfficientNetB0", 32, "stem_conv", "predictions", "top_activation",
              "efficientnet"),
)
KERAS_BY_NAME = {case.name: case for case in KERAS_CASES}
KERAS_CLASSES = 5
KERAS_BATCH = 4


def keras_setup() -> None:
    """Seeds and deterministic ops: two plain runs are then bitwise equal (the zoo tests
    show it before comparing a watched run with a plain one)."""
    import keras
    import tensorflow as tf

    keras.utils.set_random_seed(SEED)
    tf.config.experimental.enable_op_determinism()


def build_keras(case: KerasCase) -> Any:
    """The application, seeded, compiled with SGD and sparse cross-entropy on its softmax."""
    import keras

    keras.utils.set_random_seed(SEED)
    builder = getattr(keras.applications, case.name)
    model = builder(weights=None, input_shape=(case.size, case.size, 3),
                    classes=KERAS_CLASSES)
    model.compile(optimizer=keras.optimizers.SGD(LR),
                  loss=keras.losses.SparseCategoricalCrossentropy())
    return model


def keras_data(case: KerasCase, steps: int = STEPS) -> tuple[Any, Any]:
    """``steps`` batches of images (0-255 pixels through the application's
    ``preprocess_input``) and labels."""
    import importlib

    import numpy as np

    rng = np.random.default_rng(SEED)
    n = steps * KERAS_BATCH
    x = rng.uniform(0, 255, (n, case.size, case.size, 3)).astype("float32")
    module = importlib.import_module(f"keras.applications.{case.preprocess}")
    x = np.asarray(module.preprocess_input(x), dtype="float32")
    y = rng.integers(0, KERAS_CLASSES, (n,)).astype("int64")
    return x, y


def keras_layer_calls(model: Any) -> dict[str, Any]:
    """Each layer's own ``call`` attribute (None when it has none): what cleanup restores."""
    return {layer.name: vars(layer).get("call") for layer in model._flatten_layers()}


@dataclass
class KerasRun:
    """A finished Keras run: the model, its weights after training, its Watcher (None
    unwatched), each layer's own ``call`` before and after, and the step times in seconds."""

    model: Any
    weights: list[Any]
    watcher: Any
    calls_before: dict[str, Any]
    calls_after: dict[str, Any]
    times: list[float]


def train_keras(case: KerasCase, *, mode: str, watch: bool, steps: int = STEPS,
                mutate: Callable[[Any], None] | None = None) -> KerasRun:
    """Train the application from its seeded init, with ``fit`` or an eager tape loop.

    Args:
        case: The application.
        mode: ``"fit"`` (graph mode; watched through ``dbg.callback()``) or ``"tape"`` (an
            eager ``GradientTape`` loop; watched through ``dbg.step(grads)``).
        watch: Run inside ``graddebug.watch(model)``.
        steps: Batches (one epoch).
        mutate: Applied to the model before training (the broken variants).
    """
    import keras
    import tensorflow as tf

    import graddebug

    keras_setup()
    model = build_keras(case)
    if mutate is not None:
        mutate(model)
    x, y = keras_data(case, steps)
    calls = keras_layer_calls(model)
    times: list[float] = []
    context = graddebug.watch(model) if watch else contextlib.nullcontext()
    with context as dbg:
        if mode == "fit":
            class Timer(keras.callbacks.Callback):
                def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
                    self.start = time.perf_counter()

                def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
                    times.append(time.perf_counter() - self.start)

            callbacks = [Timer()] + ([dbg.callback()] if dbg is not None else [])
            model.fit(x, y, batch_size=KERAS_BATCH, epochs=1, shuffle=False, verbose=0,
                      callbacks=callbacks)
        else:
            opt, loss_fn = model.optimizer, model.loss
            for i in range(steps):
                xb = tf.constant(x[i * KERAS_BATCH:(i + 1) * KERAS_BATCH])
                yb = tf.constant(y[i * KERAS_BATCH:(i + 1) * KERAS_BATCH])
                start = time.perf_counter()
                with tf.GradientTape() as tape:
                    loss = loss_fn(yb, model(xb, training=True))
                grads = tape.gradient(loss, model.trainable_variables)
                opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
                if dbg is not None:
                    dbg.step(grads)
                times.append(time.perf_counter() - start)
    return KerasRun(model, model.get_weights(), dbg, calls, keras_layer_calls(model), times)


def keras_reference(case: KerasCase) -> dict[tuple[str, str], float]:
    """Norms of the first tape step's gradients by ``tape.gradient``, without graddebug:
    the early and late kernels, and the early and ``late_output`` layer outputs."""
    import keras
    import tensorflow as tf

    keras_setup()
    model = build_keras(case)
    x, y = keras_data(case)
    probe = keras.Model(model.inputs, [model.get_layer(case.early).output,
                                       model.get_layer(case.late_output).output,
                                       model.output])
    kernels = [model.get_layer(case.early).kernel, model.get_layer(case.late).kernel]
    with tf.GradientTape() as tape:
        early, late, out = probe(tf.constant(x[:KERAS_BATCH]), training=True)
        loss = model.loss(tf.constant(y[:KERAS_BATCH]), out)
    grads = tape.gradient(loss, [*kernels, early, late])
    keys = [(case.early, "kernel"), (case.late, "kernel"), (case.early, "output"),
            (case.late_output, "output")]
    return {key: float(tf.norm(tf.cast(g, tf.float64))) for key, g in zip(keys, grads,
                                                                        strict=True)}


# -- timing and reporting ------------------------------------------------------------------------


def median_ms(times: list[float]) -> float:
    """The median step time in milliseconds."""
    return 1000.0 * statistics.median(times)


def overhead_line(name: str, framework: str, plain: list[float], watched: list[float]) -> str:
    """The line the zoo prints per model: plain and watched step time, and their ratio."""
    p, w = median_ms(plain), median_ms(watched)
    return f"zoo {framework}/{name}: plain {p:.1f} ms/step, watched {w:.1f} ms/step ({w / p:.2f}x)"


def findings_text(findings: Any) -> str:
    """The findings as a table, for an assertion message."""
    if findings.empty:
        return "no finding"
    return findings[["step", "layer", "tensor", "issue", "severity", "message"]].to_string()
