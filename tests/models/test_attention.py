"""Attention implementations vs the reference (`xla`) in float32: kernel outputs and gradients with
padding, packing (segment ids), GQA and odd lengths; the model's log-probs and parameter gradients;
generator (prefill + paged decode) vs trainer log-prob parity with `blockwise`; the switch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_async.models import load_hf, sequence_logprobs
from jaxrl_async.kernels.attention import (
    BLOCKWISE_MIN_LEN, blockwise_attention, resolve_attention, segment_attention, xla_attention,
)
from jaxrl_async.generator.factory import EngineConfig, build_engine
from jaxrl_async.testing import decode_prompts, make_tiny_hf_model


def _segments(kind: str, B: int, T: int) -> np.ndarray:
    seg = np.zeros((B, T), np.int32)
    if kind == "full":
        seg[:] = 1
    elif kind == "padded":  # right padding of different lengths
        for b in range(B):
            seg[b, : T - 3 * b - 1] = 1
    elif kind == "packed":  # several sequences per row, then padding
        cuts = [0, T // 5, T // 5 + 1, T // 2, T - 4]
        for b in range(B):
            for s, (a, e) in enumerate(zip(cuts[:-1], cuts[1:]), start=1):
                seg[b, a + b: e] = s + b  # rows differ
    return seg


def _qkv(rng, B, T, H, K, E, dtype=jnp.float32):
    q = jnp.asarray(rng.standard_normal((B, T, H, E)), dtype)
    k = jnp.asarray(rng.standard_normal((B, T, K, E)), dtype)
    v = jnp.asarray(rng.standard_normal((B, T, K, E)), dtype)
    return q, k, v


def _rel(a, b):
    return float(jnp.abs(a - b).max() / jnp.maximum(jnp.abs(a).max(), 1e-30))


# every kind x head layout once, over odd lengths, unequal and oversized blocks
@pytest.mark.parametrize("kind,H,K,T,bq,bk", [
    ("full", 4, 4, 37, 8, 8), ("full", 8, 1, 64, 16, 8),
    ("padded", 4, 2, 50, 8, 32), ("padded", 4, 4, 16, 64, 64),
    ("packed", 4, 2, 37, 8, 8), ("packed", 8, 1, 50, 8, 32), ("packed", 4, 4, 64, 16, 8),
])
def test_blockwise_matches_xla_fp32_outputs_and_gradients(kind, H, K, T, bq, bk):
    B, E, scale = 2, 8, 0.3
    rng = np.random.default_rng(T * 100 + H * 10 + K)
    q, k, v = _qkv(rng, B, T, H, K, E)
    seg = jnp.asarray(_segments(kind, B, T))
    live = (seg != 0)[:, :, None, None]
    w = jnp.asarray(rng.standard_normal((B, T, H, E)), jnp.float32) * live  # the loss reads real tokens only

    def loss(f, *a):
        return (f(*a) * w).sum()

    ref = lambda q, k, v: xla_attention(q, k, v, seg, scale)  # noqa: E731
    blk = lambda q, k, v: blockwise_attention(q, k, v, seg, scale, bq, bk)  # noqa: E731
    o_ref, o_blk = jax.jit(ref)(q, k, v), jax.jit(blk)(q, k, v)
    assert _rel(jnp.where(live, o_ref, 0), jnp.where(live, o_blk, 0)) <= 1e-5
    assert float(jnp.abs(jnp.where(live, 0, o_blk)).max()) == 0.0  # padding rows attend nothing
    g_ref = jax.jit(jax.grad(lambda *a: loss(ref, *a), argnums=(0, 1, 2)))(q, k, v)
    g_blk = jax.jit(jax.grad(lambda *a: loss(blk, *a), argnums=(0, 1, 2)))(q, k, v)
    for name, a, b in zip("qkv", g_ref, g_blk):
        assert _rel(a, b) <= 1e-5, (name, _rel(a, b))


def test_blockwise_bf16_close_to_xla_bf16():
    rng = np.random.default_rng(1)
    q, k, v = _qkv(rng, 2, 96, 4, 2, 16, jnp.bfloat16)
    seg = jnp.asarray(_segments("packed", 2, 96))
    live = (seg != 0)[:, :, None, None]
    a = jax.jit(xla_attention, static_argnums=4)(q, k, v, seg, 0.25).astype(jnp.float32)
    b = jax.jit(blockwise_attention, static_argnums=(4, 5, 6))(q, k, v, seg, 0.25, 32, 32).astype(jnp.float32)
    assert float(jnp.abs(jnp.where(live, a - b, 0)).max()) < 3e-2  # bf16 rounding of p and the output


def test_skipped_blocks_do_no_work():
    """Causal and cross-segment block skipping: the key-block range each query block loops over
    (the loop bounds of the forward and backward passes) leaves out every fully masked block."""
    from jaxrl_async.kernels.flash import _block_ranges as ranges
    from jaxrl_async.kernels.flash import run_starts

    def _block_ranges(seg, bq, bk):
        return ranges(run_starts(seg), jnp.arange(seg.shape[1] // bq) * bq, seg.shape[1] // bk, bq, bk)

    T, blk = 64, 8
    seg = jnp.asarray(_segments("full", 1, T))
    lo, hi = _block_ranges(seg, blk, blk)
    assert int((hi - lo + 1).sum()) == 8 * 9 // 2  # causal: the upper triangle is never visited
    seg = np.zeros((1, T), np.int32)
    seg[0, :32], seg[0, 32:] = 1, 2  # two packed sequences of 4 blocks each
    lo, hi = _block_ranges(jnp.asarray(seg), blk, blk)
    assert int((hi - lo + 1).sum()) == 2 * (4 * 5 // 2)  # nothing across segments
    seg[0, 48:] = 0  # padding blocks: no work at all
    lo, hi = _block_ranges(jnp.asarray(seg), blk, blk)
    assert list(np.maximum(np.asarray(hi - lo + 1), 0)[6:]) == [0, 0]
    # a chunk of queries (context parallelism): the second half of a full row sees keys up to its own block
    seg = jnp.ones((1, T), jnp.int32)
    lo, hi = ranges(run_starts(seg)[:, 32:], 32 + jnp.arange(4) * blk, T // blk, blk, blk)
    assert list(np.asarray(lo)) == [0] * 4 and list(np.asarray(hi)) == [4, 5, 6, 7]


def test_switch_resolves_and_validates():
    assert resolve_attention("auto", BLOCKWISE_MIN_LEN - 1) == "xla"
    assert resolve_attention("auto", BLOCKWISE_MIN_LEN) == "blockwise"
    assert resolve_attention("xla", 10 ** 6) == "xla"
    with pytest.raises(ValueError, match="attention must be one of"):
        segment_attention(jnp.ones((1, 4), jnp.int32), 1.0, "flash9")
    from jaxrl_async.models.config import ModelConfig

    with pytest.raises(ValueError, match="ModelConfig.attention"):
        ModelConfig(attention="nope")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("qwen3_attn"))
    make_tiny_hf_model(d, "qwen3")
    cfg, params = load_hf(d)
    return cfg, params


def test_model_logprobs_and_parameter_gradients_match(tiny):
    cfg, params = tiny
    B, T = 3, 40
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(3, 200, (B, T)), jnp.int32)
    seg = jnp.asarray(_segments("packed", B, T))
    positions = jnp.asarray(np.stack([_positions(r) for r in np.asarray(seg)]), jnp.int32)

    def total(p, c):
        lp, _ = sequence_logprobs(p, c, tokens, seg, positions=positions)
        return lp.sum(), lp

    ref_cfg = cfg.replace(attention="xla")
    blk_cfg = cfg.replace(attention="blockwise", attention_block=8)
    vg = jax.jit(jax.value_and_grad(total, has_aux=True), static_argnums=1)
    (_, lp_ref), g_ref = vg(params, ref_cfg)
    (_, lp_blk), g_blk = vg(params, blk_cfg)
    assert float(jnp.abs(lp_ref - lp_blk).max()) <= 1e-5
    worst = max(_rel(a, b) for a, b in zip(jax.tree.leaves(g_ref), jax.tree.leaves(g_blk)))
    assert worst <= 1e-5, worst


def _positions(seg_row: np.ndarray) -> np.ndarray:
    pos = np.zeros_like(seg_row)
    for t in range(1, len(seg_row)):
        pos[t] = pos[t - 1] + 1 if seg_row[t] == seg_row[t - 1] else 0
    return pos


def test_generator_vs_trainer_logprob_parity_with_blockwise(tiny):
    """Prefill through `blockwise` (several blocks per prompt), paged decode, and the trainer's
    `sequence_logprobs` through `blockwise`: behaviour log-probs equal within 1e-5 (fp32)."""
    cfg, params = tiny
    cfg = cfg.replace(attention="blockwise", attention_block=8)
    engine = build_engine(EngineConfig(max_concurrent_decodes=4, max_sequence_length=64, prefill_buckets=(32,),
                                       page_size=8, num_pages=64), cfg)
    p = engine.place_params(params)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, 200, n).tolist() for n in (5, 17, 29)]
    outs = decode_prompts(engine, p, prompts, temperature=0.8, max_new_tokens=12)
    for slot, prompt in enumerate(prompts):
        gen, lps = outs[slot]
        seq = np.zeros((1, 64), np.int32)
        segs = np.zeros((1, 64), np.int32)
        n = len(prompt) + len(gen)
        seq[0, :n], segs[0, :n] = prompt + gen, 1
        ref, _ = sequence_logprobs(params, cfg, jnp.asarray(seq), jnp.asarray(segs), temperature=0.8)
        diff = np.abs(np.asarray(ref)[0, len(prompt):n] - np.asarray(lps)).max()
        assert diff <= 1e-5, (slot, diff)


# ---------------------------------------------------------------------------------------
# The accelerator kernels (splash: Pallas TPU, gpu_flash: Pallas-Triton) in Pallas interpret mode on CPU;
# their compiles for the real targets are tests/aot (own CI environment)
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("impl", ["splash", "gpu_flash"])
def test_accelerator_kernels_match_xla_in_interpret_mode(impl):
    from jaxrl_async.kernels.attention_pallas import gpu_flash_attention, splash_attention

    kernel = splash_attention if impl == "splash" else gpu_flash_attention
    B, T, H, K, E = 2, 50, 4, 2, 32
    rng = np.random.default_rng(5)
    q, k, v = _qkv(rng, B, T, H, K, E)
    seg = jnp.asarray(_segments("packed", B, T))
    live = (seg != 0)[:, :, None, None]
    w = jnp.asarray(rng.standard_normal((B, T, H, E)), jnp.float32) * live
    ref = lambda q, k, v: xla_attention(q, k, v, seg, 0.1)  # noqa: E731
    ker = lambda q, k, v: kernel(q, k, v, seg, 0.1, block=16)  # noqa: E731
    assert _rel(jnp.where(live, jax.jit(ref)(q, k, v), 0), jnp.where(live, jax.jit(ker)(q, k, v), 0)) <= 1e-5
    g_ref = jax.jit(jax.grad(lambda *a: (ref(*a) * w).sum(), argnums=(0, 1, 2)))(q, k, v)
    g_ker = jax.jit(jax.grad(lambda *a: (ker(*a) * w).sum(), argnums=(0, 1, 2)))(q, k, v)
    for name, a, b in zip("qkv", g_ref, g_ker):
        assert _rel(a, b) <= 1e-5, (impl, name, _rel(a, b))


@pytest.mark.parametrize("shape", [(2, 2), (1, 4)])  # (1, 4): 2 kv heads cannot split over tensor = 4
def test_accelerator_kernels_under_the_trainer_mesh(shape):
    from jaxrl_async.kernels.attention_pallas import gpu_flash_attention, splash_attention
    from jaxrl_async.sharding import make_mesh
    from jaxrl_async.sharding.activations import activation_rules

    mesh = make_mesh(shape, ("fsdp", "tensor"), devices=jax.devices()[:4])
    rng = np.random.default_rng(6)
    q, k, v = _qkv(rng, 2, 40, 4, 2, 32)
    seg = jnp.asarray(_segments("packed", 2, 40))
    live = (seg != 0)[:, :, None, None]
    ref = xla_attention(q, k, v, seg, 0.1)
    for kernel in (splash_attention, gpu_flash_attention):
        def run(q, k, v, kernel=kernel):
            with activation_rules(mesh, "trainer"):
                return kernel(q, k, v, seg, 0.1, block=16)

        assert _rel(jnp.where(live, ref, 0), jnp.where(live, jax.jit(run)(q, k, v), 0)) <= 1e-5


def _trajectories(seed: int):
    """Eight RL trajectories of 20-64 tokens (5-token prompts masked out) for the train-step comparisons."""
    from jaxrl_async.trainer.packing import TrainSequence

    rng = np.random.default_rng(seed)
    trajs = []
    for n in (60, 45, 30, 64, 20, 50, 33, 41):
        m = np.r_[np.zeros(5), np.ones(n - 5)].astype(np.int32)
        trajs.append(TrainSequence(tokens=rng.integers(3, 200, n).astype(np.int32), loss_mask=m,
                                behaviour_logprobs=(-rng.random(n) * m).astype(np.float32),
                                advantages=(rng.standard_normal(n) * m).astype(np.float32)))
    return trajs


def test_blockwise_train_step_on_a_sharded_mesh_matches_xla():
    """The trainer's step with `blockwise` on an fsdp x tensor mesh (GSPMD partitions its data-dependent
    block loops) gives xla's update: loss, grad norm, parameters."""
    from jaxrl_async.models.config import ModelConfig
    from jaxrl_async.models.transformer import init_params
    from jaxrl_async.sharding import make_mesh
    from jaxrl_async.trainer.packing import PackingConfig
    from jaxrl_async.trainer.train_step import Trainer, TrainStepConfig

    trajs = _trajectories(seed=0)
    mesh = make_mesh({"fsdp": 2, "tensor": 2}, devices=jax.devices()[:4])
    out = {}
    for impl in ("xla", "blockwise"):
        cfg = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                          num_kv_heads=2, head_dim=16, attention=impl, attention_block=16)
        tr = Trainer(cfg, TrainStepConfig(packing=PackingConfig(tokens_per_micro=4 * 128, row_len_buckets=(128,))),
                     mesh=mesh)
        state, m = tr.train_batch(tr.init_state(jax.device_get(init_params(cfg, jax.random.key(0)))), trajs)
        out[impl] = (float(m[0]["loss"]), float(m[0]["grad_norm"]), jax.device_get(state.params))
    assert out["blockwise"][0] == pytest.approx(out["xla"][0], rel=1e-5)
    assert out["blockwise"][1] == pytest.approx(out["xla"][1], rel=1e-5)
    for a, b in zip(jax.tree.leaves(out["xla"][2]), jax.tree.leaves(out["blockwise"][2])):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------------------------------
# Context (sequence) parallelism: rows split over the trainer mesh's `context` axis
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("impl,shape,T,block", [
    ("blockwise", {"fsdp": 2, "context": 2}, 64, 8),
    ("blockwise", {"context": 4}, 96, 16),  # 8 stripes of 12 queries: padded to block multiples locally
    ("blockwise", {"context": 4}, 100, 16),  # chunks of 25: no even split into stripes, contiguous chunks
    ("blockwise", {"context": 2, "tensor": 2}, 64, 16),  # 2 kv heads split over tensor like the query heads
    ("splash", {"fsdp": 2, "context": 2}, 256, 128),  # Pallas interpret mode; mask info split over context
])
def test_context_parallel_attention_matches_xla(impl, shape, T, block):
    """Each device attends its chunk of queries to the all-gathered row: outputs and the gradients of q,
    k, v (dK/dV come back by reduce-scatter) equal the reference on the whole rows, with packing and
    padding across chunk boundaries, GQA."""
    from jaxrl_async.kernels.attention_pallas import context_shards
    from jaxrl_async.sharding import make_mesh
    from jaxrl_async.sharding.activations import activation_rules

    mesh = make_mesh(shape, devices=jax.devices()[: int(np.prod(list(shape.values())))])
    B, H, K, E = 2, 4, 2, 16
    rng = np.random.default_rng(7)
    q, k, v = _qkv(rng, B, T, H, K, E)
    seg = _segments("packed", B, T)
    seg[1, T // 2 - 3: T // 2 + 5] = 9  # a sequence across the middle chunk boundary
    seg = jnp.asarray(seg)
    live = (seg != 0)[:, :, None, None]
    w = jnp.asarray(rng.standard_normal((B, T, H, E)), jnp.float32) * live

    def cp(q, k, v):
        with activation_rules(mesh, "trainer"):  # as in the model: the attention is chosen while tracing
            assert context_shards(T) == mesh.shape["context"]
            return segment_attention(seg, 0.1, impl, block)(q, k, v, 0, None)[0]

    ref = lambda q, k, v: xla_attention(q, k, v, seg, 0.1)  # noqa: E731
    assert _rel(jnp.where(live, jax.jit(ref)(q, k, v), 0), jnp.where(live, jax.jit(cp)(q, k, v), 0)) <= 1e-5
    g_ref = jax.jit(jax.grad(lambda *a: (ref(*a) * w).sum(), argnums=(0, 1, 2)))(q, k, v)
    g_cp = jax.jit(jax.grad(lambda *a: (cp(*a) * w).sum(), argnums=(0, 1, 2)))(q, k, v)
    for name, a, b in zip("qkv", g_ref, g_cp):
        assert _rel(a, b) <= 1e-5, (impl, name, _rel(a, b))
    hlo = jax.jit(cp).lower(q, k, v).as_text()
    assert "all_gather" in hlo or "all-gather" in hlo  # K/V gathered over context, not the T x T reference
    balanced = impl == "blockwise" and (T // mesh.shape["context"]) % 2 == 0
    assert ("collective_permute" in hlo) == balanced  # load balance: query stripes exchanged


def test_context_parallel_load_balance_evens_the_causal_work():
    """Stripes d and 2C-1-d per device: every stripe is computed once, and the key blocks each device visits
    (the block loops' trip counts) are equal, where contiguous chunks give the last device 2C-1 times the
    first's."""
    from jaxrl_async.kernels.flash import _block_ranges, run_starts
    from jaxrl_async.kernels.attention_pallas import _balanced_pair

    T, C, blk = 1024, 4, 16
    starts = run_starts(jnp.ones((1, T), jnp.int32))
    Ts, Tl = T // (2 * C), T // C

    def work(first, n):
        lo, hi = _block_ranges(starts[:, first:first + n], first + jnp.arange(n // blk) * blk, T // blk, blk, blk)
        return int(np.maximum(np.asarray(hi - lo + 1), 0).sum())

    pairs = [_balanced_pair(d, C) for d in range(C)]
    assert sorted(s for p in pairs for s in p) == list(range(2 * C))
    assert all(e % 2 == 0 and o % 2 == 1 for e, o in pairs)
    contiguous = [work(d * Tl, Tl) for d in range(C)]
    balanced = [work(e * Ts, Ts) + work(o * Ts, Ts) for e, o in pairs]
    assert max(balanced) == min(balanced) and sum(balanced) == sum(contiguous)
    assert max(contiguous) / min(contiguous) > 2 * C - 2, contiguous


def test_context_parallel_train_step_matches_one_device(monkeypatch):
    """The trainer's step on an fsdp x context mesh (rows split in two, weights sharded over both axes)
    gives the single-device update: loss, grad norm, parameters."""
    from jaxrl_async.kernels import attention_pallas as attention_kernels
    from jaxrl_async.models.config import ModelConfig
    from jaxrl_async.models.transformer import init_params
    from jaxrl_async.sharding import make_mesh
    from jaxrl_async.trainer.packing import PackingConfig
    from jaxrl_async.trainer.train_step import Trainer, TrainStepConfig

    trajs = _trajectories(seed=1)
    cfg = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, attention="blockwise", attention_block=16)
    init = jax.device_get(init_params(cfg, jax.random.key(0)))
    calls = []
    real = attention_kernels.context_parallel_attention
    monkeypatch.setattr(attention_kernels, "context_parallel_attention",
                        lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    out = {}
    for name, mesh in (("one", make_mesh({"fsdp": 1}, devices=jax.devices()[:1])),
                       ("cp", make_mesh({"fsdp": 2, "context": 2}, devices=jax.devices()[:4]))):
        tr = Trainer(cfg, TrainStepConfig(packing=PackingConfig(tokens_per_micro=4 * 128, row_len_buckets=(128,))),
                     mesh=mesh)
        state, m = tr.train_batch(tr.init_state(init), trajs)
        assert bool(calls) == (name == "cp")
        out[name] = (float(m[0]["loss"]), float(m[0]["grad_norm"]), jax.device_get(state.params))
        if name == "cp":
            assert calls and set(calls) == {"blockwise"}  # the model's attention ran context-parallel
            spec = state.params["layers"]["q"].sharding.spec
            assert "context" in str(spec) and "fsdp" in str(spec), spec  # weights over fsdp x context
    assert out["cp"][0] == pytest.approx(out["one"][0], rel=1e-5)
    assert out["cp"][1] == pytest.approx(out["one"][1], rel=1e-5)
    for a, b in zip(jax.tree.leaves(out["one"][2]), jax.tree.leaves(out["cp"][2])):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-7)
