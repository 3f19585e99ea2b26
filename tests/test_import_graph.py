"""The package's import graph (issue 24, Found 7): no cycle between modules (imports inside functions
included: they hid four cycles), no import of another module's underscore names, and the layering the
layout promises: ``api/`` imports nothing from jaxrl_async outside ``api/``; ``kernels/`` and ``sharding/``
import nothing from ``models/`` or the roles; the loop (``loop/``) is not imported by the roles it drives
(``generator/``, ``rollout/``, ``trainer/``, ``rl/``, ``models/``); the generator imports no rollout or trainer
logic; no library module imports a CLI module (``cli/common`` is their shared error style)."""
from __future__ import annotations

import ast
import os

PKG = "jaxrl_async"
ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), PKG)


def _modules() -> dict[str, str]:
    out = {}
    for d, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(d, f), os.path.dirname(ROOT))[:-3].replace(os.sep, ".")
                out[rel[: -len(".__init__")] if rel.endswith(".__init__") else rel] = os.path.join(d, f)
    return out


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The module of ``name`` (a module, or an attribute of one)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(mod: str, path: str) -> list[tuple[str, str | None, int]]:
    """(imported module, imported attribute or None, line) of every jaxrl_async import in ``mod``."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    is_pkg = path.endswith("__init__.py")
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, None, node.lineno) for a in node.names if a.name.split(".")[0] == PKG]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = mod.split(".")
                parts = parts[: len(parts) - node.level + (1 if is_pkg else 0)]
                base = ".".join(parts + ([base] if base else []))
            if base.split(".")[0] != PKG:
                continue
            out += [(base, a.name, node.lineno) for a in node.names]
    return out


def _reexports(package: str) -> dict[str, str]:
    """Name -> the submodule a package's ``__init__`` imports it from (``from .sub import Name``)."""
    out = {}
    for base, attr, _ in _imports(package, MODULES[package]):
        if attr is not None and base.startswith(package + ".") and base in MODULES:
            out[attr] = base
    return out


def _target(base: str, attr: str | None) -> str | None:
    """The module an import depends on: a submodule imported by name, the submodule a package re-exports the name
    from (so ``from jaxrl_async.config import X`` is an edge to the module defining X, not to the package's
    ``__init__``, which would hide or invent cycles), else the module itself."""
    if attr is not None and f"{base}.{attr}" in MODULES:
        return f"{base}.{attr}"
    module = _resolve(base)
    if attr is not None and module is not None and MODULES[module].endswith("__init__.py"):
        return _reexports(module).get(attr, module)
    return module


def _graph() -> dict[str, set[str]]:
    g: dict[str, set[str]] = {m: set() for m in MODULES}
    for mod, path in MODULES.items():
        for base, attr, _ in _imports(mod, path):
            target = _target(base, attr)
            if target and target != mod:
                g[mod].add(target)
    return g


def _cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(g[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    cycles = _cycles(_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _underscore_imports(mod: str, path: str) -> list[str]:
    package = mod.rpartition(".")[0]
    bad = []
    for base, attr, line in _imports(mod, path):
        if attr is not None and f"{base}.{attr}" in MODULES:  # `from package import module`
            module, name = f"{base}.{attr}", None
        else:
            module, name = _resolve(base), attr
        if module is None or module == mod:
            continue
        private_module = any(_private(p) for p in module.split("."))
        if (private_module and module.rpartition(".")[0] != package) or (name is not None and _private(name)):
            bad.append(f"{mod}:{line} imports {base}{'.' + attr if attr else ''}")
    return bad


def test_no_cross_module_underscore_imports():
    """A module's underscore names are its own. A package's private module (``rewards/_isolation.py``) may be
    imported by the package's own modules, not its underscore names."""
    bad = [b for mod, path in MODULES.items() for b in _underscore_imports(mod, path)]
    assert not bad, "imports of another module's underscore names:\n" + "\n".join(bad)


def _deps(prefix: str) -> dict[str, set[str]]:
    g = _graph()
    return {m: g[m] for m in g if m == prefix or m.startswith(prefix + ".")}


def test_layering():
    bad = []
    for m, deps in _deps(f"{PKG}.api").items():
        bad += [f"{m} -> {d}" for d in deps if not d.startswith(f"{PKG}.api")]
    for layer in ("kernels", "sharding"):  # below the models and the roles
        for m, deps in _deps(f"{PKG}.{layer}").items():
            bad += [f"{m} -> {d}" for d in deps if d.startswith(tuple(f"{PKG}.{p}" for p in (
                "models", "generator", "rollout", "trainer", "rl", "loop", "distributed")))]
    for role in ("generator", "rollout", "trainer", "rl", "models", "kernels", "sharding", "data", "rewards",
                 "checkpoint"):
        for m, deps in _deps(f"{PKG}.{role}").items():
            bad += [f"{m} -> {d}" for d in deps if d.startswith(f"{PKG}.loop")]
    for m, deps in _deps(f"{PKG}.generator").items():  # the engine knows nothing of episodes or training
        bad += [f"{m} -> {d}" for d in deps if d.startswith((f"{PKG}.rollout", f"{PKG}.trainer", f"{PKG}.rl"))]
    entry_points = ({f"{PKG}.{t}" for t in ("main", "generate", "evaluate", "score", "export")}
                    | {f"{PKG}.plan.__main__", f"{PKG}.serve.__main__"})
    for m, deps in _graph().items():  # a CLI module is a program, not a library: only its shared helpers are
        if m.startswith(f"{PKG}.cli") or m in entry_points:
            continue
        bad += [f"{m} -> {d}" for d in deps if d.startswith(f"{PKG}.cli.") and d != f"{PKG}.cli.common"]
    assert not bad, "layering violations:\n" + "\n".join(bad)


def test_the_checker_sees_cycles_and_underscore_imports():
    """Not vacuous: a two-module cycle and an underscore import are found."""
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
    g = _graph()
    assert f"{PKG}.loop.step" in g[f"{PKG}.loop.session"]  # function-level and module-level imports both seen
    assert f"{PKG}.loop.setup" in g[f"{PKG}.loop.session"]  # (a function-level one)


def test_the_checker_sees_underscore_imports(tmp_path, monkeypatch):
    f = tmp_path / "m.py"
    f.write_text("from jaxrl_async.loop.step import _x\nfrom jaxrl_async.rewards import _isolation\n"
                 "import jaxrl_async.rewards._seccomp\n")
    monkeypatch.setitem(MODULES, f"{PKG}.loop.m", str(f))
    assert len(_underscore_imports(f"{PKG}.loop.m", str(f))) == 3


def test_generation_does_not_import_the_dataset_stack():
    """`jaxrl_async.data` loads its names on first use: the generation CLIs import ``data.tokenizer`` and the engine,
    and grain (~0.7 s of a `generate` process's start on a CPU) stays out of their processes."""
    import subprocess
    import sys

    code = ("import sys, jaxrl_async.cli.generate, jaxrl_async.cli.serve, jaxrl_async.generator.engine, "
            "jaxrl_async.generator.orchestrator; print(sorted(m for m in sys.modules if m.split('.')[0] == 'grain'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"
    import jaxrl_async.data as data  # the package's names still resolve

    assert all(hasattr(data, n) for n in data.__all__)
    assert data.build_tokenizer.__module__ == "jaxrl_async.data.tokenizer"
    assert data.formats.parse_row is data.parse_row  # submodules as attributes too
    assert not hasattr(data, "no_such_name")
