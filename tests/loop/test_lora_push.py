"""LoRA weight pushes: only the adapter bytes travel, the generator's base is placed once, and after several
trainer updates the generator's behaviour log-probs equal the trainer's (fp32, <= 1e-5) for both decode
strategies (adapters unmerged in the layer code, or merged into a generator-side copy of the weights)."""
from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_async.models import lora
from jaxrl_async.models.config import ModelConfig
from jaxrl_async.models.transformer import init_params, sequence_logprobs
from jaxrl_async.rl.losses import PolicyLossConfig
from jaxrl_async.generator.factory import EngineConfig, build_engine
from jaxrl_async.generator.engine_api import SamplingParams
from jaxrl_async.models.shardings import model_shardings
from jaxrl_async.sharding import make_mesh
from jaxrl_async.trainer import OptimizerConfig, PackingConfig, Trainer, TrainStepConfig, TrainSequence
from jaxrl_async.generator.weight_sync import LoraPush, WeightPusher, tree_bytes

BASE = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=8, rope_theta=10000.0, attention="xla")
SPEC = lora.LoraSpec(rank=4, alpha=8.0)
CFG = BASE.replace(lora=SPEC)
# a mixture of experts with adapters on attention and on every expert's gate/up/down (models/lora.py)
MOE_BASE = BASE.replace(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
FAMILIES = {"dense": (BASE, CFG), "moe": (MOE_BASE, MOE_BASE.replace(lora=SPEC))}
ROW = 32
PACK = PackingConfig(tokens_per_micro=8 * ROW, row_len_buckets=(ROW,), max_seqs_per_row=4)
MAX_NEW = 10


class RecordingGenerator:
    def __init__(self):
        self.updates = []
        self.lock = threading.Lock()

    def update_params(self, params, version, wait=True, timeout=None):
        with self.lock:
            self.updates.append((params, version))


def _trajs(seed, n=8):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        L, p = int(rng.integers(8, ROW + 1)), int(rng.integers(2, 5))
        mask = (np.arange(L) >= p).astype(np.int32)
        out.append(TrainSequence(tokens=rng.integers(0, BASE.vocab_size, L), loss_mask=mask,
                              behaviour_logprobs=np.where(mask > 0, -rng.uniform(2.0, 5.0, L), 0.0),
                              advantages=np.where(mask > 0, rng.normal(size=L), 0.0), versions=np.where(mask > 0, 0, -1)))
    return out


def _generate(engine, params, prompts, temperature=1.0):
    """Every prompt in its own slot, sampled to MAX_NEW tokens: (tokens, behaviour log-probs) per prompt."""
    state = engine.init_decode_state()
    toks, lps = [[] for _ in prompts], [[] for _ in prompts]
    for i, p in enumerate(prompts):
        pre = engine.prefill(params, p, SamplingParams(temperature=temperature, max_new_tokens=MAX_NEW, seed=i))
        state = engine.insert(pre, state, i)
        toks[i].append(int(pre.first_tokens[0]))
        lps[i].append(float(pre.first_logprobs[0]))
    live = set(range(len(prompts)))
    while live:
        state, step = engine.generate(params, state)
        step = step.to_host()
        for i in list(live):
            if step.valid[i]:
                toks[i].append(int(step.tokens[i]))
                lps[i].append(float(step.logprobs[i]))
            if step.done[i]:
                state = engine.release(state, i)
                live.discard(i)
    return toks, lps


# slow variants: (unmerged, dense): the unmerged push path (base placed once, never re-sent, adapter bytes only,
# parity after updates) is the (unmerged, moe) case's, which adapts the attention too; the dense MLP adapters
# decoded unmerged are checked after updates, with adapter-only push bytes, by the default
# tests/distributed/test_multiprocess_lora.py::test_generator_process_lora_unmerged_parity_push_bytes_and_resume
# (merged, moe): the merge of expert adapters is checked in tests/models/test_moe_lora.py
@pytest.mark.parametrize("decode,family", [pytest.param("unmerged", "dense", marks=pytest.mark.slow),
                                           ("merged", "dense"), ("unmerged", "moe"),
                                           pytest.param("merged", "moe", marks=pytest.mark.slow)])
def test_adapter_only_push_and_generator_trainer_parity_after_updates(decode, family):
    BASE, CFG = FAMILIES[family]
    d = jax.devices()
    tmesh = make_mesh({"fsdp": 2, "tensor": 2}, devices=d[4:8])
    gmesh = make_mesh({"data": 2, "tensor": 2}, devices=d[:4])
    opt = OptimizerConfig(lr=5e-2, weight_decay=0.0, max_grad_norm=None)
    trainer = Trainer(CFG, TrainStepConfig(optimizer=opt, packing=PACK, proximal="given"), mesh=tmesh,
                      loss_cfg=PolicyLossConfig())
    state = trainer.init_state(init_params(CFG, jax.random.key(0), 0.1))
    # the generator: an engine of the LoRA config (unmerged) or of the base config (merged weights)
    engine = build_engine(EngineConfig(max_concurrent_decodes=4, max_sequence_length=64, prefill_buckets=(16,),
                                       page_size=8, num_pages=40), CFG if decode == "unmerged" else BASE, gmesh)
    adapters0, base0 = lora.split(state.params)
    adapters0 = jax.device_get(adapters0)  # the step donates the state
    gen_shardings = model_shardings(CFG, gmesh, "generator")
    gen_base = jax.device_put(base0, lora.split(gen_shardings)[1], may_alias=False)  # placed once
    gen = RecordingGenerator()
    pusher = WeightPusher(gen, gen_shardings, dtype=jnp.float32, guard=True,
                          lora=LoraPush(SPEC, gen_base, decode=decode))
    try:
        for version in (1, 2, 3):
            traj = _trajs(version)
            for t in traj:
                t.proximal_logprobs = t.behaviour_logprobs
            state, m = trainer.step(state, trainer.pack(traj), policy_version=version - 1)
            assert int(m["skipped"]) == 0
            stats = pusher.push(state.params, version)
            # only adapter bytes travel: the base is 8x larger here (3.9x the tiny MoE), 200x for 8B at rank 32
            assert stats.bytes == tree_bytes(lora.split(state.params)[0])
            assert stats.bytes < tree_bytes(base0) / 3  # (dense: 1/8; tiny MoE rank 4: 1/3.9)
            pusher.wait(version, timeout=120)
    finally:
        pusher.close()
    assert [v for _, v in gen.updates] == [1, 2, 3]
    gen_params = gen.updates[-1][0]
    if decode == "unmerged":  # the base leaves are the generator's own copy, never re-sent
        for _, base_k in (lora.split(p) for p, _ in gen.updates):
            assert all(a is b for a, b in zip(jax.tree.leaves(base_k), jax.tree.leaves(gen_base)))
    else:
        assert not lora.has_adapters(gen_params)
        assert {dv.id for dv in gen_params["layers"]["q"].devices()} == {dv.id for dv in gmesh.devices.flat}
    adapters3, base3 = lora.split(state.params)
    assert max(float(jnp.abs(a - b).max()) for a, b in zip(jax.tree.leaves(adapters0),
                                                           jax.tree.leaves(adapters3))) > 1e-2  # it learned
    if family == "moe":  # the expert adapters trained too (B left zero)
        assert float(jnp.abs(adapters3["layers"]["moe_down_lora_b"]).max()) > 1e-3
        assert float(jnp.abs(adapters3["layers"]["moe_gate_up_lora_b"]).max()) > 1e-3
    # the generator's behaviour log-probs are the trainer's at the pushed version
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, BASE.vocab_size, int(rng.integers(3, 12))).tolist() for _ in range(4)]
    toks, lps = _generate(engine, gen_params, prompts)
    worst = 0.0
    for p, t, lp in zip(prompts, toks, lps):
        seq = np.zeros((1, 64), np.int32)
        seg = np.zeros((1, 64), np.int32)
        seq[0, :len(p) + len(t)] = p + t
        seg[0, :len(p) + len(t)] = 1
        ref, _ = jax.jit(sequence_logprobs, static_argnums=1)(jax.device_get(state.params), CFG, jnp.asarray(seq),
                                                              jnp.asarray(seg))
        worst = max(worst, float(np.abs(np.asarray(ref)[0, len(p):len(p) + len(t)] - np.asarray(lp)).max()))
        # and they are not the base model's: the adapters are applied
        base_ref, _ = jax.jit(sequence_logprobs, static_argnums=1)(jax.device_get(base3), BASE, jnp.asarray(seq),
                                                                   jnp.asarray(seg))
        assert np.abs(np.asarray(base_ref)[0, len(p):len(p) + len(t)] - np.asarray(lp)).max() > 1e-3
    print(f"generator vs trainer log-probs ({family}, {decode}): max abs {worst:.2e}")
    assert worst <= 1e-5, worst


def test_engine_sizing_reserves_room_for_the_adapters_only(monkeypatch):
    """An RL engine keeps KV room for an incoming push: with unmerged LoRA a push brings the adapters."""
    from jaxrl_async.generator import kv_cache

    mesh = make_mesh({"data": 1, "tensor": 1}, devices=jax.devices()[:1])
    monkeypatch.setattr(kv_cache, "device_memory", lambda devices: (64 << 20, 1 << 20, "memory_stats"))
    sizes = {}
    for name, cfg in (("full", BASE), ("lora", CFG)):
        eng = build_engine(EngineConfig(max_concurrent_decodes=8, max_sequence_length=64, prefill_buckets=(16,),
                                        page_size=8, cache_memory_fraction=0.5), cfg, mesh, reserve_weight_push=True)
        sizes[name] = eng.sizing
    adapters = sum(x.size * 4 for x in jax.tree.leaves(lora.split(init_params(CFG, jax.random.key(0)))[0]))
    assert sizes["full"].incoming_weight_bytes == sizes["full"].param_bytes
    assert sizes["lora"].param_bytes == sizes["full"].param_bytes + adapters
    assert sizes["lora"].incoming_weight_bytes == adapters
