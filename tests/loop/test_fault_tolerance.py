"""Fault tolerance of the real RL loop, driven as users run it: ``python -m jaxrl_async.main`` subprocesses
(tiny config ``tiny_config.py``: a 1-layer Qwen3, simulated CPU devices) that are killed, signalled and
resumed, audited afterwards from the run's own records (``data_ledger.jsonl``, ``metrics.jsonl``,
``summary.json``, the checkpoints).

* ``test_kill_signal_resume_chain``: one run, five processes: kill -9 during a checkpoint write, kill -9
  at a random moment, SIGINT, SIGTERM (resumed onto 8 devices and other meshes), and a last resume with
  a smaller eta; a corrupt latest checkpoint in between. Proves: a signal finishes the step, commits a
  checkpoint and exits 0 with a message; every restart resumes from the last committed (usable)
  checkpoint; no data item is skipped or trained twice beyond the steps redone after a kill; every
  group's staleness stays <= eta of its process; checkpointed finished groups are reused, or dropped
  with a reason when their lag exceeds the new eta; the params restored on another mesh equal the saved ones.
* ``test_repeated_non_finite_steps_...``: NaN advantages from the 2nd batch: updates skipped and counted,
  the 5th in a row stops the run (exit 1, message) with an emergency checkpoint of the last finite state.
* ``test_eta0_resume_after_crash_is_bitwise_identical``: eta = 0, same seed and devices: a run resumed
  from its periodic checkpoint of step 2 reaches the parameters and optimizer state of the
  uninterrupted run at step 4, bit for bit (slow variant: stopped after 2 steps, async and sync mode).
* ``test_many_random_kills`` (slow): eight kill -9 at random moments, then the same audit.
* ``test_embedded_default_stops_on_signals_in_any_phase_and_resumes_as_one_run``: the embedded default
  (few steps): SIGTERM in the SFT warm start, SIGINT (process group) in RL, kill -9 mid-RL, completion,
  rerun: clean one-line stops, the warm start continued, the periodic checkpoint used, one history.

Compilation dominates a process's start, so the processes share a persistent JAX compilation cache.
Every wait has a timeout; a failing wait kills the process group and shows its log.
"""
from __future__ import annotations

import glob
import json
import os
import random
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from jaxrl_async.checkpoint import HOST, Checkpointer
from jaxrl_async.data.ledger import LEDGER_LOG, read_data_ledger
from jaxrl_async.testing import subprocess_xla_flags

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
CONFIG = os.path.join(HERE, "tiny_config.py")
INSTRUMENTED = os.path.join(HERE, "instrumented_main.py")
B = 4  # trainer.batch_size of tiny_config.py
START_TIMEOUT_S = 300  # start (a cold compile on a loaded 2-core machine) to the first trained step
STOP_TIMEOUT_S = 120  # signal to exit
# the "8 devices" layout: generator data x tensor = 1 x 2 on 0-1, trainer fsdp x tensor = 2 x 2 on 4-7
EIGHT_DEVICES = ["mesh.cpu_devices=8", "mesh.generator.devices=(0,1)", "mesh.generator.shape=(1,2)",
                 "mesh.trainer.devices=(4,5,6,7)", "mesh.trainer.shape=(2,2)", "mesh.trainer.axis_names=('fsdp','tensor')"]


@pytest.fixture(scope="module")
def jax_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("jax_cache"))


def _env(cache: str) -> dict[str, str]:
    env = dict(os.environ, XLA_FLAGS=subprocess_xla_flags())  # mesh.cpu_devices decides
    env.update(JAX_PLATFORMS="cpu", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1",
               JAX_COMPILATION_CACHE_DIR=cache, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    return env


def _committed(run_dir: str) -> list[int]:
    d = os.path.join(run_dir, "checkpoints")
    return sorted(int(n) for n in os.listdir(d) if n.isdigit() and os.path.isfile(os.path.join(d, n, "commit_success.txt")))


def _unfinished(run_dir: str) -> list[str]:
    return glob.glob(os.path.join(run_dir, "checkpoints", "*.orbax-checkpoint-tmp*"))


class Attempt:
    """One ``python -m jaxrl_async.main`` process of a run, in its own session (kill -9 takes the group).
    ``config``: the config file (default ``tiny_config.py``; None: the embedded default)."""

    def __init__(self, run_dir: str, args: list[str], cache: str, name: str, instrument: list[str] | None = None,
                 config: str | None = CONFIG):
        self.run_dir, self.name = run_dir, name
        self.log_path = os.path.join(os.path.dirname(run_dir), f"{name}.log")
        self._t0 = time.time()  # rows this process logs have a later "time" (metrics.jsonl is rewritten on resume)
        head = [INSTRUMENTED, *instrument, "--"] if instrument else ["-m", "jaxrl_async.main"]
        cmd = [sys.executable, *head, *(["--config", config] if config else []), f"run_dir={run_dir}", *args]
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(cache), stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def output(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def fail(self, why: str) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)
        pytest.fail(f"{self.name}: {why}\n--- log tail ---\n{self.output()[-6000:]}")

    def trained_steps(self) -> list[int]:
        """Steps this process logged to metrics.jsonl (complete lines only)."""
        path = os.path.join(self.run_dir, "metrics.jsonl")
        if not os.path.exists(path):
            return []
        with open(path, "rb") as f:
            data = f.read()
        rows = [json.loads(line) for line in data.split(b"\n")[:-1] if line.strip()]
        return [r["step"] for r in rows if "train/loss" in r and r["time"] >= self._t0]

    def wait_for(self, pred, what: str, timeout: float, poll_s: float = 0.002) -> None:
        t0 = time.monotonic()
        while not pred():
            if self.proc.poll() is not None:
                self.fail(f"exited with {self.proc.returncode} while waiting for {what}")
            if time.monotonic() - t0 > timeout:
                self.fail(f"no {what} within {timeout:.0f} s")
            time.sleep(poll_s)

    def kill9(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        assert self.proc.wait(30) == -signal.SIGKILL
        self._log.close()

    def stop(self, sig: int, group: bool = False) -> int:
        """Send ``sig`` (to the process group when ``group``: as Ctrl-C in a terminal does) and wait."""
        (os.killpg if group else os.kill)(self.proc.pid, sig)
        return self.wait(STOP_TIMEOUT_S)

    def wait(self, timeout: float) -> int:
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.fail(f"did not exit within {timeout:.0f} s")
        self._log.close()
        return rc


def _kill_during_checkpoint_write(run_dir, args, cache, name):
    """Start, wait for a checkpoint write of step >= 2 to begin, kill -9 the process group at once."""
    a = Attempt(run_dir, args, cache, name)

    def writing() -> bool:
        return any(int(os.path.basename(p).split(".")[0]) >= 2 for p in _unfinished(run_dir))

    a.wait_for(writing, "checkpoint write of step >= 2", START_TIMEOUT_S, poll_s=0.001)
    a.kill9()
    return a, bool(_unfinished(run_dir))


def _corrupt_latest(run_dir: str) -> int:
    """Truncate the largest params file of the latest committed checkpoint (its manifest notices)."""
    step = _committed(run_dir)[-1]
    d = os.path.join(run_dir, "checkpoints", str(step))
    with open(os.path.join(d, "jaxrl_manifest.json")) as f:
        files = json.load(f)["files"]
    rel = max((r for r in files if r.startswith("params")), key=lambda r: files[r])
    with open(os.path.join(d, rel), "r+b") as f:
        f.truncate(files[rel] // 2)
    return step


def _check_signal_stop(a: Attempt, rc: int, sig: signal.Signals) -> int:
    out = a.output()
    if rc != 0:
        a.fail(f"exit code {rc} after {sig.name}, expected 0")
    summary = json.load(open(os.path.join(a.run_dir, "summary.json")))
    step = summary["steps"]
    assert summary["stopped_by"] == "signal" and summary["signal"] == sig.name, summary
    assert f"received {sig.name}" in out and "Traceback" not in out
    assert out.rstrip().endswith(f"stopped by {sig.name} after step {step}: checkpoint {a.run_dir}/checkpoints/{step} "
                                 "is committed; run the same command again to resume")
    assert _committed(a.run_dir)[-1] == step and not _unfinished(a.run_dir)
    return step


def _audit(run: str, T: int, etas: list[int], expected_resume: list[int]) -> list[list[dict]]:
    """Check a finished run's history from its own records; returns the ledger events per process.

    * the run completed T steps, and each restart resumed from the checkpoint the test expected
      (the last committed one when it was killed, the one before when the latest was damaged);
    * the surviving history trains steps 1..T with B groups each, no data item twice, and every
      drawn item is trained, rejected with a reason or still outstanding (none skipped);
    * the only redone work is the steps a process trained after the checkpoint its successor resumed from;
    * a draw index always names the same item (replays are faithful);
    * every trained group's lag is <= the eta of the process that trained it (metrics agree).
    """
    summary = json.load(open(os.path.join(run, "summary.json")))
    assert summary["stopped_by"] == "completed" and summary["steps"] == T, summary
    h = read_data_ledger(run)
    assert [r["step"] for r in h.resumes] == expected_resume, (h.resumes, expected_resume)
    effective = h.events("consume")
    assert [e["step"] for e in effective] == list(range(1, T + 1))
    assert all(len(e["draws"]) == B for e in effective)
    trained = [d for e in effective for d in e["draws"]]
    assert len(trained) == len(set(trained)), "a data item was trained twice in the run's history"
    rejected = [e["draw"] for e in h.events("reject")]
    outstanding = summary["data"]["outstanding_draws"]
    assert sorted(trained + rejected + outstanding) == list(range(summary["data"]["next_draw"])), \
        "a data item was skipped or duplicated"
    raw = [json.loads(line) for line in open(os.path.join(run, LEDGER_LOG)) if line.strip()]
    segments: list[list[dict]] = [[]]
    for ev in raw:
        if ev["event"] == "resume":
            segments.append([])
        else:
            segments[-1].append(ev)
    assert len(segments) == len(etas)
    redone = sum(max([e["step"] for e in seg if e["event"] == "consume"], default=r["step"]) - r["step"]
                 for seg, r in zip(segments[:-1], h.resumes))
    assert len(h.events("consume", effective=False)) == redone
    assert len(effective) + redone == sum(1 for ev in raw if ev["event"] == "consume")
    item_of: dict[int, str] = {}
    for ev in raw:
        for d, i in zip(ev.get("draws", [ev.get("draw")]), ev.get("ids", [ev.get("id")])):
            if d is not None and i is not None:
                assert item_of.setdefault(d, i) == i, (d, i, item_of[d])
    for k, (seg, eta_k) in enumerate(zip(segments, etas)):
        lags = [lag for e in seg if e["event"] == "consume" for lag in e["lags"]]
        assert max(lags, default=0) <= eta_k, (k, lags)
    rows = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl")) if line.strip()]
    assert all(r["staleness/max"] <= max(etas) for r in rows if "train/loss" in r)
    print(f"audit: {len(etas)} processes, {redone} steps redone, {len(trained)} items trained, "
          f"{len(rejected)} rejected, {len(outstanding)} outstanding")
    return segments


def test_kill_signal_resume_chain(tmp_path, jax_cache):
    run = str(tmp_path / "run")
    T, eta = 24, 2  # enough steps left for the SIGINT and SIGTERM attempts to land before the end (12 ran out once)
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    base = [f"trainer.total_steps={T}", f"rollout.max_head_offpolicyness={eta}", "checkpoint.every_steps=1",
            "checkpoint.keep_last=2"]
    t_start = time.monotonic()
    expected_resume: list[int] = []  # per restart: the checkpoint step it must resume from
    attempts: list[tuple[Attempt, int]] = []  # (attempt, its eta)

    # 1. kill -9 while a checkpoint is being written (retried if the commit won the race)
    for k in range(3):
        a, mid_write = _kill_during_checkpoint_write(run, base, jax_cache, f"a1_{k}")
        attempts.append((a, eta))
        expected_resume.append(_committed(run)[-1])
        if mid_write:
            break
        print(f"try {k}: the commit finished before the kill landed")
    assert mid_write, "no kill landed inside a checkpoint write in 3 tries"

    # 2. kill -9 at a random moment after some progress
    a = Attempt(run, base, jax_cache, "a2_random_kill")
    attempts.append((a, eta))
    # (two committed checkpoints first, so that one can be damaged below; a kill never removes a committed one)
    a.wait_for(lambda: len(a.trained_steps()) >= 1 and len(_committed(run)) >= 2, "trained step and 2 checkpoints",
               START_TIMEOUT_S, poll_s=0.02)
    assert "removing unfinished checkpoint save" in a.output()  # the half-written step is discarded
    time.sleep(rng.uniform(0.0, 1.5))
    a.kill9()
    # ... and the newest committed checkpoint is damaged: the next start must fall back to the one before
    committed = _committed(run)
    assert len(committed) >= 2, committed
    bad = _corrupt_latest(run)
    expected_resume.append(committed[-2])

    # 3. SIGINT: finish the step, save, exit 0
    a = Attempt(run, base, jax_cache, "a3_sigint")
    attempts.append((a, eta))
    a.wait_for(lambda: len(a.trained_steps()) >= 1, "trained step", START_TIMEOUT_S, poll_s=0.02)
    sigint_step = _check_signal_stop(a, a.stop(signal.SIGINT), signal.SIGINT)
    assert f"skipped unusable steps [{bad}]" in a.output()
    assert any(os.path.basename(p).startswith(f"{bad}-") for p in glob.glob(os.path.join(run, "quarantine", "*")))
    expected_resume.append(sigint_step)

    # 4. SIGTERM on 8 devices with other generator/trainer meshes (the probe records the restored params)
    probe = str(tmp_path / "probe")
    a = Attempt(run, base + EIGHT_DEVICES, jax_cache, "a4_sigterm_8dev", instrument=["--record-restore", probe])
    attempts.append((a, eta))
    a.wait_for(lambda: len(a.trained_steps()) >= 1, "trained step", START_TIMEOUT_S, poll_s=0.02)
    sigterm_step = _check_signal_stop(a, a.stop(signal.SIGTERM), signal.SIGTERM)
    expected_resume.append(sigterm_step)
    assert sigterm_step < T, "the run finished before SIGTERM: raise T"

    # the params the 8-device run restored equal what the 4-device run saved, on the new trainer mesh
    saved = Checkpointer(run, read_only=True).restore(sigint_step, targets={"params": HOST}, items=["params"])
    import jax

    saved_flat = {jax.tree_util.keystr(p): np.asarray(x)
                  for p, x in jax.tree_util.tree_flatten_with_path(saved.arrays["params"])[0]}
    restored = dict(np.load(os.path.join(probe, "restored_params.npz")))
    shardings = json.load(open(os.path.join(probe, "restored_shardings.json")))
    assert restored.keys() == saved_flat.keys()
    for k, v in saved_flat.items():
        assert restored[k].dtype == v.dtype and np.array_equal(restored[k], v), k
        assert shardings[k]["devices"] == [4, 5, 6, 7] and shardings[k]["mesh"] == {"fsdp": 2, "tensor": 2}, k

    # 5. resume (8 devices) with eta = 0 and run to the end: of the checkpointed groups only those the
    #    first batch can train on-policy are reused, the others are dropped (stale_on_restore) and regenerated
    saved_groups = Checkpointer(run, read_only=True).restore(sigterm_step, items=[]).trajectories or []
    reuse, drop = set(), set()
    for g in sorted(saved_groups, key=lambda g: (g["admit_version"], g["head_version"], g["draw"])):
        (reuse if sigterm_step + len(reuse) // B - g["head_version"] <= 0 else drop).add(g["draw"])
    a = Attempt(run, base[:1] + ["rollout.max_head_offpolicyness=0", "checkpoint.every_steps=1",
                                 "checkpoint.keep_last=2"] + EIGHT_DEVICES, jax_cache, "a5_finish_eta0")
    attempts.append((a, 0))
    if a.wait(START_TIMEOUT_S + 120) != 0:
        a.fail(f"exit code {a.proc.returncode}")
    wall = time.monotonic() - t_start

    segments = _audit(run, T, [eta_i for _, eta_i in attempts], expected_resume)
    # checkpointed finished groups: reused after the signal stops, dropped with a reason when too old
    assert any(any(e["restored"]) for seg in segments[1:] for e in seg if e["event"] == "consume")
    last_seg = segments[-1]
    assert {e["draw"] for e in last_seg if e["event"] == "drop"} == drop
    assert all(e["reason"] == "stale_on_restore" for e in last_seg if e["event"] == "drop")
    assert {e["draw"] for e in last_seg if e["event"] == "restore"} == reuse
    print(f"chain: seed {seed}, {len(attempts)} processes, {len(saved_groups)} groups in the last checkpoint, "
          f"{wall:.0f} s")


def test_repeated_non_finite_steps_are_skipped_counted_and_stop_the_run_with_a_checkpoint(tmp_path, jax_cache):
    """From the 2nd batch on one advantage is NaN: the train step's guard skips each update (params and
    optimizer state untouched), the loop counts it (metrics ``train/skipped``, messages), and the 5th
    non-finite step in a row stops the run: exit 1 with a message, no traceback, and an emergency
    checkpoint holding the last finite state. A skipped step is a step (its data consumed, the step and
    version advanced with it: ``loop.step.StepRunner``), the 6th too: the emergency checkpoint is step 6
    (its state the one the last finite step 1 made) and the ledger agrees with it."""
    run = str(tmp_path / "run")
    a = Attempt(run, ["trainer.total_steps=8", "checkpoint.every_steps=2", "checkpoint.keep_last=5",
                      "trainer.packing.check_finite=False"], jax_cache, "nan", instrument=["--nan-advantages-from-batch", "2"])
    rc = a.wait(START_TIMEOUT_S + 120)
    out = a.output()
    if rc != 1:
        a.fail(f"exit code {rc}, expected 1")
    assert "run failed: training diverged: 5 consecutive non-finite steps (2..6" in out, out[-3000:]
    assert "Traceback" not in out
    assert out.count("non-finite loss/gradient, update skipped") == 4
    rows = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl")) if line.strip()]
    assert [(r["step"], r["train/skipped"]) for r in rows if "train/loss" in r] == [(1, 0), (2, 1), (3, 1), (4, 1), (5, 1)]
    assert _committed(run) == [2, 4, 6]
    ck = Checkpointer(run, read_only=True)
    meta = ck.read_meta(6)
    assert meta["extra"]["why"] == "emergency" and meta["step"] == meta["policy_version"] == 6
    assert meta["extra"]["nonfinite"]["consecutive"] == meta["extra"]["nonfinite"]["total_skipped"] == 5
    # steps 1-6 consumed their data (the checkpoint's step); nothing is both consumed and outstanding
    consumed = read_data_ledger(run).events("consume")
    assert [e["step"] for e in consumed] == [1, 2, 3, 4, 5, 6]
    trained = [d for e in consumed for d in e["draws"]]
    outstanding = [o["draw"] for o in meta["data_state"]["outstanding"]]
    rejected = [e["draw"] for e in read_data_ledger(run).events("reject")]
    assert sorted(trained + outstanding + rejected) == list(range(meta["data_state"]["next_draw"]))
    # the training state's own counters are the checkpoint's 6 steps (1 applied, 5 skipped; m minibatch
    # updates each): no update ahead of or behind its label
    counters = Checkpointer(run, read_only=True).restore(6, targets={"counters": HOST}).arrays["counters"]
    applied, skipped = int(np.asarray(counters["step"])), int(np.asarray(counters["n_skipped"]))
    assert applied >= 1 and skipped == 5 * applied, (applied, skipped)
    # every skipped update left the state as the one finite step made it
    s2, s6 = dict(_final_state(run, 2)), dict(_final_state(run, 6))
    assert s2.keys() == s6.keys() and all(s2[k].tobytes() == s6[k].tobytes() for k in s2 if "count" not in k)


def _final_state(run_dir: str, step: int) -> list[tuple[str, np.ndarray]]:
    import jax

    r = Checkpointer(run_dir, read_only=True).restore(step, targets={"params": HOST, "opt_state": HOST})
    return [(jax.tree_util.keystr(p), np.asarray(x)) for p, x in jax.tree_util.tree_flatten_with_path(r.arrays)[0]]


def _assert_bitwise_equal_runs(whole: str, resumed: str, step: int, mid_step: int) -> None:
    a, b = _final_state(whole, step), _final_state(resumed, step)
    assert [k for k, _ in a] == [k for k, _ in b]
    for (k, x), (_, y) in zip(a, b):
        assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes(), k
    # not vacuous: training moved the parameters after the interruption
    mid = dict(_final_state(resumed, mid_step))
    assert any(not np.array_equal(mid[k], x) for k, x in a if k.startswith("['params']"))
    # the same data in the same batches, all on-policy
    draws = [[(e["step"], e["draws"], e["lags"]) for e in read_data_ledger(d).events("consume")] for d in (whole, resumed)]
    assert draws[0] == draws[1] and all(lag == 0 for _, _, lags in draws[0] for lag in lags)


def run_whole_and_resumed_after_crash(tmp_path, jax_cache, extra_args=()) -> tuple[str, str]:
    """eta = 0 run to step 4 with checkpoints at 2 and 4 ("whole"), and the same run "crashed" after step 2:
    a copy of its directory as it was then (every later checkpoint removed) resumed to step 4 ("resumed").
    Returns the two run directories; both processes exited 0."""
    import shutil

    whole, resumed = str(tmp_path / "whole"), str(tmp_path / "resumed")
    args = list(extra_args) + ["rollout.max_head_offpolicyness=0", "trainer.total_steps=4",
                               "checkpoint.every_steps=2", "checkpoint.keep_last=3"]
    a = Attempt(whole, args, jax_cache, "whole")
    if a.wait(START_TIMEOUT_S + 120) != 0:
        a.fail(f"exit code {a.proc.returncode}")
    assert _committed(whole) == [2, 4]
    shutil.copytree(whole, resumed, ignore=shutil.ignore_patterns("4", "summary.json"))
    a = Attempt(resumed, args, jax_cache, "resumed")
    if a.wait(START_TIMEOUT_S + 120) != 0:
        a.fail(f"exit code {a.proc.returncode}")
    return whole, resumed


def test_eta0_resume_after_crash_is_bitwise_identical(tmp_path, jax_cache):
    """eta = 0, fixed seed and devices: resuming from the periodic checkpoint of step 2 (taken while the
    generator was already producing step 3's groups) and training to 4 gives the parameters and
    optimizer state of the uninterrupted run, bit for bit. The crash is made by copying the run
    directory as it was after step 2 (every later checkpoint removed) and resuming the copy."""
    whole, resumed = run_whole_and_resumed_after_crash(tmp_path, jax_cache)
    assert [r["step"] for r in read_data_ledger(resumed).resumes] == [2]
    _assert_bitwise_equal_runs(whole, resumed, 4, 2)
    # on-policy: the generator's behaviour log-probs are the trainer's proximal ones (fp32), no staleness
    rows = [json.loads(line) for line in open(os.path.join(whole, "metrics.jsonl")) if line.strip()]
    rows = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert max(r["train/behave_prox_abs_max"] for r in rows) <= 1e-5, rows
    assert all(r["staleness/max"] == 0 for r in rows)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_eta0_stopped_and_resumed_run_is_bitwise_identical(tmp_path, jax_cache, mode):
    """eta = 0 (async with eta 0, or rollout.mode=sync): 2 steps, stop, resume to 4 == 4 steps in one go."""
    common = ["rollout.max_head_offpolicyness=0", f"rollout.mode={mode}", "checkpoint.every_steps=None"]
    whole, split = str(tmp_path / "whole"), str(tmp_path / "split")
    for run_dir, steps, name in ((whole, 4, "whole"), (split, 2, "split_a"), (split, 4, "split_b")):
        a = Attempt(run_dir, common + [f"trainer.total_steps={steps}"], jax_cache, name)
        if a.wait(START_TIMEOUT_S + 120) != 0:
            a.fail(f"exit code {a.proc.returncode}")
    _assert_bitwise_equal_runs(whole, split, 4, 2)


@pytest.mark.slow
def test_many_random_kills(tmp_path, jax_cache):
    """kill -9 at random moments, eight times (every step checkpointed, so many kills land in a write),
    then a last process finishes the run; the audit of the chain test holds."""
    run = str(tmp_path / "run")
    T, eta, kills = 40, 2, 8
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    args = [f"trainer.total_steps={T}", f"rollout.max_head_offpolicyness={eta}", "checkpoint.every_steps=1",
            "checkpoint.keep_last=2"]
    expected_resume, mid_write = [], 0
    for k in range(kills):
        a = Attempt(run, args, jax_cache, f"kill_{k}")
        a.wait_for(lambda: len(a.trained_steps()) >= 1 and bool(_committed(run)), "trained step", START_TIMEOUT_S,  # noqa: B023 (used within this iteration)
                   poll_s=0.02)
        time.sleep(rng.uniform(0.0, 2.0))
        a.kill9()
        mid_write += bool(_unfinished(run))
        expected_resume.append(_committed(run)[-1])
    a = Attempt(run, args, jax_cache, "finish")
    if a.wait(START_TIMEOUT_S + 120) != 0:
        a.fail(f"exit code {a.proc.returncode}")
    _audit(run, T, [eta] * (kills + 1), expected_resume)
    print(f"seed {seed}: {kills} kills, {mid_write} inside a checkpoint write")


def _sft_progress(a: Attempt) -> int:
    """The SFT step the warm start's progress bar last showed (0: none yet)."""
    done = re.findall(r"sft:\s+\d+%\|[^|\r\n]*\|\s*(\d+)/\d+", a.output())
    return int(done[-1]) if done else 0


def _clean_stop(a: Attempt, rc: int, sig: signal.Signals) -> str:
    """Exit 0, no traceback, the signal acknowledged, the last line says what was saved and how to go on."""
    out = a.output()
    if rc != 0:
        a.fail(f"exit code {rc} after {sig.name}, expected 0")
    assert "Traceback" not in out and f"received {sig.name} during " in out, out[-3000:]
    last = out.rstrip().splitlines()[-1]
    assert last.startswith(f"[jaxrl_async] stopped by {sig.name} ") and "run the same command again to" in last, last
    return last


def test_embedded_default_stops_on_signals_in_any_phase_and_resumes_as_one_run(tmp_path, jax_cache):
    """The embedded default (few SFT/RL steps), as a user runs it: SIGTERM during the SFT warm start ->
    the same command continues the warm start from its checkpoint -> SIGINT (to the process group, as
    Ctrl-C) during RL -> the same command resumes -> kill -9 in mid-RL -> the same command resumes from
    the default's periodic checkpoint (not from step 0) and finishes -> (the export removed, as by a kill
    during it) the same command redoes the export and says the run is complete, quietly. Every signal
    stop: exit 0, no
    traceback, one last line naming what was saved. The finished run reads as one run: metrics and
    TensorBoard hold every step once on a monotonic cumulative clock, summary.json lists the whole
    eval history (warm start -> end) and the three resumes, the final line reports both accuracies."""
    run = str(tmp_path / "run")
    N, T = 120, 12
    args = [f"trainer.sft.steps={N}", f"trainer.total_steps={T}", "data.arithmetic.num_train=400",
            "data.arithmetic.num_eval=16", "eval.every_steps=6"]
    t_start = time.monotonic()

    # 1. SIGTERM part-way through the warm start: its state is checkpointed after the current step
    a = Attempt(run, args, jax_cache, "p1_sigterm_sft", config=None)
    a.wait_for(lambda: _sft_progress(a) >= 20, "20 SFT steps", START_TIMEOUT_S, poll_s=0.05)
    last = _clean_stop(a, a.stop(signal.SIGTERM), signal.SIGTERM)
    m = re.search(rf"warm-start checkpoint {re.escape(run)}/warm_start/checkpoints/(\d+) \(SFT step (\d+) of {N}\) "
                  "is committed", last)
    assert m and m.group(1) == m.group(2), last
    k = int(m.group(1))
    assert 20 <= k < N and _committed(os.path.join(run, "warm_start")) == [k] and not _committed(run)
    assert "trainer.total_steps =" not in a.output()  # quiet: the config goes to config.json, not the console

    # 2. the same command continues the warm start at k + 1, checkpoints its result as step 0; SIGINT in RL
    a = Attempt(run, args, jax_cache, "p2_sigint_rl", config=None)
    a.wait_for(lambda: len(a.trained_steps()) >= 2, "2 RL steps", START_TIMEOUT_S, poll_s=0.05)
    last = _clean_stop(a, a.stop(signal.SIGINT, group=True), signal.SIGINT)
    out = a.output()
    assert f"warm start resumed from {run}/warm_start/checkpoints/{k}: SFT step {k} of {N}" in out
    assert f"SFT warm start: steps {k + 1}..{N} in" in out
    s = json.load(open(os.path.join(run, "summary.json")))["steps"]
    assert last == (f"[jaxrl_async] stopped by SIGINT after step {s}: checkpoint {run}/checkpoints/{s} is committed; "
                    "run the same command again to resume"), last
    assert 2 <= s < 5 and not os.path.exists(os.path.join(run, "warm_start")) and 0 in _committed(run)

    # 3. the same command resumes at s; kill -9 once the default's periodic checkpoint (every 5 steps) is
    #    committed and a later step trained
    a = Attempt(run, args, jax_cache, "p3_kill9_rl", config=None)

    def past_periodic() -> bool:
        c = [x for x in _committed(run) if x >= 5]
        return bool(c) and max(a.trained_steps(), default=0) > c[-1]

    a.wait_for(past_periodic, "a periodic checkpoint and a step after it", START_TIMEOUT_S, poll_s=0.02)
    a.kill9()
    killed_at, resume_at = max(a.trained_steps()), _committed(run)[-1]
    assert f"resumed from {run}/checkpoints/{s}: step {s}" in a.output()
    assert 5 <= resume_at < killed_at < T

    # 4. the same command resumes there (not from step 0) and finishes
    a = Attempt(run, args, jax_cache, "p4_finish", config=None)
    if a.wait(START_TIMEOUT_S + 120) != 0:
        a.fail(f"exit code {a.proc.returncode}")
    out = a.output()
    assert f"resumed from {run}/checkpoints/{resume_at}: step {resume_at}" in out and "Traceback" not in out
    assert min(a.trained_steps()) == resume_at + 1

    summary = json.load(open(os.path.join(run, "summary.json")))
    assert summary["stopped_by"] == "completed" and summary["steps"] == T
    assert [(r["phase"], r["at_step"], r["from_checkpoint"]) for r in summary["resumes"]] == [
        ("warm_start", 0, f"warm_start/checkpoints/{k}"), ("rl", s, f"checkpoints/{s}"),
        ("rl", resume_at, f"checkpoints/{resume_at}")]
    assert [e[0] for e in summary["eval_history"]] == [0, 6, 12]  # the eval a kill dropped is redone
    assert summary["warm_start_accuracy"] == summary["eval_history"][0][2]
    assert summary["final_accuracy"] == summary["eval_history"][-1][2]
    rows = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    assert [r["step"] for r in rows if "train/loss" in r] == list(range(1, T + 1))
    walls = [r["wall_time"] for r in rows]
    assert walls == sorted(walls) and summary["wall_s"] >= walls[-1] > summary["process_wall_s"]
    final = out.rstrip().splitlines()[-1]
    assert final.startswith(f"[jaxrl_async] done: {T} steps in ") and "after the warm start -> " in final, final
    assert f"at step {T}; resumed 3x (warm-start step {k}, step {s}, step {resume_at})" in final, final
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = EventAccumulator(os.path.join(run, "tb"), size_guidance={"tensors": 0})
    tb.Reload()
    events = tb.Tensors("reward/mean")
    assert [e.step for e in events] == list(range(1, T + 1))  # one history (redone steps dropped)
    assert all(x.wall_time <= y.wall_time for x, y in zip(events, events[1:]))
    assert os.path.getsize(os.path.join(run, "curves.png")) > 10_000

    # 5. as if killed during the export: the same command redoes it, says the run is complete, quietly
    import shutil

    shutil.rmtree(os.path.join(run, "hf"))
    json.dump({**summary, "export_dir": None}, open(os.path.join(run, "summary.json"), "w"))
    a = Attempt(run, args, jax_cache, "p5_complete", config=None)
    if a.wait(START_TIMEOUT_S) != 0:
        a.fail(f"exit code {a.proc.returncode}")
    out = a.output()
    assert f"{run} is already complete at step {T}" in out and "trainer.total_steps =" not in out
    assert "Traceback" not in out and len(out.strip().splitlines()) <= 6, out
    assert os.path.isfile(os.path.join(run, "hf", "model.safetensors"))
    assert json.load(open(os.path.join(run, "summary.json")))["export_dir"] == os.path.join(run, "hf")
    print(f"default chain: SFT stop at {k}, SIGINT at {s}, kill at {killed_at} -> resume {resume_at}; "
          f"{time.monotonic() - t_start:.0f} s")
