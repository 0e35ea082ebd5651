"""Tables of the adapter pages, read from the code: what each adapter declares, and the fields
and event kinds of the records.

Nothing in these tables is typed by hand. A page writes one of::

    ```{adapter-capabilities}
    ```

    ```{adapter-options}
    ```

    ```{record-fields}
    ```

    ```{event-kinds}
    ```

``adapter-capabilities`` lists every capability protocol of
:data:`graddebug.adapter.capabilities.CAPABILITIES` with its methods and the adapters that
declare it; ``adapter-options`` marks, for each adapter, the options of ``watch`` it honours
(its ``watch_options``; the Watcher honours the others itself). Both read the adapters of
:data:`ADAPTERS`, each checked by :func:`graddebug.adapter.capabilities.verify_adapter` as the
Watcher checks it. ``record-fields`` lists the fields of :class:`graddebug.records.Record` with
their dtype and the first sentence of their documentation; ``event-kinds`` the members of
:class:`graddebug.records.EventKind`.

An adapter that cannot be imported, or whose declaration does not hold, is a Sphinx warning,
so that the strict build (``-W``) fails and names it.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from docutils import nodes
from sphinx.application import Sphinx
from sphinx.pycode import ModuleAnalyzer
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective

__all__ = ["ADAPTERS", "adapter_classes", "first_sentence", "setup"]

logger = logging.getLogger(__name__)

ADAPTERS: tuple[tuple[str, str], ...] = (
    ("torch", "graddebug_torch.adapter:TorchAdapter"),
    ("tensorflow", "graddebug_tensorflow.adapter:TensorFlowAdapter"),
    ("tf1 graphs", "graddebug_tensorflow.v1graph:V1GraphAdapter"),
    ("jax", "graddebug_jax.adapter:JaxAdapter"),
    ("keras-torch", "graddebug_keras.torch_backend:KerasTorchAdapter"),
    ("keras-jax", "graddebug_keras.jax_backend:KerasJaxAdapter"),
    ("toygrad", "examples/adapter/toygrad.py:ToyAdapter"),
)
"""Every adapter the tables show: a column label and ``module:Class`` (or a file of the
repository, for the example adapter)."""

_ROOT = Path(__file__).resolve().parents[2]


def _load(where: str) -> type:
    """The adapter class at ``module:Class`` or ``path/file.py:Class``."""
    module_name, _, cls_name = where.partition(":")
    if module_name.endswith(".py"):
        path = _ROOT / module_name
        name = path.stem
        module = sys.modules.get(name)
        if module is None or getattr(module, "__file__", None) != str(path):
            spec = importlib.util.spec_from_file_location(name, path)
            if spec is None or spec.loader is None:
                raise ImportError(f"cannot load {path}")
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module  # the example registers itself by this name
            spec.loader.exec_module(module)
    else:
        module = importlib.import_module(module_name)
    cls: type = getattr(module, cls_name)
    return cls


def adapter_classes() -> list[tuple[str, type]]:
    """The adapters of :data:`ADAPTERS` that load and whose declaration holds, each with its
    label; every other one is a warning."""
    from graddebug.adapter.capabilities import verify_adapter

    found = []
    for label, where in ADAPTERS:
        try:
            cls = _load(where)
            verify_adapter(cls)
        except Exception as exc:  # a warning names it, and -W fails the build
            logger.warning(f"adapterdocs: the {label} adapter ({where}) is left out of the "
                           f"tables: {type(exc).__name__}: {exc}")
            continue
        found.append((label, cls))
    return found


def first_sentence(text: str) -> str:
    """The first sentence of a docstring entry, on one line, without reST markup."""
    flat = " ".join(text.split())
    flat = re.sub(r":\w+:`~?([^`]+)`", r"\1", flat)
    flat = flat.replace("``", "`")
    end = re.search(r"(?<!e\.g)(?<!i\.e)\.(\s|$)", flat)
    return flat[: end.start() + 1] if end else flat


def _cell(text: str) -> nodes.entry:
    """A cell whose `code` spans are literals."""
    paragraph = nodes.paragraph()
    for i, part in enumerate(text.split("`")):
        if part:
            paragraph += nodes.literal(text=part) if i % 2 else nodes.Text(part)
    return nodes.entry("", paragraph)


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], caption: str) -> nodes.table:
    node = nodes.table(classes=["generated-table"])
    node += nodes.title(text=caption)
    group = nodes.tgroup(cols=len(header))
    node += group
    for _ in header:
        group += nodes.colspec(colwidth=1)
    head = nodes.thead()
    head += _row(header)
    body = nodes.tbody()
    for row in rows:
        body += _row(row)
    group += head
    group += body
    return node


def _row(cells: Sequence[str]) -> nodes.row:
    row = nodes.row()
    for cell in cells:
        row += _cell(cell)
    return row


def _signature(method: Any) -> str:
    parameters = list(inspect.signature(method).parameters.values())[1:]
    names = [f"**{p.name}" if p.kind is p.VAR_KEYWORD else p.name for p in parameters]
    return f"`{method.__name__}({', '.join(names)})`"


class AdapterCapabilities(SphinxDirective):
    """``adapter-capabilities``: each capability, its methods, and who declares it."""

    def run(self) -> list[nodes.Node]:
        from graddebug.adapter.capabilities import CAPABILITIES, protocol_methods

        adapters = adapter_classes()
        rows = []
        for capability in CAPABILITIES:
            methods = ", ".join(_signature(m) for m in protocol_methods(capability).values())
            who = ", ".join(label for label, cls in adapters
                            if capability in getattr(cls, "capabilities", ())) or "none"
            rows.append([f"`{capability.__name__}`", methods,
                         first_sentence(capability.__doc__ or "").removeprefix("Capability: "),
                         who])
        return [_table(["capability", "methods", "what it gives", "declared by"], rows,
                       "Capabilities, as each adapter's capabilities declare them")]


class AdapterOptions(SphinxDirective):
    """``adapter-options``: which adapter honours which option of ``watch``."""

    def run(self) -> list[nodes.Node]:
        from graddebug.adapter.options import ADAPTER_OPTIONS

        adapters = adapter_classes()
        rows = [[f"`{name}=`", *("yes" if name in getattr(cls, "watch_options", ()) else "refused"
                                 for _, cls in adapters)] for name in ADAPTER_OPTIONS]
        return [_table(["option", *(label for label, _ in adapters)], rows,
                       "Options of watch() by adapter, as each adapter's watch_options "
                       "declare them")]


def _attribute_docs(cls: type) -> dict[str, str]:
    """The ``Attributes:`` entries of a Google-style class docstring, by name."""
    text = inspect.getdoc(cls) or ""
    section = text.split("Attributes:", 1)[-1] if "Attributes:" in text else ""
    entries: dict[str, str] = {}
    name = None
    for line in section.splitlines():
        match = re.match(r"^    (\w+): (.*)$", line)
        if match:
            name = match.group(1)
            entries[name] = match.group(2)
        elif name is not None and line.startswith("        "):
            entries[name] += " " + line.strip()
        elif line.strip():
            name = None
    return entries


class RecordFields(SphinxDirective):
    """``record-fields``: every field of a record, its dtype and what it holds."""

    def run(self) -> list[nodes.Node]:
        from graddebug.records import RECORD_DTYPES, Record

        docs = _attribute_docs(Record)
        missing = [f for f in Record._fields if f not in docs]
        if missing:
            logger.warning(f"record-fields: Record's docstring documents no {missing}")
        rows = [[f"`{name}`", RECORD_DTYPES.get(name, ""), first_sentence(docs.get(name, ""))]
                for name in Record._fields]
        return [_table(["field", "dtype", "holds"], rows,
                       f"The {len(Record._fields)} fields of graddebug.records.Record")]


class EventKinds(SphinxDirective):
    """``event-kinds``: every kind of event and what it says."""

    def run(self) -> list[nodes.Node]:
        from graddebug.records import EventKind

        docs = ModuleAnalyzer.for_module("graddebug.records").find_attr_docs()
        rows = []
        for member in EventKind:
            lines = docs.get(("EventKind", member.name))
            if not lines:
                logger.warning(f"event-kinds: EventKind.{member.name} has no docstring")
            rows.append([f"`{member.value}`", first_sentence(" ".join(lines or []))])
        return [_table(["kind", "means"], rows,
                       f"The {len(EventKind)} kinds of graddebug.records.EventKind")]


def setup(app: Sphinx) -> dict[str, Any]:
    """Register the four directives.

    Args:
        app: The Sphinx application.

    Returns:
        The extension's metadata.
    """
    app.add_directive("adapter-capabilities", AdapterCapabilities)
    app.add_directive("adapter-options", AdapterOptions)
    app.add_directive("record-fields", RecordFields)
    app.add_directive("event-kinds", EventKinds)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
