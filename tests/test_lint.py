"""The tree passes the linter configured in pyproject.toml (``[tool.ruff]``: pyflakes, pycodestyle, bugbear;
130 columns). ruff is part of the test extra."""
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_ruff_check_passes():
    exe = shutil.which("ruff", path=os.path.dirname(sys.executable)) or shutil.which("ruff")
    if exe is None:
        pytest.skip("ruff is not installed (pip install -e '.[test]' installs it)")
    proc = subprocess.run([exe, "check", "jaxrl_async", "tests", "benchmarks", "configs", "examples"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-2000:]
