"""The package layout docs/design.md describes: which part may import which, and no circle.

Every ``import`` statement of the package is read (module level and inside functions alike), so
a lazy import cannot hide a circle or a forbidden dependency.
"""
from __future__ import annotations

import ast
import os

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "megatron_zb")

# part -> the parts it may import (design.md's map)
ALLOWED = {
    "core": set(),
    "argtypes": set(),
    "runtime": {"core"},
    "megatron": {"core", "runtime", "argtypes"},
    "verify": {"core", "runtime", "megatron", "argtypes"},
    "plot": {"core"},
    "cli": {"core", "argtypes", "plot", "verify"},
}


def _part(module: str) -> str:
    return module.split(".")[1] if module.startswith("megatron_zb.") else ""


def _modules():
    for dirpath, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                rel = os.path.relpath(path, os.path.dirname(ROOT))[:-3].replace(os.sep, ".")
                if rel.endswith(".__init__"):
                    rel = rel[: -len(".__init__")]
                yield rel, path


def _imports(module: str, path: str):
    tree = ast.parse(open(path).read(), path)
    is_pkg = path.endswith("__init__.py")
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[: len(base) - node.level + (1 if is_pkg else 0)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            yield target
            for a in node.names:  # `from . import plot`
                yield f"{target}.{a.name}"


def _graph():
    g = {}
    for module, path in _modules():
        part = _part(module)
        deps = {_part(t) for t in _imports(module, path) if t.startswith("megatron_zb.")}
        g.setdefault(part, set()).update(d for d in deps if d and d != part)
    return g


def test_every_part_imports_only_what_the_design_allows():
    g = _graph()
    assert set(g) <= set(ALLOWED) | {""}, f"parts not in design.md's map: {set(g) - set(ALLOWED)}"
    for part, deps in g.items():
        bad = deps - ALLOWED.get(part, set())
        assert not bad, f"megatron_zb.{part} imports {sorted(bad)}; design.md allows {sorted(ALLOWED[part])}"


def test_no_import_circle_between_parts():
    g = _graph()
    seen, stack = set(), []

    def visit(n):
        if n in stack:
            raise AssertionError("import circle: " + " -> ".join(stack[stack.index(n):] + [n]))
        if n in seen:
            return
        stack.append(n)
        for d in g.get(n, ()):
            visit(d)
        stack.pop()
        seen.add(n)
    for n in g:
        visit(n)


def test_schedule_core_never_imports_torch():
    for module, path in _modules():
        if _part(module) in ("core", "argtypes", "plot", "cli"):
            heavy = {t.split(".")[0] for t in _imports(module, path)} & {"torch", "megatron"}
            assert not heavy, f"{module} imports {sorted(heavy)}"


def test_megatron_adapters_hold_no_test_scaffolding():
    names = set()
    for module, path in _modules():
        if _part(module) == "megatron":
            tree = ast.parse(open(path).read())
            names |= {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    scaffolding = {"TinyGPTConfig", "build_reference_model", "make_batches", "sgd_step_", "collect_full_grads",
                   "init_parallel_state", "run_cases", "launch", "main_verify"}
    assert not (names & scaffolding), f"test scaffolding in megatron_zb/megatron: {sorted(names & scaffolding)}"
