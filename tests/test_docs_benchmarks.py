"""The Performance page's tables come from the benchmark scripts' JSON: ``docs/_ext/benchtables``
renders a given file's values, warns (never crashes) on a missing or malformed one, and renders
every file committed under ``docs/_data/benchmarks`` without a warning.

The expected cells are computed here from the values the test writes, not taken from the
extension's own formatting helpers. No framework is imported.
"""

from __future__ import annotations

import io
import json
import math
import re
import statistics
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
DATA = DOCS / "_data" / "benchmarks"
sys.path.insert(0, str(DOCS / "_ext"))

from benchtables import BenchmarkDataError, build_table, inline_ratio  # noqa: E402

STAMP = "2026-12-04T18:24:26+00:00"


def write(tmp_path: Path, name: str, payload: Any) -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(payload), encoding="utf-8")
    return path


def zoo_payload() -> dict[str, Any]:
    plain, watched = 2.93, 4.71
    return {
        "benchmark": "zoo",
        "meta": {"date": STAMP, "machine": "Linux-6.1-x86_64", "cpus": 2, "rounds": 3,
                 "steps": 5, "torch_threads": 1,
                 "versions": {"torch": "2.13.0+cpu", "transformers": "5.23.0"}},
        "rows": [
            {"model": "gpt2", "framework": "torch", "family": "decoder-only",
             "findings_at_init": 0, "issues": {}, "plain_ms": plain, "watched_ms": watched,
             "overhead": round(watched / plain, 3)},
            {"model": "broken", "framework": "torch", "family": "CNN", "findings_at_init": 4,
             "issues": {"cut_graph": ["a", "b", "c"], "dead": ["d"]}, "plain_ms": 150.4,
             "watched_ms": 301.2, "overhead": round(301.2 / 150.4, 3)},
        ],
    }


def torch_result(workload: str, config: str, target: float, pairs: list[tuple[float, float]],
                 interval: tuple[float, float], verdict: str) -> dict[str, Any]:
    """A result of overhead_torch.json whose ratio is the median of the given pairs' ratios."""
    plain = [p for p, _ in pairs]
    watched = [w for _, w in pairs]
    return {"workload": workload, "config": config, "label": f"({config}) the script's label",
            "target": target, "plain_ms": statistics.median(plain),
            "watched_ms": statistics.median(watched),
            "ratio": statistics.median(w / p for p, w in pairs), "ratio_low": interval[0],
            "ratio_high": interval[1], "verdict": verdict, "graph_breaks_plain": -1,
            "graph_breaks_watched": -1}


PAIRS = [(35.0, 40.0), (36.0, 41.0), (35.5, 39.0)]


def torch_payload(compile: bool = False) -> dict[str, Any]:
    return {
        "benchmark": "overhead_torch",
        "settings": {"rounds": 6, "steps_per_round": 10, "warmup_rounds": 1,
                     "compile": compile, "allocator": "steady"},
        "environment": {"timestamp": STAMP, "platform": "Linux-6.1-x86_64", "cpus": 2,
                        "torch": "2.13.0+cpu", "torch_threads": 2, "graddebug": "0.4.0",
                        "git_commit": "0123456789abcdef", "library_modified": False},
        "results": [
            torch_result("mlp", "a", 1.05, PAIRS, (1.10, 1.16), "FAIL"),
            torch_result("mlp", "f", math.inf, [(35.0, 35.7), (35.0, 36.4)], (0.99, 1.05), ""),
            torch_result("cnn", "b", 1.15, [(59.0, 64.0), (60.0, 66.0)], (1.06, 1.14), "pass"),
        ],
    }


# -- rows hold the file's values -------------------------------------------------------------


def test_the_zoo_table_gives_each_model_its_findings_and_its_step_times(tmp_path: Path) -> None:
    payload = zoo_payload()
    table = build_table([write(tmp_path, "zoo.json", payload)])
    assert table.header[0] == "model"
    first, second = table.rows
    gpt2 = payload["rows"][0]
    ratio = gpt2["watched_ms"] / gpt2["plain_ms"]
    assert first == ["gpt2", "torch", "decoder-only", "0",
                     f"{gpt2['plain_ms']:.1f} → {gpt2['watched_ms']:.1f} ms ({ratio:.2f}×)"]
    # Past 100 ms a step time is whole milliseconds; two layers shown, the rest counted.
    assert second[3] == "4: cut_graph at a, b and 1 more; dead at d"
    assert second[4] == f"150 → 301 ms ({301.2 / 150.4:.2f}×)"


def test_the_caption_gives_the_date_machine_and_versions_of_the_file(tmp_path: Path) -> None:
    table = build_table([write(tmp_path, "zoo.json", zoo_payload())])
    for part in ("zoo.json", "2026-12-04 18:24 UTC", "Linux-6.1-x86_64", "2 CPUs",
                 "torch 2.13.0+cpu", "transformers 5.23.0", "1 thread", "3 alternating rounds"):
        assert part in table.caption


def test_two_zoo_files_make_one_table_with_both_captions(tmp_path: Path) -> None:
    keras = zoo_payload()
    keras["meta"]["versions"] = {"tensorflow": "2.21.0", "keras": "3.15.1"}
    keras["rows"] = [dict(keras["rows"][0], model="ResNet50 (model.fit)",
                          framework="tensorflow")]
    table = build_table([write(tmp_path, "zoo_torch.json", zoo_payload()),
                         write(tmp_path, "zoo_tf.json", keras)])
    assert [row[0] for row in table.rows] == ["gpt2", "broken", "ResNet50 (model.fit)"]
    assert "zoo_torch.json" in table.caption and "keras 3.15.1" in table.caption


def test_the_torch_overhead_table_gives_ratio_interval_verdict_and_step_times(
        tmp_path: Path) -> None:
    table = build_table([write(tmp_path, "overhead_torch.json", torch_payload())])
    assert table.header == ["workload", "config", "target", "ratio [95% interval]", "result",
                            "plain ms/step", "watched ms/step"]
    mlp_a, mlp_f, cnn_b = table.rows
    ratio = statistics.median(w / p for p, w in PAIRS)
    assert mlp_a == ["mlp", "(a) params", "≤ 1.05", f"{ratio:.3f} [1.100-1.160]", "FAIL",
                     f"{statistics.median(p for p, _ in PAIRS):.1f}",
                     f"{statistics.median(w for _, w in PAIRS):.1f}"]
    # A config without a target (a floor, the null) is not judged.
    assert mlp_f[2] == mlp_f[4] == "–"
    assert mlp_f[3].startswith(f"{statistics.median([35.7 / 35.0, 36.4 / 35.0]):.3f} [")
    assert cnn_b[:5] == ["cnn", "(b) params + outputs", "≤ 1.15",
                         f"{statistics.median([64 / 59, 66 / 60]):.3f} [1.060-1.140]", "pass"]
    for part in ("2026-12-04 18:24 UTC", "torch 2.13.0+cpu on 2 threads", "graddebug 0.4.0",
                 "commit 0123456789", "6 rounds of 10 pairs", "steady allocator"):
        assert part in table.caption


def test_a_compiled_run_adds_its_graph_breaks(tmp_path: Path) -> None:
    payload = torch_payload(compile=True)
    payload["results"][0].update(graph_breaks_plain=0, graph_breaks_watched=2)
    table = build_table([write(tmp_path, "overhead_torch_compile.json", payload)])
    assert table.header[-1] == "graph breaks plain / watched"
    assert table.rows[0][-1] == "0 / 2"
    assert "under torch.compile" in table.caption


def test_options_keep_the_workloads_and_configs_they_name(tmp_path: Path) -> None:
    path = write(tmp_path, "overhead_torch.json", torch_payload())
    assert [row[:2] for row in build_table([path], filters={"workload": ["mlp"]}).rows] == [
        ["mlp", "(a) params"], ["mlp", "(f) floor of (a)"]]
    assert len(build_table([path], filters={"config": ["b"]}).rows) == 1
    with pytest.raises(BenchmarkDataError, match="no result matches"):
        build_table([path], filters={"workload": ["transformer"]})


def test_the_tensorflow_and_jax_tables_hold_their_files_values(tmp_path: Path) -> None:
    tf_res = {"workload": "mlp", "loop": "fit", "config": "b", "target": 1.25,
              "plain_ms": 45.04, "watched_ms": 48.81, "ratio": 48.81 / 45.04,
              "ratio_low": 1.02, "ratio_high": 1.11, "verdict": "pass"}
    tf = {"benchmark": "overhead_tf", "results": [tf_res],
          "environment": {"when": STAMP, "machine": "x86_64", "cpus": 2,
                          "tensorflow": "2.21.0", "keras": "3.15.1"},
          "settings": {"rounds": 5, "steps_per_round": 8, "fit_steps": 20}}
    row = build_table([write(tmp_path, "overhead_tf.json", tf)]).rows[0]
    assert row == ["mlp", "fit", "(b) params + outputs", "≤ 1.25",
                   f"{48.81 / 45.04:.3f} [1.020-1.110]", "pass", "45.0", "48.8"]

    jax_res = {"workload": "transformer", "config": "full", "ratio": 1.2, "ratio_low": 1.1,
               "ratio_high": 1.3, "plain_ms": 3.04, "target": 1.3, "result": "within noise",
               "watched_ms": 3.66}
    jax = {"benchmark": "overhead_jax", "when": STAMP, "machine": "Linux", "jax": "0.10.2",
           "rounds": 5, "pairs": 20, "results": [jax_res]}
    table = build_table([write(tmp_path, "overhead_jax.json", jax)])
    assert table.rows[0] == ["transformer", "full", "≤ 1.30", "1.200 [1.100-1.300]",
                             "within noise", "3.0", "3.7"]
    assert "JAX 0.10.2" in table.caption and "5 rounds of 20 pairs" in table.caption


def test_the_many_layers_table_sums_frame_and_findings(tmp_path: Path) -> None:
    result = {"layers": 10000, "attach_s": 0.61, "plain_ms": 450.0, "watched_ms": 830.0,
              "ratio": 1.84, "skipped_ms": 470.0, "skipped_ratio": 1.04, "rows": 120000,
              "frame_s": 0.13, "findings_s": 0.1, "findings": 0}
    payload = {"benchmark": "many_layers_torch", "when": STAMP, "torch": "2.13.0+cpu",
               "threads": 2, "targets": {"step_ratio": 2.0, "frame_plus_findings_s": 1.0},
               "result": result}
    rows = build_table([write(tmp_path, "many_layers_torch.json", payload)]).rows
    assert rows[0][1] == "1.84× (450 → 830 ms)" and rows[0][2] == "≤ 2×"
    assert rows[3][0] == "frame() + findings() of 120,000 rows"
    assert rows[3][1].startswith(f"{0.13 + 0.1:.2f} s")


def test_an_inline_ratio_is_the_named_results_ratio_and_interval(tmp_path: Path) -> None:
    path = write(tmp_path, "overhead_torch.json", torch_payload())
    ratio = statistics.median(w / p for p, w in PAIRS)
    assert inline_ratio(path, ["mlp", "a"]) == f"{ratio:.3f} [1.100-1.160]"
    with pytest.raises(BenchmarkDataError, match="0 results match"):
        inline_ratio(path, ["mlp", "z"])


# -- missing and malformed files -------------------------------------------------------------


@pytest.mark.parametrize(("content", "message"), [
    (None, "cannot be read"),
    ("{not json", "not valid JSON"),
    ("[1, 2]", "JSON object, not list"),
    ('{"benchmark": "unknown"}', "benchmark 'unknown'"),
    ('{"rows": []}', "no 'benchmark' field"),
    ('{"benchmark": "zoo", "rows": []}', "lacks the field 'meta'"),
])
def test_a_missing_or_malformed_file_is_an_error_naming_it(
        tmp_path: Path, content: str | None, message: str) -> None:
    path = tmp_path / "broken.json"
    if content is not None:
        path.write_text(content, encoding="utf-8")
    with pytest.raises(BenchmarkDataError, match=re.escape(message)) as caught:
        build_table([path])
    assert str(caught.value).startswith("broken.json")


def test_a_result_lacking_a_field_names_the_field(tmp_path: Path) -> None:
    payload = torch_payload()
    del payload["results"][1]["ratio_high"]
    with pytest.raises(BenchmarkDataError, match="lacks the field 'ratio_high'"):
        build_table([write(tmp_path, "overhead_torch.json", payload)])


def build_docs(tmp_path: Path, body: str) -> tuple[str, Any]:
    """Build a one-page reST project that loads only the extension; its warnings and doctree."""
    from sphinx.application import Sphinx
    from sphinx.util.docutils import docutils_namespace

    src = tmp_path / "src"
    src.mkdir()
    (src / "conf.py").write_text('extensions = ["benchtables"]\nbenchtables_data = "data"\n',
                                 encoding="utf-8")
    (src / "index.rst").write_text(f"Page\n====\n\n{body}\n", encoding="utf-8")
    (src / "data").mkdir()
    write(src / "data", "overhead_torch.json", torch_payload())
    warnings = io.StringIO()
    with docutils_namespace():  # each app registers its nodes and roles afresh
        app = Sphinx(str(src), str(src), str(tmp_path / "out"), str(tmp_path / "doctrees"),
                     "dummy", status=None, warning=warnings, freshenv=True)
        app.build()
        doctree = app.env.get_doctree("index")
    return re.sub(r"\x1b\[[0-9;]*m", "", warnings.getvalue()), doctree


def test_the_directive_warns_for_a_missing_file_and_renders_nothing(tmp_path: Path) -> None:
    from docutils import nodes

    warnings, doctree = build_docs(
        tmp_path, ".. benchmark-table:: missing.json\n\n:benchmark:`absent.json mlp a`\n")
    assert "benchmark-table: missing.json: cannot be read" in warnings
    assert "benchmark: absent.json: cannot be read" in warnings
    assert not list(doctree.findall(nodes.table))


def test_the_directive_renders_a_good_file_without_warning(tmp_path: Path) -> None:
    from docutils import nodes

    warnings, doctree = build_docs(
        tmp_path, ".. benchmark-table:: overhead_torch.json\n   :workloads: mlp\n\n"
                  "It reads :benchmark:`overhead_torch.json mlp a`.\n")
    assert warnings == ""
    (table,) = doctree.findall(nodes.table)
    assert "2026-12-04 18:24 UTC" in table.next_node(nodes.title).astext()
    assert len(list(table.findall(nodes.row))) == 1 + 2  # the header and mlp's two configs
    ratio = statistics.median(w / p for p, w in PAIRS)
    assert f"It reads {ratio:.3f} [1.100-1.160]." in doctree.astext()


# -- the committed data ------------------------------------------------------------------------


def test_every_committed_benchmark_file_renders_without_warning() -> None:
    files = sorted(DATA.glob("*.json"))
    assert files, f"no benchmark JSON under {DATA}"
    for path in files:
        table = build_table([path])
        assert table.rows, path.name
        assert all(len(row) == len(table.header) for row in table.rows), path.name


def test_the_performance_page_types_no_ratio_by_hand() -> None:
    """Every ratio with an interval on the page comes from a role or a table."""
    page = (DOCS / "performance.md").read_text(encoding="utf-8")
    assert not re.findall(r"\d\.\d{2,3} \[\d", page)
    assert "{benchmark-table}" in page

