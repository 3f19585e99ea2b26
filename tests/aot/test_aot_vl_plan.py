"""The Qwen2.5-VL-7B plans compiled for their targets at reduced depth (2 decoder layers, 2 vision blocks, one of
them full-attention; every width the 7B's): `python -m jaxrl_async.cli.plan_vl` on ``configs/qwen2_5_vl_7b.py``
(8 x H100, deviceless CUDA compile) and ``configs/qwen2_5_vl_7b_v5p.py`` (v5p-64, libtpu): the decoder's programs
and the VL train step and prefill (vision tower with the blockwise segment attention at the 1280-token image budget)
compile for the target in bfloat16, and the plans fit. Slow (minutes each: the v5p compile of the VL step alone
took ~5 min on the shared 2 cores): run by hand, ``JAX_PLATFORMS=cpu python -m pytest -q -m slow
tests/aot/test_aot_vl_plan.py`` with the aot extras. Each plan is a subprocess: it sets its simulated device count
before JAX starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from jaxrl_async.plan import aot

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _plan(config: str) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)  # the plan sets its own device count
    cmd = [sys.executable, "-m", "jaxrl_async.cli.plan_vl", "--config", os.path.join(ROOT, "configs", config),
           "--compile-for", "target", "--layers", "2", "--vision-depth", "2", "--json"]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def _check(r: dict, target: str) -> None:
    v = r["vl"]
    assert target in r["compiled_for"]["trainer"] and target in r["compiled_for"]["generator"]
    assert target in v["compiled_for"]
    for ex in (v["train_step"], v["proximal_logprobs"], v["vision_tower"], v["prefill"], r["executables"]["train_step"],
               r["executables"]["decode_step"]):
        assert ex["compute_dtype"] == "bfloat16"
    assert v["image_budget"]["patches_per_prompt"] == 5120 and v["vision_depth"] == 2
    assert v["train_step_transient_bytes"] > 0 and v["prefill_transient_bytes"] > 0
    assert v["fits"] and r["verdict"] == "fits"


@pytest.mark.slow
@pytest.mark.skipif(not aot.gpu_available(), reason="needs the CUDA plugin (extra [aot-gpu])")
def test_vl_7b_plan_compiles_for_8_h100():
    _check(_plan("qwen2_5_vl_7b.py"), "H100")


@pytest.mark.slow
@pytest.mark.skipif(not aot.tpu_available(), reason="needs libtpu (extra [aot-tpu])")
def test_vl_7b_plan_compiles_for_a_v5p_slice():
    _check(_plan("qwen2_5_vl_7b_v5p.py"), "v5:2x4x4")
