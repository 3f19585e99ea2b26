"""The accelerator suite stays runnable: its reduced CPU mode, one short point (a lent GPU/TPU runs the
full suite with `python benchmarks/accelerator_suite.py`)."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_accelerator_suite_reduced_mode_runs(tmp_path):
    out = tmp_path / "suite.json"
    env = {**os.environ, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "accelerator_suite.py"), "--reduced",
                           "--lengths", "128", "--steps", "1", "--json", str(out)],
                          capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(out.read_text())
    assert {r["attention"] for r in res["rows"]} == {"xla", "blockwise"}
    assert all(0 < r["mfu"] < 1.5 for r in res["rows"]), res["rows"]
    assert "| 128 | blockwise |" in proc.stdout
