"""Issue 31 item 4: with the CUDA plugin installed (extra [aot-gpu]) on a machine without an NVIDIA GPU, the tools
start without JAX's ~20 lines of CUDA errors (``cli.quiet_cuda_probe``), and `plan` still compiles for H100."""

from __future__ import annotations

import glob
import os
import subprocess
import sys

import pytest

from jaxrl_async.plan import aot

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.skipif(not aot.gpu_available() or bool(glob.glob("/dev/nvidia[0-9]*")),
                                reason="needs the CUDA plugin on a machine without an NVIDIA GPU")
NOISE = ("cuda", "absl", "Traceback", "plugin")


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "JAXRL_ASYNC_PLUGIN_LOGS")}
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=600, env=env,
                          cwd=ROOT)


def test_tools_start_quietly_where_the_cuda_plugin_has_no_gpu():
    res = _run("jaxrl_async.main", "--dry-run", "trainer.total_steps=1")
    assert res.returncode == 0, res.stderr[-3000:]
    noisy = [ln for ln in res.stderr.splitlines() if any(w.lower() in ln.lower() for w in NOISE)]
    assert noisy == [], noisy[:5]
    res = _run("jaxrl_async.generate", "--model", "no-such-dir", "--input", "x.jsonl", "--output", "y.jsonl")
    assert res.returncode == 2 and res.stderr.strip().count("\n") == 0, res.stderr[-3000:]  # one line, no noise


def test_plan_still_compiles_for_h100_through_the_quieted_plugin():
    res = _run("jaxrl_async.plan", "--config", os.path.join("configs", "qwen3_0_6b.py"), "--compile-for", "target")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "deviceless CUDA compile" in res.stdout and "verdict: FITS" in res.stdout
    noisy = [ln for ln in res.stderr.splitlines() if any(w.lower() in ln.lower() for w in NOISE)]
    assert noisy == [], noisy[:5]
