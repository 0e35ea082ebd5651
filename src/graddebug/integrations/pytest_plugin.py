"""The pytest plugin: the ``graddebug`` fixture, the ``graddebug`` marker and two options.

pytest loads this module in every session of every project where graddebug is installed (the
``pytest11`` entry point), so it imports no framework and nothing heavy: the Watcher, pandas and
the adapters are imported when a test first uses the fixture.

- ``graddebug(model, **options)`` returns an entered :class:`graddebug.Watcher`; the fixture
  exits it when the test ends, also when the test failed.
- ``graddebug.check(model, batch, loss_fn, steps=1, **options)`` is :func:`graddebug.check`
  under the test's marker thresholds.
- ``@pytest.mark.graddebug(**thresholds)`` overrides thresholds for one test (or a class or a
  module, the closest marker winning per threshold).
- ``--graddebug-dir DIR`` saves each run of each test under ``DIR/<test id>`` (further runs of
  the same test as ``DIR/<test id>--2``, ``--3``, ...). Names are unique within a session: a
  name another test or run already holds gets a hash of the test id added.
- ``--graddebug-strict`` fails, at teardown, every passing test whose runs have any finding.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import pytest

from graddebug.errors import ConfigError, printable

if TYPE_CHECKING:
    from graddebug.capture.watcher import Watcher
    from graddebug.config import Thresholds
    from graddebug.report.report import Report

__all__ = ["GradDebugFixture", "graddebug"]

MARKER = "graddebug"

_ExcInfo = tuple[type[BaseException], BaseException, TracebackType | None]
_CALL_EXC = pytest.StashKey["_ExcInfo | None"]()
_CALL_PASSED = pytest.StashKey[bool]()
_NAMES = pytest.StashKey[dict[str, tuple[str, int]]]()  # directory name -> (nodeid, run)

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
_MAX_NAME = 120


def pytest_addoption(parser: pytest.Parser) -> None:
    """Add ``--graddebug-dir`` and ``--graddebug-strict``."""
    group = parser.getgroup("graddebug", "gradient checks with the graddebug fixture")
    group.addoption(
        "--graddebug-dir",
        metavar="DIR",
        default=None,
        help="save the report of each graddebug run of each test under DIR/<test id>.",
    )
    group.addoption(
        "--graddebug-strict",
        action="store_true",
        default=False,
        help="fail every passing test that used the graddebug fixture and has any finding.",
    )


def pytest_configure(config: pytest.Config) -> None:
    """Register the ``graddebug`` marker."""
    config.addinivalue_line(
        "markers",
        f"{MARKER}(**thresholds): threshold overrides (graddebug.Thresholds fields) for the "
        "graddebug fixture's watchers and checks in this test.",
    )
    config.stash[_NAMES] = {}


def pytest_report_header(config: pytest.Config) -> str | None:
    """Say where reports go and whether findings fail tests, when either option is on."""
    parts = []
    if config.getoption("graddebug_dir"):
        parts.append(f"reports in {_report_dir(config)}")
    if config.getoption("graddebug_strict"):
        parts.append("strict (any finding fails the test)")
    return f"graddebug: {', '.join(parts)}" if parts else None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Iterator[None]:
    """Remember how the test body ended, for the fixture's teardown."""
    report: Any = yield
    if call.when == "call":
        item.stash[_CALL_PASSED] = bool(report.passed) and not hasattr(report, "wasxfail")
        excinfo = call.excinfo
        item.stash[_CALL_EXC] = (
            (excinfo.type, excinfo.value, excinfo.tb) if excinfo is not None else None
        )
    return report  # type: ignore[no-any-return]


def _report_dir(config: pytest.Config) -> Path:
    return Path(config.invocation_params.dir, config.getoption("graddebug_dir"))


def marker_thresholds(node: pytest.Item) -> dict[str, float]:
    """Merge the ``graddebug`` markers of a test, the closest one winning per threshold.

    Args:
        node: The test item.

    Returns:
        The threshold overrides, checked against :class:`graddebug.Thresholds`.

    Raises:
        ConfigError: A marker has positional arguments, or an unknown or unusable threshold.
    """
    from graddebug.config import Thresholds

    merged: dict[str, float] = {}
    for mark in reversed(list(node.iter_markers(MARKER))):  # farthest first
        if mark.args:
            raise ConfigError(
                f"@pytest.mark.{MARKER}{mark.args!r} takes threshold keywords only, for example "
                f"@pytest.mark.{MARKER}(vanishing_ratio=1e-4)."
            )
        merged.update(mark.kwargs)
    Thresholds().replace(**merged)  # validate now: the test errors at setup, not mid-way
    return merged


def _dir_name(nodeid: str, taken: dict[str, tuple[str, int]], run: int = 1) -> str:
    """A file-system-safe directory name for run ``run`` of a test, unique within the session.

    Every name handed out is recorded in ``taken`` (case-folded, for file systems that ignore
    case) with the test and run it belongs to, the ``--N`` names of further runs included. A
    name already held by another test or run gets a hash of the test id instead, so that
    ``test_p[x--2]`` and the second run of ``test_p[x]`` never share a directory.

    Args:
        nodeid: The test's id.
        taken: Names handed out so far in this session, by case-folded name.
        run: Which run of the test, from 1; runs after the first get a ``--N`` suffix.
    """
    base = _UNSAFE.sub("_", nodeid.replace("::", "__")).strip("._") or "test"
    digest = hashlib.sha1(nodeid.encode()).hexdigest()[:10]
    if len(base) > _MAX_NAME:
        base = f"{base[:_MAX_NAME]}-{digest}"
    owner = (nodeid, run)
    suffix = "" if run == 1 else f"--{run}"
    name, attempt = f"{base}{suffix}", 0
    while taken.setdefault(name.casefold(), owner) != owner:
        attempt += 1
        name = f"{base}-{digest}{'' if attempt == 1 else f'-{attempt}'}{suffix}"
    return name


class GradDebugFixture:
    """What the ``graddebug`` fixture gives a test.

    Call it like :func:`graddebug.watch` to get an entered Watcher, or use :meth:`check` like
    :func:`graddebug.check`. Both apply the test's ``@pytest.mark.graddebug`` thresholds. The
    fixture exits its Watchers when the test ends, then saves and judges the runs as the
    command-line options ask.

    Args:
        nodeid: The test's id.
        thresholds: Threshold overrides from the test's markers.
    """

    def __init__(self, nodeid: str, thresholds: Mapping[str, float]) -> None:
        self.nodeid = nodeid
        self._marker = dict(thresholds)
        self._runs: list[_Run] = []

    @property
    def thresholds(self) -> Thresholds:
        """The defaults, overridden by the test's markers."""
        from graddebug.config import Thresholds

        return Thresholds().replace(**self._marker)

    def _options(self, options: dict[str, Any]) -> dict[str, Any]:
        if not self._marker:
            return options
        given = options.get("thresholds")
        if given is None:
            options["thresholds"] = dict(self._marker)
        elif isinstance(given, Mapping):
            options["thresholds"] = {**self._marker, **given}
        # A Thresholds object given explicitly is used as it is.
        return options

    def __call__(self, model: Any = None, **options: Any) -> Watcher:
        """Watch ``model`` until the test ends.

        Args:
            model: What :func:`graddebug.watch` accepts.
            **options: Options of :func:`graddebug.watch`; ``thresholds=`` given as a dict is
                applied over the marker's.

        Returns:
            The Watcher, already entered: do not use it in a ``with`` statement.
        """
        from graddebug.capture.watcher import Watcher

        watcher = Watcher(model, **self._options(options))
        watcher.__enter__()
        self._runs.append(_Run(f"watch({type(model).__name__})", watcher=watcher))
        return watcher

    def check(
        self, model: Any, batch: Any, loss_fn: Callable[..., Any], steps: int = 1,
        **options: Any,
    ) -> Report:
        """Run :func:`graddebug.check` under the test's thresholds, and keep its Report.

        Args:
            model: The model.
            batch: The input, or an ``(inputs, targets)`` pair.
            loss_fn: ``loss_fn(output)`` or ``loss_fn(output, targets)``.
            steps: Steps to run.
            **options: ``targets=``, ``optimizer=`` and options of :func:`graddebug.watch`.

        Returns:
            The Report of the run.
        """
        from graddebug.integrations.check import check

        report = check(model, batch, loss_fn, steps, **self._options(options))
        self._runs.append(_Run(f"check({type(model).__name__})", report=report))
        return report

    def reports(self) -> list[Report]:
        """Return the Reports of this test's runs so far, in the order they started."""
        return [run.get_report() for run in self._runs]

    def _finish(self, item: pytest.Item) -> None:
        """Exit Watchers, save and judge the runs; called by the fixture's teardown."""
        __tracebackhide__ = True
        exc_type, exc, tb = item.stash.get(_CALL_EXC, None) or (None, None, None)
        errors: list[BaseException] = []
        for run in reversed(self._runs):
            if run.watcher is not None and run.watcher.active:
                try:
                    run.watcher.__exit__(exc_type, exc, tb)
                except Exception as error:  # every Watcher is exited before one is raised
                    errors.append(error)
        passed = item.stash.get(_CALL_PASSED, False)
        save = bool(item.config.getoption("graddebug_dir"))
        judge = passed and item.config.getoption("graddebug_strict")
        reports = [(run.label, run.get_report()) for run in self._runs] if save or judge else []
        if save:
            self._save(item.config, reports, "passed" if passed else "failed")
        if errors:
            raise errors[0]
        if judge:
            self._judge(reports)

    def _save(self, config: pytest.Config, reports: list[tuple[str, Report]],
              outcome: str) -> None:
        base = _report_dir(config)
        for index, (label, report) in enumerate(reports, start=1):
            report.metadata.setdefault(
                "pytest", {"nodeid": self.nodeid, "run": index, "label": label,
                           "outcome": outcome}
            )
            report.save(base / _dir_name(self.nodeid, config.stash[_NAMES], index))

    def _judge(self, reports: list[tuple[str, Report]]) -> None:
        __tracebackhide__ = True
        from graddebug.report.verdict import findings_table

        parts = []
        for label, report in reports:
            findings = report.findings()
            if not findings.empty:
                parts.append(f"{label}: {len(findings)} finding(s)\n{findings_table(findings)}")
        if parts:
            pytest.fail(
                "graddebug --graddebug-strict: the gradients of this test have findings.\n"
                + printable("\n\n".join(parts)),  # model class names are user strings too
                pytrace=False,
            )


@dataclass
class _Run:
    """One Watcher or one check of a test."""

    label: str
    watcher: Watcher | None = None
    report: Report | None = None

    def get_report(self) -> Report:
        if self.report is not None:
            return self.report
        assert self.watcher is not None  # a _Run holds one or the other
        return self.watcher.report()


@pytest.fixture
def graddebug(request: pytest.FixtureRequest) -> Iterator[GradDebugFixture]:
    """Watch models and run gradient checks in a test; see :class:`GradDebugFixture`.

    Example:
        >>> def test_model_is_healthy(graddebug):          # doctest: +SKIP
        ...     report = graddebug.check(model, (x, y), F.cross_entropy, steps=3)
        ...     report.assert_healthy(ignore=("dead",))
    """
    __tracebackhide__ = True
    item = request.node
    fixture = GradDebugFixture(item.nodeid, marker_thresholds(item))
    yield fixture
    fixture._finish(item)
