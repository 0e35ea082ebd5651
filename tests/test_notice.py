"""The live notice of new findings in a plain torch loop: one line per step that brings one."""

from __future__ import annotations

import logging

import pytest

torch = pytest.importorskip("torch")

import graddebug  # noqa: E402


def _train(steps: int, nan_at: int) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with graddebug.watch(model) as dbg:
        for step in range(steps):
            x = torch.randn(32, 8)
            if step == nan_at:
                x[0, 0] = float("nan")
            model(x).square().mean().backward()
            dbg.step()
            opt.zero_grad()


def test_a_nan_mid_run_gives_one_line_naming_step_and_cause(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="graddebug"):
        _train(steps=12, nan_at=6)
    lines = [r.getMessage() for r in caplog.records
             if r.name == "graddebug" and r.getMessage().startswith("graddebug: step")]
    assert len(lines) == 1
    assert lines[0].startswith("graddebug: step 6: nonfinite")
    assert "(cause: data)" in lines[0]


def test_the_loggers_level_silences_it(caplog) -> None:
    logger = logging.getLogger("graddebug")
    old = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with caplog.at_level(logging.DEBUG):
            _train(steps=8, nan_at=4)
    finally:
        logger.setLevel(old)
    assert not [r for r in caplog.records if r.getMessage().startswith("graddebug: step")]
