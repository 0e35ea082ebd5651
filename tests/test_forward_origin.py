"""Where a NaN born in the forward pass came from: a layer's parameters, an operation, or the
parent's own code between its recorded children."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import graddebug  # noqa: E402

BETWEEN = "layer_input_nonfinite"


class Block(nn.Module):
    """Two recorded children and code between them that makes a NaN when ``poison`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 8)
        self.down = nn.Linear(8, 8)
        self.poison = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        if self.poison:  # 0/0 on the first row, as a softmax over an all -inf row gives
            h = torch.cat([h[:1] * 0 / 0, h[1:]])
        return self.down(torch.tanh(h))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(4, 8)
        self.block = Block()
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.stem(x)))


class Log(nn.Module):
    """A layer with no parameters whose own code makes NaN from a negative input."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)


def _train(model: nn.Module, steps: int, poison_at: int, poison) -> graddebug.Watcher:
    torch.manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with graddebug.watch(model) as dbg:
        for step in range(steps):
            if step == poison_at:
                poison(model)
            x = torch.randn(16, 4)
            loss = model(x).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            dbg.step()
    return dbg


def _nonfinite(dbg: graddebug.Watcher):
    found = dbg.findings()
    return found[found["issue"] == "nonfinite"]


def test_a_nan_made_between_two_children_names_their_parent() -> None:
    torch.manual_seed(0)
    dbg = _train(Net(), 6, 3, lambda m: setattr(m.block, "poison", True))
    found = _nonfinite(dbg)
    assert len(found) == 1, found
    row = found.iloc[0]
    assert (row["step"], row["layer"], row["cause"]) == (3, "block", "numerics")
    assert "'block.down'" in row["message"] and "between its children" in row["message"]
    events = dbg.events()
    between = events[events["event"] == BETWEEN]
    assert set(between["layer"]) == {"block.down"}
    assert set(between["tensor"]) == {"input.0"}
    assert between["step"].min() == 3
    # Before the fault the same inputs were checked and found finite: no event at all.
    assert events[events["step"] < 3].empty


def test_a_chain_of_recorded_layers_checks_no_input_of_its_own() -> None:
    # Each layer's input is the output before it, already checked: a NaN made at the second
    # layer shows as that layer's output, with no input event anywhere downstream.
    model = nn.Sequential(nn.Linear(4, 8), Log(), nn.Linear(8, 3))
    with torch.no_grad():
        model[0].bias.fill_(-100.0)  # log of a negative: NaN at the Log layer's output
    dbg = _train(model, 2, -1, lambda m: None)
    events = dbg.events()
    assert BETWEEN not in set(events["event"])
    found = _nonfinite(dbg)
    assert (found.iloc[0]["layer"], found.iloc[0]["cause"]) == ("1", "numerics")


def test_a_nan_entry_in_a_linear_weight_is_the_layers_parameters() -> None:
    model = nn.Sequential(nn.Linear(4, 512), nn.Tanh(), nn.Linear(512, 512), nn.Tanh(),
                          nn.Linear(512, 3))

    def poison(m: nn.Module) -> None:
        with torch.no_grad():
            m[2].weight[300, 17] = float("nan")  # one entry of 262144: outside a 1% sample

    dbg = _train(model, 6, 3, poison)
    found = _nonfinite(dbg)
    assert len(found) == 1, found
    row = found.iloc[0]
    assert (row["step"], row["layer"], row["cause"]) == (3, "2", "layer")
    assert "parameters hold NaN/Inf" in row["message"]


def test_an_inf_weight_entry_overflowing_is_not_claimed_as_the_parameters() -> None:
    # Inf (not NaN) from an affine map can be an overflow of finite values: numerics.
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 3))

    def poison(m: nn.Module) -> None:
        with torch.no_grad():
            m[0].bias.fill_(float("inf"))

    dbg = _train(model, 4, 2, poison)
    found = _nonfinite(dbg)
    assert (found.iloc[0]["step"], found.iloc[0]["layer"]) == (2, "0")
    assert found.iloc[0]["cause"] == "numerics"


class Masked(nn.Module):
    """Scores with an additive ``-inf`` mask, handed to a recorded softmax child: its input
    holds -inf on every step by design."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 6)
        self.softmax = nn.Softmax(dim=-1)
        self.head = nn.Linear(6, 3)
        self.register_buffer("mask", torch.tensor([0.0, 0.0, float("-inf")] * 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.softmax(self.proj(x) + self.mask))


def test_an_input_that_holds_minus_inf_by_design_gives_no_finding() -> None:
    dbg = _train(Masked(), 5, -1, lambda m: None)
    assert dbg.findings().empty, dbg.findings()["message"].tolist()
    # It is checked (it is no recorded output) and seen to hold -inf, which is no fault.
    events = dbg.events()
    between = events[events["event"] == BETWEEN]
    assert set(between["layer"]) == {"softmax"} and set(between["detail"]) == {"Inf"}
    # Reference: the softmax input really holds -inf.
    model = Masked()
    assert torch.isinf(model.proj(torch.randn(2, 4)) + model.mask).any()


def test_keras_a_nan_entry_in_a_dense_kernel_is_the_layers_parameters() -> None:
    tf = pytest.importorskip("tensorflow")
    keras = pytest.importorskip("keras")
    import numpy as np

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(64, activation="tanh"),
                              keras.layers.Dense(64, activation="tanh"),
                              keras.layers.Dense(3)])
    opt = keras.optimizers.SGD(0.01)
    rng = np.random.default_rng(0)
    with graddebug.watch(model, optimizer=opt) as dbg:
        for step in range(5):
            if step == 2:
                kernel = model.layers[1].kernel
                value = kernel.numpy()
                value[7, 5] = np.nan
                kernel.assign(value)
            x = tf.constant(rng.normal(size=(8, 4)), tf.float32)
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(x, training=True)))
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply(grads, model.trainable_variables)
            dbg.step()
    found = _nonfinite(dbg)
    assert len(found) == 1, found
    row = found.iloc[0]
    assert (row["step"], row["layer"], row["cause"]) == (2, model.layers[1].name, "layer")


def _keras_mlp():
    keras = pytest.importorskip("keras")
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(16, activation="tanh"),
                             keras.layers.Dense(3)])


def test_keras_an_inf_in_one_batch_of_a_tape_loop_is_the_data() -> None:
    tf = pytest.importorskip("tensorflow")
    keras = pytest.importorskip("keras")
    import numpy as np

    model = _keras_mlp()
    opt = keras.optimizers.SGD(0.01)
    rng = np.random.default_rng(0)
    with graddebug.watch(model, optimizer=opt) as dbg:
        for step in range(5):
            x = rng.normal(size=(8, 4)).astype("float32")
            if step == 3:
                x[2, 1] = np.inf
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(tf.constant(x), training=True)))
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply(grads, model.trainable_variables)
            dbg.step()
    events = dbg.events()
    inputs = events[events["event"] == "input_nonfinite"]
    assert list(zip(inputs["step"], inputs["layer"], inputs["tensor"], strict=True)) == [
        (3, "input", "args.0")]
    found = _nonfinite(dbg)
    row = found.iloc[0]
    assert (row["step"], row["layer"], row["cause"]) == (3, model.layers[0].name, "data")


def test_keras_fit_an_inf_in_one_batch_is_the_data() -> None:
    tf = pytest.importorskip("tensorflow")
    import numpy as np

    model = _keras_mlp()
    model.compile(optimizer="sgd", loss="mse")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 4)).astype("float32")
    y = rng.normal(size=(40, 3)).astype("float32")
    x[25, 0] = -np.inf  # batch 3 of 8-sample batches
    with graddebug.watch(model) as dbg:
        model.fit(tf.constant(x), tf.constant(y), batch_size=8, epochs=1, shuffle=False,
                  verbose=0, callbacks=[dbg.callback()])
    found = _nonfinite(dbg)
    assert len(found) >= 1, dbg.findings()
    row = found.iloc[0]
    assert (row["step"], row["cause"]) == (3, "data"), row["message"]
    # A healthy fit checks the same inputs and finds nothing.
    model = _keras_mlp()
    model.compile(optimizer="sgd", loss="mse")
    x[25, 0] = 0.0
    with graddebug.watch(model) as dbg:
        model.fit(tf.constant(x), tf.constant(y), batch_size=8, epochs=1, shuffle=False,
                  verbose=0, callbacks=[dbg.callback()])
    assert "input_nonfinite" not in set(dbg.events()["event"])
