"""LoRA with a generator process (distributed/lora_remote.py): the generator builds the frozen base itself
(the same init seed as the trainer), its fingerprint is checked against the trainer's at the handshake, and
every push crosses processes with the adapter leaves only (the transfer's own byte counters, trainer and
generator side). At eta = 0 the generator's behaviour log-probs equal the trainer's recomputed ones
(<= 1e-5, fp32) at every step, i.e. after several adapter updates, for both decode strategies (unmerged:
base + adapters in the layer code, base from the init seed; merged: W + s A B on the generator, base read
from model.path and stored in bfloat16 by the trainer). The unmerged run is then resumed
from its step-2 checkpoint ("crashed" copy) and reaches the uninterrupted run's state bit for bit.
A base only the trainer has (SFT warm start) travels once with the initial push. The same with a trainer
group of two processes. A base that differs from the trainer's is refused with one line naming the
generator and the leaf."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from jaxrl_async.checkpoint import HOST, Checkpointer
from jaxrl_async.distributed.launch import reserve_port
from jaxrl_async.data.ledger import read_data_ledger
from lora_checks import assert_adapter_only_training  # tests
from role_procs import kill_all, role_env, wait_or_kill  # tests/distributed

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
TINY = os.path.join(os.path.dirname(HERE), "loop", "tiny_config.py")
LORA = ["model.lora.rank=4", "model.lora.alpha=8.0", "rollout.max_head_offpolicyness=0", "trainer.total_steps=4",
        "checkpoint.every_steps=2", "checkpoint.keep_last=3"]


def _run(run_dir, log_dir, name, extra_cfg=(), extra_gen=()):
    """Controller (trainer on 2 CPU devices, fsdp) + one generator process (1 CPU device); both exit."""
    port, env = reserve_port(), role_env(log_dir / "jax_cache")
    addr = f"127.0.0.1:{port}"
    ctrl_log, gen_log = open(log_dir / f"{name}.controller.log", "wb"), open(log_dir / f"{name}.generator.log", "wb")
    ctrl = subprocess.Popen([sys.executable, "-m", "jaxrl_async.distributed.controller", "--listen", addr,
                             "--listen-reuse-port", "--generator-devices", "1", "--cpu-devices", "2",
                             "--accept-timeout", "120", "--heartbeat-timeout", "30", "--config", TINY,
                             f"run_dir={run_dir}", *LORA, *extra_cfg],
                            cwd=ROOT, env=env, stdout=ctrl_log, stderr=subprocess.STDOUT)
    gen = subprocess.Popen([sys.executable, "-m", "jaxrl_async.distributed.generator_role", "--controller", addr,
                            "--name", "generator-0", "--cpu-devices", "1", *extra_gen],
                           cwd=ROOT, env=env, stdout=gen_log, stderr=subprocess.STDOUT)
    try:
        rc = wait_or_kill(ctrl, 300)
        wait_or_kill(gen, 60)
    finally:
        kill_all([ctrl, gen])
    log = (log_dir / f"{name}.controller.log").read_text()
    assert rc == 0, log[-3000:]
    return log


def _run_group(run_dir, log_dir, name, extra_cfg=()):
    """A trainer group of 2 processes (1 CPU device each, fsdp over the processes) + one generator process."""
    env = role_env(log_dir / "jax_cache")
    addr, coord = f"127.0.0.1:{reserve_port()}", f"127.0.0.1:{reserve_port()}"
    procs = []
    for i in range(2):
        log = open(log_dir / f"{name}.trainer{i}.log", "wb")
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "jaxrl_async.distributed.controller", "--listen", addr, "--listen-reuse-port",
             "--generator-devices", "1", "--cpu-devices", "1", "--accept-timeout", "120", "--heartbeat-timeout", "30",
             "--jax-heartbeat-timeout", "20", "--coordinator", coord, "--num-processes", "2", "--process-id", str(i),
             "--config", TINY, f"run_dir={run_dir}", *LORA, *extra_cfg],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
    log = open(log_dir / f"{name}.generator.log", "wb")
    procs.append(subprocess.Popen([sys.executable, "-m", "jaxrl_async.distributed.generator_role", "--controller",
                                   addr, "--name", "generator-0", "--cpu-devices", "1"],
                                  cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
    try:
        rcs = [wait_or_kill(p, 300 if k == 0 else 60) for k, p in enumerate(procs)]
    finally:
        kill_all(procs)
    log = (log_dir / f"{name}.trainer0.log").read_text()
    assert rcs == [0, 0, 0], (rcs, log[-3000:], (log_dir / f"{name}.trainer1.log").read_text()[-2000:])
    return log


def _state(run_dir, step):
    import jax

    r = Checkpointer(str(run_dir), read_only=True).restore(step, targets={"params": HOST, "opt_state": HOST})
    return [(jax.tree_util.keystr(p), np.asarray(x)) for p, x in jax.tree_util.tree_flatten_with_path(r.arrays)[0]]


def _check_run(run_dir, log, base_bytes=None, first_push="adapters", disk=(), n_adapters=14):
    """``base_bytes``: the base's fp32 size when the checkpoint does not hold it (LoRA on model.path);
    ``first_push="full"``: the initial push carried the base too (a base only the trainer has); ``disk``:
    versions whose pull was corrupted on purpose (recovered from the disk fallback)."""
    state = dict(_state(run_dir, 4))
    adapters = {k: x for k, x in state.items() if k.startswith("['params']") and "_lora_" in k}
    base = {k: x for k, x in state.items() if k.startswith("['params']") and "_lora_" not in k}
    assert len(adapters) == n_adapters and (base or base_bytes)
    adapter_bytes = sum(x.nbytes for x in adapters.values())  # fp32 = the generator dtype of the tiny run
    assert adapter_bytes < (base_bytes or sum(x.nbytes for x in base.values())) / 2
    assert "later pushes carry the adapters only" in log if first_push == "full" else "fingerprints of" in log
    # every push carried exactly the adapter bytes, counted on both sides (the initial one too, unless the
    # base had to travel with it)
    pushes = [json.loads(line) for line in (run_dir / "weight_push.jsonl").read_text().splitlines()]
    assert sorted({p["version"] for p in pushes}) == [0, 1, 2, 3, 4], pushes  # eta = 0: none skipped
    for p in pushes:
        g = p["generators"][0]
        assert p["transport"] == ("disk" if p["version"] in disk else "transfer") and g["checksums_match"], p
        want = adapter_bytes + sum(x.nbytes for x in base.values()) if first_push == "full" and p["version"] == 0 \
            else adapter_bytes
        assert p["bytes"] == want and g["bytes"] == want, (p["version"], p["bytes"], g["bytes"], want)
        assert len(p["checksums"]) == (n_adapters + len(base) if want != adapter_bytes else n_adapters)
    # on-policy parity after updates: behaviour log-probs (generator) == recomputed (trainer), every step
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    gaps = [r["train/behave_prox_abs_max"] for r in rows]
    assert max(gaps) <= 1e-5, gaps
    # not vacuous: the adapters moved (B starts at 0), so steps 2-4 sampled from adapted policies
    assert all(np.abs(x).max() > 0 for k, x in adapters.items() if k.endswith("_lora_b']"))
    return state


def test_generator_process_lora_unmerged_parity_push_bytes_and_resume(tmp_path):
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    log = _run(whole, tmp_path, "whole")
    _check_run(whole, log)
    # crash after step 2 (copy without the later checkpoint) and resume: bit for bit the uninterrupted run
    shutil.copytree(whole, resumed, ignore=shutil.ignore_patterns("4", "summary.json"))
    _run(resumed, tmp_path, "resumed")
    assert [r["step"] for r in read_data_ledger(str(resumed)).resumes] == [2]
    a, b = _state(whole, 4), _state(resumed, 4)
    assert [k for k, _ in a] == [k for k, _ in b]
    for (k, x), (_, y) in zip(a, b):
        assert x.dtype == y.dtype and x.tobytes() == y.tobytes(), k
    draws = [[(e["step"], e["draws"], e["lags"]) for e in read_data_ledger(str(d)).events("consume")]
             for d in (whole, resumed)]
    assert draws[0] == draws[1]
    # between the checkpoints the base stayed frozen, the adapters trained, and the checkpointed optimizer
    # state is the adapters' only (also the colocated run's, tests/loop/test_lora_resume.py, slow)
    assert_adapter_only_training(dict(a), dict(_state(whole, 2)))


@pytest.mark.slow  # a variant of the unmerged test above: run with -m slow
def test_generator_process_moe_expert_lora_parity_and_push_bytes(tmp_path):
    """A Qwen3-MoE run with adapters on attention and every expert (models/lora.py): the generator process
    builds the base itself, every push is the adapter bytes on both sides, behaviour == recomputed log-probs."""
    moe = ["model.model_type=qwen3_moe", "model.num_experts=4", "model.num_experts_per_tok=2",
           "model.moe_intermediate_size=32"]
    run = tmp_path / "moe"
    state = _check_run(run, _run(run, tmp_path, "moe", moe), n_adapters=12)  # q/k/v/o pairs + 2 expert pairs
    assert {k for k in state if "moe_" in k and "_lora_" in k and k.startswith("['params']")} == {
        f"['params']['layers']['moe_{g}_lora_{x}']" for g in ("gate_up", "down") for x in "ab"}


@pytest.mark.slow  # a variant of the unmerged test above (~25-40 s): run with -m slow
def test_generator_process_lora_merged_on_model_path_bf16_base(tmp_path):
    """merged decode; the base read from model.path by both processes and stored in bfloat16 by the trainer
    (the generator casts along the same chain: the fingerprints agree)."""
    import jax

    from jaxrl_async.models import load_hf
    from jaxrl_async.testing import make_tiny_hf_model, make_tiny_tokenizer

    base_dir = make_tiny_hf_model(str(tmp_path / "base"), "qwen3", seed=4)
    make_tiny_tokenizer(base_dir)
    base_bytes = sum(x.nbytes for x in jax.tree.leaves(load_hf(base_dir)[1]))
    run = tmp_path / "run"
    log = _run(run, tmp_path, "merged", ["model.lora.decode=merged", "model.lora.base_dtype=bfloat16",
                                         f"model.path={base_dir}", "data.apply_chat_template=false"])
    assert "built the base (path;" in log
    gen_log = (tmp_path / "merged.generator.log").read_text()
    assert f"LoRA base from {os.path.abspath(base_dir)}" in gen_log and "(merged decode)" in gen_log
    _check_run(run, log, base_bytes=base_bytes)


@pytest.mark.slow  # a variant of the unmerged test above (~25-40 s): run with -m slow
def test_generator_process_lora_warm_started_base_travels_once(tmp_path):
    """An SFT warm start trains the base in the trainer (no generator can rebuild it): the initial push
    carries base + adapters once (checksummed), every later push the adapters only (also through the disk
    fallback)."""
    run = tmp_path / "run"
    log = _run(run, tmp_path, "sft", ["trainer.sft.steps=3", "trainer.sft.warmup_steps=0"],
               extra_gen=("--inject-corrupt-pull", "2"))
    assert "sent once with the initial push" in log
    # version 2's adapters are corrupted after the pull: caught by the checksum, recovered from disk
    _check_run(run, log, first_push="full", disk=(2,))


@pytest.mark.slow  # a variant of the unmerged test above (~25-40 s): run with -m slow
def test_trainer_group_lora_adapter_pushes_from_both_processes(tmp_path):
    """LoRA on model.path with a trainer group of 2 processes: both read the base onto their shards and place
    the adapters without a collective, the base fingerprint is a collective of both, each process registers
    the adapter shards it owns; parity <= 1e-5 after every update, pushes = adapter bytes, the checkpoints
    refer to the base."""
    import jax

    from jaxrl_async.models import load_hf
    from jaxrl_async.testing import make_tiny_hf_model, make_tiny_tokenizer

    base_dir = make_tiny_hf_model(str(tmp_path / "base"), "qwen3", seed=5)
    make_tiny_tokenizer(base_dir)
    run = tmp_path / "run"
    log = _run_group(run, tmp_path, "group", [f"model.path={base_dir}", "data.apply_chat_template=false"])
    assert "trainer group: 2 processes" in log and "built the base (path;" in log
    _check_run(run, log, base_bytes=sum(x.nbytes for x in jax.tree.leaves(load_hf(base_dir)[1])))
    pushes = [json.loads(line) for line in (run / "weight_push.jsonl").read_text().splitlines()]
    assert all(p["trainer_processes"] == 2 and p["generators"][0]["sources"] == 2 for p in pushes), pushes


def test_generator_base_that_differs_from_the_trainers_is_refused():
    import jax

    from jaxrl_async.distributed.lora_remote import LoraBaseMismatch, check_base
    from jaxrl_async.distributed.transfer import checksum_fn, tree_keys
    from jaxrl_async.models import lora
    from jaxrl_async.models.config import ModelConfig
    from jaxrl_async.models.transformer import init_params

    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=1, num_heads=2, num_kv_heads=1,
                      head_dim=16, lora=lora.LoraSpec(rank=4))
    base = lora.split(init_params(cfg, jax.random.key(0)))[1]
    other = jax.tree.map(lambda x: x, base)
    other["layers"] = {**base["layers"], "down": base["layers"]["down"].at[0, 0, 0].add(1e-6)}
    keys, sums = tree_keys(base), checksum_fn(jax.tree.leaves(base))
    check_base("generator-0", keys, sums, {"keys": keys, "checksums": sums, "source": "x"})  # equal: accepted
    got = {"keys": tree_keys(other), "checksums": checksum_fn(jax.tree.leaves(other)), "source": "/models/b"}
    with pytest.raises(LoraBaseMismatch, match=r"^model\.lora: the base generator-0 built from /models/b differs "
                                               r"from the trainer's in 1 of \d+ leaves \(first: \['layers'\]\['down'\]\)"):
        check_base("generator-0", keys, sums, got)
