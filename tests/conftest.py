"""Shared fixtures. TensorFlow's environment is set before anything can import it."""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

import math
from collections.abc import Iterator

import pytest

from graddebug.records import Record


def make_record(step: int, layer: str, depth: int, norm: float, *, kind: str = "activation",
                tensor: str = "output", zero_frac: float = 0.0, nan: bool = False,
                inf: bool = False) -> Record:
    """A record with only the fields detectors read set meaningfully."""
    return Record(step, layer, tensor, kind, depth, "(8, 4)", 32, norm, 0.0, norm / math.sqrt(32),
                  norm, zero_frac, nan, inf)


@pytest.fixture
def record() -> type[Record]:
    """The Record type, for tests that build records by hand."""
    return Record


@pytest.fixture
def mixed_precision() -> Iterator[None]:
    """Keras' ``mixed_float16`` policy for one test, restored to float32 after it."""
    keras = pytest.importorskip("keras")
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        yield
    finally:
        keras.mixed_precision.set_global_policy("float32")
