"""The plugin system, and the promise that the core imports no framework."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

import graddebug
from graddebug import Finding, NoAdapterError
from graddebug.plugins import DEFAULT_PLUGINS, new_plugin_manager

ROOT = Path(__file__).resolve().parents[1]


def test_builtin_detectors_are_registered_first() -> None:
    pm = new_plugin_manager(entry_points=False)
    names = [name for name, _ in pm.list_name_plugin()]
    assert names == [n.rsplit(".", 1)[-1] for n in DEFAULT_PLUGINS]


def test_installed_adapters_come_from_entry_points() -> None:
    pm = new_plugin_manager()
    adapters = {impl.plugin_name for impl in pm.hook.graddebug_adapter.get_hookimpls()}
    assert "torch" in adapters


def test_a_plugin_that_fails_to_import_is_left_out_with_a_warning(monkeypatch) -> None:
    import importlib.metadata

    from graddebug.errors import GradDebugWarning

    real = list(importlib.metadata.entry_points(group="graddebug"))
    broken = importlib.metadata.EntryPoint("broken", "graddebug_no_such_module.plugin",
                                           "graddebug")
    monkeypatch.setattr(importlib.metadata, "entry_points",
                        lambda group: [broken, *real] if group == "graddebug" else [])
    with pytest.warns(GradDebugWarning, match="'broken'.*failed to load.*ModuleNotFoundError"):
        pm = new_plugin_manager()
    names = {name for name, _ in pm.list_name_plugin()}
    assert "broken" not in names
    assert "torch" in names  # the installed adapters still load


class EverythingIsSlow:
    """A third-party detector: one finding per recorded step."""

    @graddebug.hookimpl
    def graddebug_findings(self, evidence, thresholds):
        steps = sorted(set(evidence.records["step"]))
        return [Finding(s, "model", "", "slow", "info", math.nan, math.nan, "too slow")
                for s in steps]


class FakeTensor:
    """Stands in for a tensor of a framework graddebug has never heard of."""


class FakeAdapter:
    name = "fake"

    def __init__(self, context, model, params, options) -> None:
        self.context = context
        self.taps: list[str] = []
        self.closed: list[int] = []

    def attach(self) -> None:
        pass

    def detach(self) -> None:
        pass

    def tap(self, tensor, name, intervention):
        self.taps.append(name)
        return tensor

    def has_pending(self) -> bool:
        return len(self.taps) > len(self.closed)  # a tap since the last close

    def close_step(self, step, grads, record):
        from graddebug.adapter import StepResult
        from graddebug.records import Record

        self.closed.append(step)
        return StepResult(records=[Record(step, "t", "output", "activation", 0, "(1,)", 1,
                                          1.0, 1.0, 0.0, 1.0, math.nan, False, False)])

    def matched_names(self) -> set[str]:
        return set()

    def known_names(self) -> list[str]:
        return []


class FakeFramework:
    @graddebug.hookimpl
    def graddebug_adapter(self, target):
        return FakeAdapter if isinstance(target, FakeTensor) else None


def test_plugins_registered_at_run_time_take_part() -> None:
    pm = new_plugin_manager(entry_points=False)
    pm.register(EverythingIsSlow())
    pm.register(FakeFramework())
    with graddebug.watch(plugin_manager=pm) as dbg:
        t = FakeTensor()
        for _ in range(2):
            assert dbg.tap(t, "t") is t
            dbg.step()
    assert list(dbg.frame()["step"]) == [0, 1]
    found = dbg.findings()
    assert list(found["issue"]) == ["slow", "slow"]
    assert dbg.summary()["issues"].tolist() == [""]  # the finding names layer "model"


def test_default_manager_is_shared_and_extensible() -> None:
    pm = graddebug.get_plugin_manager()
    assert pm is graddebug.get_plugin_manager()
    plugin = FakeFramework()
    pm.register(plugin)
    try:
        with graddebug.watch(FakeTensor()) as dbg:
            dbg.step()
        assert len(dbg.frame()) == 1
    finally:
        pm.unregister(plugin)


def test_unknown_object_with_no_adapter_at_all() -> None:
    pm = new_plugin_manager(entry_points=False)
    with pytest.raises(NoAdapterError) as info, graddebug.watch(FakeTensor(), plugin_manager=pm):
        pass
    text = str(info.value)
    assert "FakeTensor" in text
    assert "Installed adapters: none" in text
    assert "pip install graddebug[torch]" in text


def test_watch_without_target_steps_without_adapter() -> None:
    with graddebug.watch() as dbg:
        dbg.step()
    assert dbg.frame().empty
    assert dbg.findings().empty
    assert dbg.summary().empty
    assert "adapter=none" in repr(dbg)


CORE_TESTS = ["tests/test_config.py", "tests/test_detectors.py", "tests/test_frames.py",
              "tests/test_plugins.py", "tests/test_ranks.py", "tests/test_stopping.py",
              "tests/test_tiers.py", "tests/test_verdict.py"]

BLOCK = """
import sys
for name in ("torch", "tensorflow", "keras", "jax"):
    sys.modules[name] = None  # makes `import torch` raise ImportError
import graddebug, graddebug.cli, graddebug.plugins
graddebug.plugins.get_plugin_manager()  # loads every installed adapter's entry point
leaked = [m for m in ("torch", "tensorflow", "keras") if sys.modules.get(m) is not None]
assert not leaked, leaked
import pytest
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "-k", "not framework_free", *sys.argv[1:]]))
"""


def test_core_is_framework_free() -> None:
    """The core imports and its tests pass with torch and TensorFlow unimportable."""
    result = subprocess.run([sys.executable, "-c", BLOCK, *CORE_TESTS], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert " passed" in result.stdout


def test_the_plugin_page_generates_its_tables_from_the_code() -> None:
    """The capability table, the record's fields and the event kinds of ``docs/plugins.md``
    come from the adapters' declarations and ``graddebug.records`` (``docs/_ext/adapterdocs``),
    so the page lists none of them by hand."""
    from graddebug.records import EventKind, Record

    page = (ROOT / "docs" / "plugins.md").read_text(encoding="utf-8")
    for directive in ("adapter-capabilities", "record-fields", "event-kinds"):
        assert f"```{{{directive}}}" in page, directive
    assert "```{adapter-options}" in (ROOT / "docs" / "options.md").read_text(encoding="utf-8")
    assert "| `StepClock` |" not in page
    assert ", ".join(Record._fields[:6]) not in page
    listed = [kind.value for kind in EventKind if f"`{kind.value}`" in page]
    assert listed == []


def test_the_generated_tables_cover_every_adapter_distribution() -> None:
    sys.path.insert(0, str(ROOT / "docs" / "_ext"))
    try:
        import adapterdocs
    finally:
        sys.path.remove(str(ROOT / "docs" / "_ext"))
    packages = {where.split(".", 1)[0] for _, where in adapterdocs.ADAPTERS}
    assert packages == {"graddebug_torch", "graddebug_tensorflow", "graddebug_jax",
                        "graddebug_keras", "examples/adapter/toygrad"}
    toy = adapterdocs._load("examples/adapter/toygrad.py:ToyAdapter")
    assert toy.__name__ == "ToyAdapter" and toy.capabilities
    assert adapterdocs.first_sentence("Index of the ``step``, e.g. 3. More.") == (
        "Index of the `step`, e.g. 3.")
