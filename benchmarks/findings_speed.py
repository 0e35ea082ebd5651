"""How long ``frame()`` and ``findings()`` take on a large run: 10,000 layers x 10 steps.

Builds 100,000 activation records by hand (no framework), in the shapes that stress each
detector, and times the record frame and the diagnosis separately:

- ``healthy``: flat norms, nothing to report;
- ``exploding``: norms growing steadily towards the input, up to 5e8;
- ``dead``: every layer dead (10,000 findings);
- ``nan``: NaN from step 5 in half the layers;
- ``growth``: every norm tripling each step;
- ``cut``: the first 5,000 layers unreached, each with a starved weight (100,000 events).

The target is frames plus findings under 1 s for 100k rows. Measured on the 2-core
development machine, before and after the detectors were vectorised (seconds, findings only):
healthy 2.07 -> 0.20, exploding 13.97 -> 0.16, dead 7.44 -> 0.41, nan 2.05 -> 0.19,
growth 16.25 -> 0.29, cut 1.20 -> 0.24. The record frame takes 0.3-0.5 s.
Run by hand: ``python benchmarks/findings_speed.py [--layers 10000] [--steps 10]``.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

from graddebug import Thresholds
from graddebug.diagnosis import diagnose
from graddebug.frames import event_frame, record_frame
from graddebug.records import Event, EventKind, Record

CASES = ("healthy", "exploding", "dead", "nan", "growth", "cut")


def records(case: str, layers: int, steps: int) -> list[Record]:
    """Activation records of one case."""
    out = []
    for step in range(steps):
        for depth in range(layers):
            if case == "cut" and depth < layers // 2:
                continue
            norm = 1.0 + 0.01 * ((step * 7 + depth) % 5)
            zero, nan = 0.1, False
            if case == "exploding":
                norm *= 1.002 ** (layers - depth)
            elif case == "dead":
                zero = 0.9
            elif case == "nan" and step >= steps // 2 and depth < layers // 2:
                norm, nan = math.nan, True
            elif case == "growth":
                norm *= 3.0**step
            out.append(Record(step, f"layer{depth}", "output", "activation", depth, "(8, 4)", 32,
                              norm, 0.0, norm / math.sqrt(32), norm, zero, nan, False,
                              math.nan))
    return out


def events(case: str, layers: int, steps: int) -> list[Event]:
    """Unreached outputs and starved weights upstream of a cut, for the ``cut`` case."""
    if case != "cut":
        return []
    return [Event(step, f"layer{depth}", tensor, depth, kind.value, "")
            for step in range(steps) for depth in range(layers // 2)
            for tensor, kind in (("output", EventKind.UNREACHED), ("weight", EventKind.NO_GRAD))]


def main(argv: list[str] | None = None) -> int:
    """Time each case and print one line per case."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=10_000)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args(argv)
    for case in CASES:
        rows = records(case, args.layers, args.steps)
        evs = events(case, args.layers, args.steps)
        start = time.perf_counter()
        frame, event_rows = record_frame(rows), event_frame(evs)
        built = time.perf_counter()
        found = diagnose(frame, event_rows, Thresholds())
        done = time.perf_counter()
        print(f"{case:10s} {len(frame):7d} rows  frame {built - start:5.2f} s  findings "
              f"{done - built:5.2f} s  ({len(found)} findings: "
              f"{', '.join(sorted(set(found['issue']))) or 'none'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
