"""`python -m jaxrl_async.main`: config errors name the field and stop before anything is compiled."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from jaxrl_async.main import main


@pytest.mark.parametrize("args, field", [
    (["rollout.max_head_offpolicyness=-1"], "rollout.max_head_offpolicyness"),
    (["trainer.lr=abc"], "trainer.lr"),
    (["trainer.nope=1"], "trainer.nope"),
    (["mesh.trainer.shape=(3,)"], "mesh.trainer.shape"),
    (["trainer.batch_size=3", "rollout.n_samples=1"], "trainer.batch_size"),  # 3 sequences over 2 fsdp shards
])
def test_config_errors_exit_2_naming_the_field(args, field, capsys):
    assert main(args + ["mesh.cpu_devices=None"]) == 2
    err = capsys.readouterr().err
    assert f"config error: {field}" in err, err


def test_dry_run_prints_the_resolved_default(capsys):
    assert main(["--dry-run", "trainer.total_steps=7"]) == 0
    err = capsys.readouterr().err
    assert "trainer.total_steps = 7" in err or "total_steps" in err
    assert "config OK" in err


def test_config_file_with_overrides(tmp_path, capsys):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cfg = os.path.join(root, "configs", "tiny_cpu.py")
    assert main(["--config", cfg, "--dry-run", "rollout.mode=sync"]) == 0
    assert "sync" in capsys.readouterr().err


def test_cpu_devices_are_configured_before_jax_starts(tmp_path):
    """In a fresh process the default's mesh.cpu_devices=2 gives the generator and the trainer a device each."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    code = ("import sys; from jaxrl_async.main import main; rc = main(['--dry-run']); "
            "import jax; print('DEVICES', jax.device_count()); sys.exit(rc)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "DEVICES 2" in out.stdout


def test_help_shows_flag_defaults_and_agrees_with_the_readme_on_the_run_time(capsys):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert main(["--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for flag in ("--config FILE", "(default: the embedded default)", "--print-config", "--dry-run", "(default: off"):
        assert flag in text, flag
    readme = " ".join(open(os.path.join(root, "README.md"), encoding="utf-8").read().split())
    assert "about three minutes" in text and "about three minutes" in readme  # measured: 184 s (NOTES)
