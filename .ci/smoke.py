"""A smoke test of the installed wheels, run by .ci/wheels in a fresh venv outside the checkout.

Each framework's adapter is found through its entry point and names a fault it is given; the
CLI reads a run back and writes the HTML report; the pytest plugin's fixture works. A missing
module, package file or entry point in a wheel fails here. Exits non-zero on any failure.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

DISTRIBUTIONS = ("graddebug", "graddebug-torch", "graddebug-tensorflow", "graddebug-jax",
                 "graddebug-keras")
BIN = Path(sys.executable).parent


def installed_from_site_packages() -> None:
    import graddebug

    versions = {name: importlib.metadata.version(name) for name in DISTRIBUTIONS}
    assert set(versions.values()) == {graddebug.__version__}, versions
    for module in ("graddebug", "graddebug_torch", "graddebug_tensorflow", "graddebug_jax",
                   "graddebug_keras"):
        origin = Path(__import__(module).__file__ or "")
        assert "site-packages" in origin.parts, f"{module} imported from {origin}"


def torch_vanishing(log_dir: Path) -> None:
    import torch
    from torch import nn

    import graddebug

    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(12):
        layers += [nn.Linear(32, 32), nn.Sigmoid()]
    model = nn.Sequential(*layers, nn.Linear(32, 4))
    x, y = torch.randn(64, 32), torch.randint(0, 4, (64,))
    with graddebug.watch(model, log_dir=log_dir) as dbg:
        for _ in range(5):
            model.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            dbg.step()
    assert "vanishing" in set(dbg.findings()["issue"]), dbg.findings()


def keras_cut_graph() -> None:
    import keras
    import numpy as np
    import tensorflow as tf

    import graddebug

    class Frozen(keras.layers.Layer):
        def call(self, x):  # type: ignore[no-untyped-def]
            return tf.stop_gradient(x)

    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16), Frozen(),
                              keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse")
    x, y = np.ones((32, 8), "float32"), np.zeros((32, 2), "float32")
    with graddebug.watch(model) as dbg:
        model.fit(x, y, epochs=1, batch_size=16, verbose=0, callbacks=[dbg.callback()])
    assert "cut_graph" in set(dbg.findings()["issue"]), dbg.findings()


def jax_nonfinite() -> None:
    import jax.numpy as jnp
    from flax import nnx

    import graddebug

    model = nnx.Sequential(nnx.Linear(4, 8, rngs=nnx.Rngs(0)), nnx.Linear(8, 1, rngs=nnx.Rngs(1)))
    with graddebug.watch(model) as dbg:
        x = jnp.ones((4, 4)).at[0, 0].set(jnp.nan)
        nnx.grad(lambda m: jnp.mean(m(x) ** 2))(model)
        dbg.step()
    assert "nonfinite" in set(dbg.findings()["issue"]), dbg.findings()


def cli_report(log_dir: Path, html: Path) -> None:
    result = subprocess.run([BIN / "graddebug", "report", str(log_dir), "--html", str(html)],
                            capture_output=True, text=True)
    # exit 0: vanishing is a warning, and the run has no error finding
    assert result.returncode == 0, result.stderr
    assert "vanishing" in result.stdout, result.stdout
    page = html.read_text(encoding="utf-8")
    # the two plots (gradient flow, heatmap) are embedded PNG images
    assert page.count('src="data:image/png;base64,') == 2, "the HTML report lacks its plots"


def pytest_plugin(folder: Path) -> None:
    test = folder / "test_smoke_plugin.py"
    test.write_text(
        "import torch\n"
        "def test_fixture(graddebug):\n"
        "    model = torch.nn.Linear(4, 2)\n"
        "    graddebug.check(model, (torch.ones(3, 4), torch.zeros(3, 2)),\n"
        "                    torch.nn.functional.mse_loss).assert_healthy()\n",
        encoding="utf-8")
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             str(test)], capture_output=True, text=True, cwd=folder)
    assert result.returncode == 0 and "1 passed" in result.stdout, result.stdout + result.stderr


def main() -> int:
    installed_from_site_packages()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        torch_vanishing(folder / "run")
        cli_report(folder / "run", folder / "report.html")
        keras_cut_graph()
        jax_nonfinite()
        pytest_plugin(folder)
    print("smoke test of the installed wheels: passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
