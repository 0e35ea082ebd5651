"""The TF adapter's state buffers (``graddebug_tensorflow.captures``): read and zeroed in one
call, eagerly, also after a buffer is added or recreated. Reference: the values written, read
back with numpy."""

from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from graddebug_tensorflow.captures import CHUNK, StateBuffers  # noqa: E402
from graddebug_tensorflow.stats import ACT_WIDTH, PARAM_WIDTH  # noqa: E402


def test_read_and_clear_follow_buffers_added_and_recreated() -> None:
    buffers = StateBuffers()
    chunk, row, _ = buffers.new_row()
    chunk[row, 3].assign(2.5)
    rows = buffers.read_and_clear()
    assert rows.acts.shape == (1, 1, ACT_WIDTH) and rows.acts[0, 0, 3] == 2.5
    assert not buffers.peek().acts.any()  # zeroed

    params = buffers.ensure_params(2)  # a buffer added after the first read
    params[1].assign([1.0, 4.0, 2.0, 3.0, 0.25])
    for _ in range(CHUNK):  # and a second chunk of activation rows
        last, row, _ = buffers.new_row()
    last[row, 4].assign(-1.0)
    rows = buffers.read_and_clear()
    assert rows.params.shape == (3, PARAM_WIDTH)
    np.testing.assert_array_equal(rows.params[1], [1.0, 4.0, 2.0, 3.0, 0.25])
    assert rows.acts.shape == (1, CHUNK + 1, ACT_WIDTH) and rows.acts[0, CHUNK, 4] == -1.0
    assert not buffers.peek().params.any() and not buffers.peek().acts.any()

    buffers.ensure_params(5)[4].assign([1.0, 9.0, 0.0, 0.0, 0.0])  # recreated for another count
    rows = buffers.peek()
    assert rows.params.shape == (6, PARAM_WIDTH) and rows.params[4, 1] == 9.0
    buffers.clear()
    assert not buffers.peek().params.any()
