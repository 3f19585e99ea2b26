"""The install is part of the product: every third-party module the package imports is a declared
dependency (or, for an optional feature, a dependency of its extra that is imported only where the feature
runs, so the package imports without it), and no file of the repository names an absolute path of a machine.

(The runtime check that the README's first install command alone runs the main job is a CI step:
``.ci/run`` builds a second environment without extras and runs a short embedded default there.)
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tomllib

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(ROOT, "jaxrl_async")
# modules only the test helpers import (jaxrl_async/testing.py compares against torch transformers)
TEST_ONLY_FILES = {os.path.join(PKG, "testing.py")}
# optional features: module -> the extra that declares it (imported inside functions only)
OPTIONAL_MODULES = {"wandb": "wandb", "fastapi": "serve", "starlette": "serve", "uvicorn": "serve", "openai": "agent",
                    "ray": "ray"}


def _declared(section: list[str]) -> set[str]:
    names = set()
    for req in section:
        m = re.match(r"\s*([A-Za-z0-9_.\-]+)", req)
        names.add(re.sub(r"[-_.]+", "-", m.group(1)).lower())
    return names


_IMPORTS_SCRIPT = """
import ast, json, sys
out = {}
for path in sys.argv[1:]:
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    def names(nodes):
        mods = set()
        for node in nodes:
            if isinstance(node, ast.Import):
                mods.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                mods.add(node.module.split(".")[0])
        return sorted(mods)
    # at import time: the module body, also inside its top-level if/try blocks (not in functions or classes)
    top, stack = [], list(tree.body)
    while stack:
        node = stack.pop()
        top.append(node)
        if isinstance(node, (ast.If, ast.Try)):
            stack += node.body + node.orelse + getattr(node, "finalbody", []) + [
                n for h in getattr(node, "handlers", []) for n in h.body]
    out[path] = [names(ast.walk(tree)), names(top)]
print(json.dumps(out))
"""


def _imports_of(paths: list[str]) -> dict[str, tuple[set[str], set[str]]]:
    """Top-level modules each file imports (anywhere, and at import time), parsed in a fresh interpreter:
    CPython 3.11's ast.parse can fail with "AST constructor recursion depth mismatch" in a process whose other
    threads compile code (seen in CI after the suite's thread-heavy tests)."""
    proc = subprocess.run([sys.executable, "-c", _IMPORTS_SCRIPT, *paths], capture_output=True, text=True,
                          check=True, timeout=120)
    return {p: (set(a), set(t)) for p, (a, t) in json.loads(proc.stdout).items()}


def test_every_runtime_import_is_a_declared_dependency():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    declared = _declared(project["dependencies"])
    dist_of = importlib.metadata.packages_distributions()
    stdlib = set(sys.stdlib_module_names)
    missing: dict[str, set[str]] = {}
    eager: dict[str, set[str]] = {}
    paths = [os.path.join(d, fn) for d, _, files in os.walk(PKG) for fn in files if fn.endswith(".py")]
    for path, (mods, at_import) in _imports_of([p for p in paths if p not in TEST_ONLY_FILES]).items():
        for mod in mods - stdlib - {"jaxrl_async", "__future__"}:
            if mod in OPTIONAL_MODULES:
                if mod in at_import:
                    eager.setdefault(mod, set()).add(os.path.relpath(path, ROOT))
                continue
            dists = {re.sub(r"[-_.]+", "-", d).lower() for d in dist_of.get(mod, [mod])}
            if not dists & declared:
                missing.setdefault(mod, set()).add(os.path.relpath(path, ROOT))
    assert not missing, f"imported but not in [project].dependencies of pyproject.toml: {missing}"
    assert not eager, f"optional modules imported when the package is imported: {eager}"
    extras = project["optional-dependencies"]
    for mod, extra in OPTIONAL_MODULES.items():
        assert mod in _declared(extras[extra]) and mod in _declared(extras["test"]), (mod, extra)  # CI tests it
    # transformers' apply_chat_template imports jinja2 without declaring it (the quickstart crashed)
    assert "jinja2" in declared


# /home/<user>, /Users/<user>, /root/<...>, /work/<...>, /tmp/<...> written into the repository as a
# place of one machine. Test-only and documentation examples use relative paths or $VARIABLES.
_ABSOLUTE = re.compile(r"(?<![\w$./-])/(?:home|Users|root|work|mnt/[a-z]+/(?:home|work)|opt/[a-z]+)/[\w.\-]+")


def test_no_absolute_machine_paths_in_the_repository():
    try:
        files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    hits = []
    for rel in files:
        path = os.path.join(ROOT, rel)
        if not os.path.isfile(path) or rel.endswith((".png", ".safetensors", ".parquet")):
            continue
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except UnicodeDecodeError:
            continue
        for n, line in enumerate(text.split("\n"), 1):
            if _ABSOLUTE.search(line) and "noqa: abs-path" not in line:
                hits.append(f"{rel}:{n}: {line.strip()[:120]}")
    assert not hits, "absolute machine paths in the repository:\n" + "\n".join(hits)
