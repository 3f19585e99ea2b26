"""`python -m jaxrl_async.main`: config errors name the field and stop before anything is compiled."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from jaxrl_async.cli.main import main
from jaxrl_async.testing import subprocess_xla_flags


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
    """On stdout: a dry run's output is its product (issue 31 item 9)."""
    assert main(["--dry-run", "trainer.total_steps=7"]) == 0
    cap = capsys.readouterr()
    assert "trainer.total_steps = 7" in cap.out or "total_steps" in cap.out
    assert "config OK" in cap.out and "total_steps" not in cap.err


def test_config_file_with_overrides(tmp_path, capsys):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cfg = os.path.join(root, "configs", "tiny_cpu.py")
    assert main(["--config", cfg, "--dry-run", "rollout.mode=sync"]) == 0
    assert "sync" in capsys.readouterr().out


def test_cpu_devices_are_configured_before_jax_starts(tmp_path):
    """In a fresh process the default's mesh.cpu_devices=2 gives the generator and the trainer a device each."""
    env = dict(os.environ, XLA_FLAGS=subprocess_xla_flags())
    code = ("import sys; from jaxrl_async.cli.main import main; rc = main(['--dry-run']); "
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


def _main_process(tmp_path, name: str) -> tuple[subprocess.Popen, str]:
    """``python -m jaxrl_async.main`` on the loop tests' tiny config, in its own session; returns it once
    its first line (the devices) is out, i.e. during the setup (tokenizer, data, model)."""
    import time

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, XLA_FLAGS=subprocess_xla_flags())
    env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    log = str(tmp_path / f"{name}.log")
    with open(log, "w") as f:
        p = subprocess.Popen([sys.executable, "-m", "jaxrl_async.main", "--config",
                              os.path.join(root, "tests", "loop", "tiny_config.py"), f"run_dir={tmp_path / 'run'}"],
                             cwd=root, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    t0 = time.monotonic()
    while "[jaxrl_async] devices:" not in open(log).read():
        assert p.poll() is None and time.monotonic() - t0 < 120, open(log).read()
        time.sleep(0.01)
    return p, log


def test_signals_during_setup_stop_in_one_line_and_a_second_signal_exits_at_once(tmp_path):
    """SIGTERM during the setup (tokenizer, data, model): exit 0, one last line (nothing to save yet, the
    same command starts the run). Two SIGINTs: the second exits at once (130) with a line. No traceback."""
    import signal
    import time

    p, log = _main_process(tmp_path, "sigterm")
    os.kill(p.pid, signal.SIGTERM)
    assert p.wait(120) == 0, open(log).read()
    out = open(log).read()
    assert "Traceback" not in out and "received SIGTERM during setup" in out, out
    assert out.rstrip().splitlines()[-1] == (
        "[jaxrl_async] stopped by SIGTERM during setup (devices, tokenizer, data, model): nothing to save yet (no "
        "training step had run); run the same command again to start the run"), out

    p, log = _main_process(tmp_path, "sigint_twice")
    os.killpg(p.pid, signal.SIGINT)
    t0 = time.monotonic()
    while "received SIGINT during" not in open(log).read():  # (two signals sent at once would coalesce)
        assert p.poll() is None and time.monotonic() - t0 < 60, open(log).read()
        time.sleep(0.005)
    os.killpg(p.pid, signal.SIGINT)
    assert p.wait(60) == 130, open(log).read()
    out = open(log).read()
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out
    assert "[jaxrl_async] received SIGINT again: exiting now without saving (exit code 130)" in out, out
