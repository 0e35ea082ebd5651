"""Cut graphs: where gradient stops flowing (detach, stop_gradient, a numpy round trip).

The findings name layers. Where op-level capture ran (``ops=True``, or ``escalate=True`` on a
later step), each also names the operation that cut the graph and its source line, from the
``op_cut`` events: the one that ran in or around the layers the finding names, else the first
of the step.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import pandas as pd

from graddebug.config import Thresholds
from graddebug.detectors import Evidence, finding
from graddebug.hookspecs import hookimpl
from graddebug.records import Cause, EventKind, Finding, Issue, Kind, Severity

# The layer names a finding's message quotes ('fc1'), to choose among several op-level cuts.
_NAMED = re.compile(r"'([^']+)'")

_CAUSES = "a .detach(), tf.stop_gradient, a numpy round trip (.numpy()/np.asarray), or no_grad"


@hookimpl
def graddebug_findings(evidence: Evidence, thresholds: Thresholds) -> list[Finding]:
    """Name detached outputs, the boundary below which no gradient arrives, and starved
    parameters."""
    events = evidence.events
    if events.empty:
        return []
    findings = _detached(events)
    findings += _boundaries(evidence)
    findings += _starved(events)
    cuts = events[events["event"] == EventKind.OP_CUT.value]
    if cuts.empty:
        return findings
    return [_pinned(f, cuts) for f in findings]


def _related(module: str, layers: Iterable[str]) -> bool:
    """Whether ``module`` is one of ``layers``, inside one, or around one."""
    return any(module == n or module.startswith(f"{n}.") or n.startswith(f"{module}.")
               for n in layers)


def _pinned(found: Finding, cuts: pd.DataFrame) -> Finding:
    """``found`` with the op-level cut that explains it: from its own step, else (escalation)
    from the first later step whose op-level capture saw one."""
    later = cuts[cuts["step"] >= found.step]
    if later.empty:
        return found
    rows = later[later["step"] == later["step"].min()].sort_values("depth", kind="stable")
    layers = [*_NAMED.findall(found.message), found.layer]
    near = rows[[_related(str(m), layers) for m in rows["layer"]]]
    cut = (near if not near.empty else rows).iloc[0]
    op = str(cut["tensor"]).partition("@")[0]
    where = str(cut["source"]) or "source line unknown"
    return found._replace(
        message=f"{found.message} Op-level capture places the cut at {op} in "
                f"{cut['layer']!r} ({where}): {cut['detail']}.",
        source=str(cut["source"]))


def _first_per_layer(rows: pd.DataFrame) -> pd.DataFrame:
    return rows.sort_values(["step", "depth"], kind="stable").drop_duplicates("layer")


def _detached(events: pd.DataFrame) -> list[Finding]:
    rows = _first_per_layer(events[events["event"] == EventKind.DETACHED_OUTPUT.value])
    return [
        finding(
            Issue.CUT_GRAPH, Severity.ERROR, row.step, row.layer,
            (
                f"gradient stops at {row.layer!r}: {_why(row.detail)}, so nothing upstream of "
                f"it learns. Look for {_CAUSES} there."
            ),
            tensor=row.tensor, cause=Cause.GRAPH
        )
        for row in rows.itertuples()
    ]


def _why(detail: object) -> str:
    return str(detail) if detail else "its output needs no gradient"


def _boundaries(evidence: Evidence) -> list[Finding]:
    events = evidence.events
    unreached = events[events["event"] == EventKind.UNREACHED.value]
    detached = events[events["event"] == EventKind.DETACHED_OUTPUT.value]
    if unreached.empty:
        return []
    records = evidence.records
    reached = records[(records["kind"] == Kind.ACTIVATION.value) & (records["depth"] >= 0)]
    found: dict[str, Finding] = {}
    for step, lost in unreached.groupby("step", sort=True):
        got = reached[reached["step"] == step]
        if got.empty:
            continue
        first = got.sort_values("depth", kind="stable").iloc[0]
        upstream = lost[(lost["depth"] >= 0) & (lost["depth"] < first["depth"])]
        if upstream.empty:
            continue  # unused branches downstream of the first reached layer are not cuts
        last_lost = upstream.sort_values("depth", kind="stable").iloc[-1]
        cut_here = detached[
            (detached["step"] == step)
            & detached["depth"].between(last_lost["depth"], first["depth"])
        ]
        if not cut_here.empty or first["layer"] in found:
            continue  # a detached output between them explains this cut better
        found[first["layer"]] = finding(
            Issue.CUT_GRAPH, Severity.ERROR, step, first["layer"],
            (
                f"gradient stops between {last_lost['layer']!r} and {first['layer']!r}: "
                f"{first['layer']}'s input is detached, so {len(upstream)} layer(s) upstream "
                f"get no gradient. Look for {_CAUSES} between them."
            ), cause=Cause.GRAPH
        )
    return list(found.values())


def _starved(events: pd.DataFrame) -> list[Finding]:
    rows = events[events["event"] == EventKind.NO_GRAD.value]
    if rows.empty:
        return []
    # One pass over every layer (not one filter per layer: 10,000 starved layers took 1 s).
    per_layer = rows.groupby("layer", sort=False, observed=True).agg(
        names=("tensor", lambda t: list(dict.fromkeys(t))), first=("step", "min"),
        steps=("step", "nunique"),
    )
    out = []
    for layer, names, first, steps in zip(per_layer.index, per_layer["names"],
                                          per_layer["first"], per_layer["steps"], strict=True):
        if len(names) == 1:
            label = repr(layer) if names == [layer] else f"{names[0]} of {layer!r}"
            what, verb, pronoun, them = f"parameter {label}", "requires", "it sits", "it"
        else:
            what = f"parameters {', '.join(names)} of {layer!r}"
            verb, pronoun, them = "require", "they sit", "them"
        out.append(
            finding(
                Issue.CUT_GRAPH, Severity.WARNING, first, layer,
                (
                    f"{what} {verb} a gradient but got none in {steps} "
                    f"step(s): {pronoun} upstream of a cut or the loss does not use {them}. "
                    f"If unused on purpose, freeze {them} "
                    "(requires_grad_(False) / trainable=False)."
                ),
                tensor=names[0], cause=Cause.GRAPH
            )
        )
    return out
