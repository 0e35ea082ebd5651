"""The scripts of ``benchmarks/`` loaded as modules, for the tests of their methods."""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@contextlib.contextmanager
def loaded(name: str) -> Iterator[ModuleType]:
    """``benchmarks/<name>.py`` as a fresh module, registered while the block runs (dataclasses
    look their module up while they are built)."""
    spec = importlib.util.spec_from_file_location(f"{name}_under_test", BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


def imported(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` imported under its own name, as the benchmark scripts import
    the modules they share, so that a test patches the very module that the scripts use.

    Args:
        name: The module's name, without ``.py``.

    Returns:
        The module, imported once: later calls return the same one.
    """
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    return importlib.import_module(name)
