"""The Keras wing reaches the torch and JAX adapters through their public interface only: no
private name of another adapter distribution is imported into ``graddebug_keras``, no private
member of their objects is read, and a Keras backend that builds on another adapter's class
defines and uses no private member of that class (the fragile base class it replaced: attributes
set before ``super().__init__`` because the parent called an overridden ``_resolve``).

Read from the source (``ast``), so that a new module of the wing is covered as soon as it
exists; the subclass check imports the backends, and runs where their frameworks are installed.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WING = ROOT / "adapters" / "keras" / "src" / "graddebug_keras"
OTHERS = {
    "graddebug_torch": ROOT / "adapters" / "torch" / "src" / "graddebug_torch",
    "graddebug_jax": ROOT / "adapters" / "jax" / "src" / "graddebug_jax",
    "graddebug_tensorflow": ROOT / "adapters" / "tensorflow" / "src" / "graddebug_tensorflow",
}
BACKENDS = {"graddebug_keras.torch_backend": ("torch", "KerasTorchAdapter"),
            "graddebug_keras.jax_backend": ("jax", "KerasJaxAdapter")}


def private(name: str) -> bool:
    """A leading underscore, not a dunder."""
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def wing_modules() -> list[Path]:
    return sorted(WING.rglob("*.py"))


def defined_privates(tree: ast.AST) -> set[str]:
    """The private members a piece of source defines: methods, ``self._x = ...`` attributes,
    and class-level names."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(item.name)
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    names.add(item.target.id)
                elif isinstance(item, ast.Assign):
                    names |= {t.id for t in item.targets if isinstance(t, ast.Name)}
        elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
              and isinstance(node.value, ast.Name) and node.value.id == "self"):
            names.add(node.attr)
    return {name for name in names if private(name)}


def distribution_privates(package: Path) -> set[str]:
    """Every private member that the classes of a distribution define."""
    names: set[str] = set()
    for file in package.rglob("*.py"):
        names |= defined_privates(ast.parse(file.read_text(encoding="utf-8")))
    return names


def test_the_wing_imports_no_private_name_of_another_adapter_and_nothing_of_tensorflow():
    offences = []
    for file in wing_modules():
        for node in ast.walk(ast.parse(file.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module:
                modules = [node.module]
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.Import):
                modules, names = [alias.name for alias in node.names], []
            else:
                continue
            for module in modules:
                top = module.split(".")[0]
                if top not in OTHERS:
                    continue
                where = f"{file.name}:{node.lineno}"
                if top == "graddebug_tensorflow":
                    offences.append(f"{where} imports {module} (the TF adapter sits above)")
                if any(private(part) for part in module.split(".")[1:]):
                    offences.append(f"{where} imports the private module {module}")
                offences += [f"{where} imports the private name {module}.{name}"
                             for name in names if private(name)]
    assert not offences, "\n".join(offences)


def test_the_wing_reads_no_private_member_of_another_adapters_objects():
    theirs = set().union(*(distribution_privates(path) for path in OTHERS.values()))
    ours = distribution_privates(WING)
    offences = []
    for file in wing_modules():
        for node in ast.walk(ast.parse(file.read_text(encoding="utf-8"))):
            # self._x is the class's own (the next test checks subclasses); on anything else, a
            # private name that another adapter's classes define and the wing's do not
            if (isinstance(node, ast.Attribute) and private(node.attr)
                    and not (isinstance(node.value, ast.Name) and node.value.id == "self")
                    and node.attr in theirs and node.attr not in ours):
                offences.append(f"{file.name}:{node.lineno} reads .{node.attr}")
    assert not offences, "\n".join(offences)


def test_the_private_member_scan_finds_what_it_looks_for():
    # The scans above see nothing in the wing: show that they would see an offence.
    source = textwrap.dedent("""
        class Base:
            _flag = 1
            def __init__(self):
                self._rows = []
            def _open(self):
                pass
    """)
    assert defined_privates(ast.parse(source)) == {"_flag", "_rows", "_open"}
    assert "_params" in distribution_privates(OTHERS["graddebug_torch"])


@pytest.mark.parametrize("module", sorted(BACKENDS))
def test_a_keras_backend_shares_no_private_member_with_the_adapter_classes_it_builds_on(module):
    framework, name = BACKENDS[module]
    pytest.importorskip(framework)
    pytest.importorskip("keras")
    from graddebug.adapter import BaseAdapter

    cls = getattr(importlib.import_module(module), name)
    kit = defined_privates(ast.parse(textwrap.dedent(inspect.getsource(BaseAdapter))))
    theirs: dict[str, str] = {}
    for base in cls.__mro__[1:]:
        if base.__module__.split(".")[0] in OTHERS:
            tree = ast.parse(textwrap.dedent(inspect.getsource(base)))
            theirs |= {n: base.__qualname__ for n in defined_privates(tree) - kit}
    own = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    used = {node.attr for node in ast.walk(own)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
            and node.value.id == "self" and private(node.attr)}
    shared = sorted((used | defined_privates(own)) & theirs.keys())
    assert not shared, [f"{name}.{n} is {theirs[n]}'s" for n in shared]


def class_index() -> dict[str, list[ast.ClassDef]]:
    """Every class of the core and the adapters by name (a name may repeat across modules)."""
    found: dict[str, list[ast.ClassDef]] = {}
    for folder in (ROOT / "src", ROOT / "adapters"):
        for file in folder.rglob("*.py"):
            for node in ast.walk(ast.parse(file.read_text(encoding="utf-8"))):
                if isinstance(node, ast.ClassDef):
                    found.setdefault(node.name, []).append(node)
    return found


def base_names(node: ast.ClassDef) -> set[str]:
    return {b.id if isinstance(b, ast.Name) else b.attr for b in node.bases
            if isinstance(b, (ast.Name, ast.Attribute))}


def overridden_calls_in_constructors(classes: dict[str, list[ast.ClassDef]]) -> list[str]:
    """``Base.__init__`` calling ``self.m()`` where a subclass of ``Base`` defines ``m``."""
    children: dict[str, set[str]] = {}
    for name, nodes in classes.items():
        for node in nodes:
            for base in base_names(node):
                children.setdefault(base, set()).add(name)
    offences = []
    for name, nodes in classes.items():
        for node in nodes:
            init = next((f for f in node.body if isinstance(f, ast.FunctionDef)
                         and f.name == "__init__"), None)
            if init is None:
                continue
            called = {c.func.attr for c in ast.walk(init) if isinstance(c, ast.Call)
                      and isinstance(c.func, ast.Attribute)
                      and isinstance(c.func.value, ast.Name) and c.func.value.id == "self"}
            todo, seen = list(children.get(name, ())), set()
            while todo:
                sub = todo.pop()
                if sub in seen:
                    continue
                seen.add(sub)
                todo += children.get(sub, ())
                for subnode in classes[sub]:
                    defined = {f.name for f in subnode.body
                               if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}
                    offences += [f"{name}.__init__ calls self.{m}(), which {sub} overrides"
                                 for m in sorted(called & defined)]
    return offences


def test_no_constructor_calls_a_method_that_a_subclass_overrides():
    assert overridden_calls_in_constructors(class_index()) == []


def test_the_constructor_check_finds_the_pattern_it_forbids():
    source = textwrap.dedent("""
        class Parent:
            def __init__(self):
                self._resolve()
            def _resolve(self):
                pass
        class Child(Parent):
            def _resolve(self):
                pass
    """)
    classes: dict[str, list[ast.ClassDef]] = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            classes.setdefault(node.name, []).append(node)
    assert overridden_calls_in_constructors(classes) == [
        "Parent.__init__ calls self._resolve(), which Child overrides"]
