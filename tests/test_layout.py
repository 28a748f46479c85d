"""The package layout docs/design.md describes: which part may import which, and no circle.

Every ``import`` statement of the package is read (module level and inside functions alike), so
a lazy import cannot hide a circle or a forbidden dependency.
"""
from __future__ import annotations

import ast
import functools
import os
import subprocess
import sys

import pytest

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
    "run": {"megatron", "runtime"},
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


@functools.lru_cache(maxsize=None)  # every file is parsed once for all the tests here
def _tree(path: str) -> ast.Module:
    with open(path) as f:
        return ast.parse(f.read(), path)


@functools.lru_cache(maxsize=None)
def _nodes(path: str) -> tuple:
    return tuple(ast.walk(_tree(path)))


def _from_target(module: str, path: str, node: ast.ImportFrom) -> str:
    """The module a ``from X import ...`` statement of ``module`` (file ``path``) names."""
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base[: len(base) - node.level + (1 if path.endswith("__init__.py") else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(module: str, path: str):
    for node in _nodes(path):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name
        elif isinstance(node, ast.ImportFrom):
            target = _from_target(module, path, node)
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
            names |= {n.name for n in _tree(path).body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    scaffolding = {"TinyGPTConfig", "build_reference_model", "make_batches", "sgd_step_", "collect_full_grads",
                   "init_parallel_state", "run_cases", "launch", "main_verify"}
    assert not (names & scaffolding), f"test scaffolding in megatron_zb/megatron: {sorted(names & scaffolding)}"


def _module_names():
    return {m for m, _ in _modules()}


def _file_graph():
    """module -> the megatron_zb modules (files) its import statements name: ``from .ir import B``
    names module .ir, ``from . import vblock`` names module .vblock (not the package it is in)."""
    known = _module_names()
    g = {}
    for module, path in _modules():
        deps = set()
        for node in _nodes(path):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                target = _from_target(module, path, node)
                subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in known]
                targets = subs if len(subs) == len(node.names) else subs + [target]
            else:
                continue
            for t in targets:
                while t and t not in known and "." in t:
                    t = t.rsplit(".", 1)[0]
                if t in known and t != module:
                    deps.add(t)
        g[module] = deps
    return g


def test_no_import_circle_between_files():
    """Not only between parts: no two files of the package import each other, directly or round
    a longer loop (lazy imports inside functions included)."""
    g = _file_graph()
    seen, stack, circles = set(), [], []

    def visit(n):
        if n in stack:
            circles.append(stack[stack.index(n):] + [n])
            return
        if n in seen:
            return
        stack.append(n)
        for d in sorted(g.get(n, ())):
            visit(d)
        stack.pop()
        seen.add(n)
    for n in sorted(g):
        visit(n)
    assert not circles, "import circles: " + "; ".join(" -> ".join(c) for c in circles[:5])


def test_no_private_name_imported_across_modules():
    bad = []
    for module, path in _modules():
        for node in _nodes(path):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("megatron_zb")):
                bad += [f"{module} imports {a.name} from {'.' * node.level}{node.module or ''}"
                        for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
    assert not bad, "private names imported across modules: " + "; ".join(bad)


MAX_LINES = 500


def test_no_file_over_500_lines():
    long = {m: n for m, p in _modules() for n in [sum(1 for _ in open(p))] if n > MAX_LINES}
    assert not long, f"files over {MAX_LINES} lines (split them by responsibility): {long}"


@pytest.mark.megatron
def test_every_module_imports():
    """Every file of the package imports (a name moved between modules fails here, not in a rank)."""
    code = ("import importlib, pkgutil, megatron_zb\n"
            "from megatron_zb.megatron.cpu import cpu_shims\n"
            "cpu_shims.python_compat(); cpu_shims.apply()\n"
            "bad = []\n"
            "for m in pkgutil.walk_packages(megatron_zb.__path__, 'megatron_zb.'):\n"
            "    if m.name.endswith('__main__'): continue\n"
            "    try: importlib.import_module(m.name)\n"
            "    except Exception as e: bad.append(f'{m.name}: {type(e).__name__}: {e}')\n"
            "print('\\n'.join(bad))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=os.path.dirname(ROOT))
    assert out.returncode == 0 and not out.stdout.strip(), out.stdout + out.stderr[-2000:]


@functools.lru_cache(maxsize=None)  # each module is parsed once, not once per import of it (was 20 s)
def _top_level_names(path: str) -> frozenset:
    names = set()
    for node in _tree(path).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.Try, ast.If)):
            for sub in ast.walk(node):
                if isinstance(sub, (ast.Import, ast.ImportFrom)):
                    names |= {(a.asname or a.name).split(".")[0] for a in sub.names}
    return frozenset(names)


def test_every_name_imported_from_the_package_exists():
    """``from megatron_zb.x import name`` (relative or absolute, inside functions too) names a module
    or something ``x`` defines: a name moved to another module fails here, not in a rank at run time."""
    paths = dict(_modules())
    repo = os.path.dirname(ROOT)
    others = [(f"{d}.{f[:-3]}", os.path.join(repo, d, f)) for d in ("tests", "benchmarks", "scripts", "examples")
              if os.path.isdir(os.path.join(repo, d)) for f in sorted(os.listdir(os.path.join(repo, d)))
              if f.endswith(".py")]
    bad = []
    for module, path in list(_modules()) + others:
        for node in _nodes(path):
            if not isinstance(node, ast.ImportFrom):
                continue
            target = _from_target(module, path, node)
            if target not in paths:
                continue
            defined = _top_level_names(paths[target])
            bad += [f"{module}: {a.name} from {target}" for a in node.names
                    if a.name != "*" and a.name not in defined and f"{target}.{a.name}" not in paths]
    assert not bad, "names imported that their module does not define: " + "; ".join(bad)
