"""LoRA config mistakes on the command line: one line on stderr naming the model.lora field, exit 2, no
traceback; a valid LoRA config validates (--dry-run) and prints its lora section."""
import os
import subprocess
import sys

import pytest

from jaxrl_async.testing import subprocess_xla_flags

CASES = [
    ("model.lora.rank=-1", "model.lora.rank"),
    ("model.lora.rank=8 model.lora.alpha=0", "model.lora.alpha"),
    ("model.lora.rank=8 model.lora.targets=('q','qkv')", "model.lora.targets"),
    ("model.lora.rank=8 model.lora.dropout=1.5", "model.lora.dropout"),
    ("model.lora.rank=8 model.lora.base_dtype=int8", "model.lora.base_dtype"),
    ("model.lora.rank=8 model.lora.decode=fused", "model.lora.decode"),
    ("model.lora.rnak=8", "model.lora.rnak"),
]


def _main(argv, cwd):
    env = dict(os.environ, XLA_FLAGS=subprocess_xla_flags())
    env.update(JAX_PLATFORMS="cpu", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "jaxrl_async.main", "--dry-run", *argv], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("overrides, field", CASES, ids=[c[1] + ":" + c[0].split("=")[-1] for c in CASES])
def test_lora_config_mistake_is_one_line_naming_the_field(tmp_path, overrides, field):
    proc = _main(overrides.split(), str(tmp_path))
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and lines[-1].startswith("main: ") and field in lines[-1], proc.stderr


def test_valid_lora_config_validates(tmp_path):
    proc = _main(["model.lora.rank=4", "model.lora.targets=('q','v')", "model.lora.decode=merged"], str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout + proc.stderr
    assert "model.lora.rank = 4" in out and "model.lora.decode = 'merged'" in out and "config OK" in out
