"""Activation sharding constraints (`jaxrl_async.sharding.activations`) on 8 simulated CPU devices.

* `constrain` is a no-op without rules and on a one-device mesh (the traced program is unchanged);
  an unknown logical name is an error; contexts nest and reset.
* Sharded == unsharded: forward logits and `sequence_logprobs` (log-probs, entropies and their
  gradient, several vocabulary chunks) under the trainer rules on fsdp 8 and fsdp 4 x tensor 2 agree
  with the single-device computation in fp32.
* The trainer's compiled step keeps the activations batch-sharded: the per-device MLP intermediate
  is the local batch, not the global one, and the step's temporaries shrink against the same step
  compiled without rules (the FSDP bug: GSPMD propagated the weights' `embed` sharding into the
  activations and every device ran the whole global batch).
* Nothing recompiles: the trainer (step + proximal log-probs) on fsdp 8 across batch contents;
  (slow) the engine on data 2 x tensor 2 across prompts, sampling parameters and a weight swap.
"""
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxrl_async.models.config import ModelConfig
from jaxrl_async.models.transformer import apply, init_params, param_shapes, sequence_logprobs
from jaxrl_async.generator.factory import EngineConfig, build_engine
from jaxrl_async.generator.engine_api import SamplingParams
from jaxrl_async.models.shardings import model_shardings
from jaxrl_async.sharding import make_mesh
from jaxrl_async.sharding.activations import (
    activation_rules, active_activation_rules, constrain, traced_with_activation_rules,
)
from jaxrl_async.trainer import PackingConfig, Trainer, TrainStepConfig, TrainSequence
from jaxrl_async.trainer.packing import DEVICE_FIELDS, PackedBatch
from jaxrl_async.trainer.train_step import TrainState

# F = 40 and ROW = 24 make the MLP intermediate's shape [rows, 24, 40 / tensor] easy to find in HLO
CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=40, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=8, rope_theta=10000.0)
ROW = 24
ROWS = 16
MESHES = [{"fsdp": 8}, {"fsdp": 4, "tensor": 2}]


@pytest.fixture(scope="module")
def params():
    return jax.jit(init_params, static_argnums=(0, 2))(CFG, jax.random.key(0), 0.2)


def _batch(seed, rows=ROWS, row=ROW):
    """Packed-style rows: 1-3 segments per row, padding at the end, positions restarting per segment."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, CFG.vocab_size, (rows, row)).astype(np.int32)
    seg = np.zeros((rows, row), np.int32)
    pos = np.zeros((rows, row), np.int32)
    for r in range(rows):
        t = 0
        for s in range(1, int(rng.integers(1, 4)) + 1):
            n = int(rng.integers(3, row // 2))
            n = min(n, row - t)
            seg[r, t:t + n] = s
            pos[r, t:t + n] = np.arange(n)
            t += n
    return tokens, seg, pos


def _has_sharding_constraint(fn, *args) -> bool:
    # a fresh function per call: make_jaxpr caches traces by function, and the rules are read at trace time
    return "sharding_constraint" in str(jax.make_jaxpr(lambda *a: fn(*a))(*args))


def test_constrain_is_a_noop_without_rules_and_on_one_device():
    x = jnp.ones((8, 4, 32))

    def f(x):
        return constrain(x * 2, "batch", "length", "activation_embed")

    assert active_activation_rules() is None
    assert not _has_sharding_constraint(f, x)
    with activation_rules(make_mesh({"fsdp": 1}, devices=jax.devices()[:1]), "trainer"):
        assert active_activation_rules() is None and not _has_sharding_constraint(f, x)
    mesh = make_mesh({"fsdp": 8})
    with activation_rules(mesh, "trainer"):
        assert _has_sharding_constraint(f, x)
        with activation_rules(None, "trainer"):  # an inner context can switch them off
            assert not _has_sharding_constraint(f, x)
        assert active_activation_rules()[0] is mesh
        with pytest.raises(ValueError, match="logical axis 'activation_nonsense' has no sharding rule"):
            jax.make_jaxpr(lambda x: constrain(x, "batch", "length", "activation_nonsense"))(x)
    assert active_activation_rules() is None
    # the model's own functions: no constraint unless a caller activated rules for the trace
    tokens, seg, pos = _batch(0)
    ps = param_shapes(CFG)
    assert not _has_sharding_constraint(lambda p, t, s: sequence_logprobs(p, CFG, t, s), ps, tokens, seg)
    traced = traced_with_activation_rules(lambda p, t, s: sequence_logprobs(p, CFG, t, s), mesh, "trainer")
    assert _has_sharding_constraint(traced, ps, tokens, seg)


def _mlp_shape(rows, shape):
    """HLO shape of the per-device MLP intermediate [.., rows, ROW, F / tensor]."""
    return re.compile(rf"f32\[(?:\d+,)*{rows},{ROW},{CFG.intermediate_size // shape.get('tensor', 1)}\]")


def _forward_and_logprobs(p, tokens, seg, pos, weights):
    """Logits, log-probs and entropies (8 vocabulary chunks: 3 positions of each of the 16 rows per
    chunk) and the gradient of a weighted log-prob sum."""
    logits = apply(p, CFG, tokens, pos, seg)

    def objective(p):
        lp, ent = sequence_logprobs(p, CFG, tokens, seg, pos, temperature=0.7, chunk=48)
        return jnp.sum(weights * lp), (lp, ent)

    (_, (lp, ent)), grads = jax.value_and_grad(objective, has_aux=True)(p)
    return logits, lp, ent, grads


@pytest.fixture(scope="module")
def unsharded(params):
    tokens, seg, pos = _batch(1)
    weights = np.random.default_rng(2).normal(size=tokens.shape).astype(np.float32)
    args = (tokens, seg, pos, weights)
    return args, jax.jit(_forward_and_logprobs)(params, *args)


@pytest.mark.parametrize("shape", MESHES, ids=lambda s: "x".join(f"{k}{v}" for k, v in s.items()))
def test_sharded_forward_and_logprobs_equal_unsharded(params, unsharded, shape):
    mesh = make_mesh(shape)
    host_args, ref = unsharded
    sharded_params = jax.device_put(params, model_shardings(CFG, mesh, "trainer"))
    batch_sh = jax.sharding.NamedSharding(mesh, P("fsdp", None))
    args = [jax.device_put(jnp.asarray(a), batch_sh) for a in host_args]
    compiled = jax.jit(traced_with_activation_rules(_forward_and_logprobs, mesh, "trainer")).lower(
        sharded_params, *args).compile()
    # the constraints were applied: every device computes the MLP of its local rows only
    hlo = compiled.as_text()
    assert _mlp_shape(ROWS // shape["fsdp"], shape).search(hlo) and not _mlp_shape(ROWS, shape).search(hlo)
    got = compiled(sharded_params, *args)
    for name, a, b in zip(("logits", "logprobs", "entropy"), got[:3], ref[:3]):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=0, err_msg=name)
    assert float(jnp.max(jnp.abs(ref[1]))) > 1.0  # real values, not zeros
    diffs = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-12)), got[3], ref[3])
    assert max(jax.tree.leaves(diffs)) <= 1e-5, diffs


def _abstract_step_args(trainer, n_micro):
    shp = (n_micro, ROWS, ROW)
    ints = {"tokens", "segment_ids", "positions", "versions", "seq_ids"}
    batch = PackedBatch(**{f: jax.ShapeDtypeStruct(shp, jnp.int32 if f in ints else jnp.float32,
                                                   sharding=trainer.batch_sharding) for f in DEVICE_FIELDS})
    ps = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.float32), param_shapes(trainer.model_cfg))
    st = jax.eval_shape(lambda p: TrainState(p, trainer.tx.init(p), jnp.zeros((), jnp.int32),
                                             jnp.zeros((), jnp.int32)), ps)
    st = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), st, trainer.state_shardings)
    scalar = lambda dt: jax.ShapeDtypeStruct((), dt, sharding=trainer.replicated)  # noqa: E731
    return st, batch, scalar(jnp.float32), scalar(jnp.int32)


def test_train_step_keeps_activations_batch_sharded():
    mesh = make_mesh({"fsdp": 4, "tensor": 2})
    trainer = Trainer(CFG, TrainStepConfig(packing=PackingConfig(tokens_per_micro=ROWS * ROW, row_len_buckets=(ROW,))),
                      mesh)
    args = _abstract_step_args(trainer, n_micro=2)
    num_seqs = trainer.cfg.packing.num_seqs(ROW)
    with_rules = trainer._step_fn(num_seqs).lower(*args).compile()
    # the same step traced without the rules: what GSPMD chose on its own before the fix
    without = jax.jit(functools.partial(trainer._step_impl, num_seqs=num_seqs), donate_argnums=(0,),
                      in_shardings=(trainer.state_shardings, trainer.batch_sharding, trainer.replicated,
                                    trainer.replicated),
                      out_shardings=(trainer.state_shardings, trainer.replicated)).lower(*args).compile()
    shape = dict(mesh.shape)
    hlo, hlo0 = with_rules.as_text(), without.as_text()
    assert _mlp_shape(ROWS // 4, shape).search(hlo) and not _mlp_shape(ROWS, shape).search(hlo)  # 4 local rows
    assert _mlp_shape(ROWS, shape).search(hlo0)  # unconstrained: the global batch on every device
    temp, temp0 = with_rules.memory_analysis().temp_size_in_bytes, without.memory_analysis().temp_size_in_bytes
    assert temp < 0.75 * temp0, (temp, temp0)


def _trajs(seed, n=16):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        L = int(rng.integers(6, ROW + 1))
        mask = (np.arange(L) >= 2).astype(np.int32)
        out.append(TrainSequence(tokens=rng.integers(0, CFG.vocab_size, L), loss_mask=mask,
                              behaviour_logprobs=np.where(mask > 0, -rng.uniform(2.0, 5.0, L), 0.0),
                              advantages=np.where(mask > 0, rng.normal(size=L), 0.0),
                              versions=np.where(mask > 0, 0, -1)))
    return out


def test_nothing_recompiles_on_the_sharded_trainer(params):
    pk = PackingConfig(tokens_per_micro=ROWS * ROW, row_len_buckets=(ROW,), max_seqs_per_row=1)
    trainer = Trainer(CFG, TrainStepConfig(packing=pk), make_mesh({"fsdp": 8}))
    state = trainer.init_state(params)
    state, _ = trainer.train_batch(state, _trajs(3))
    counts = trainer.n_compilations
    caches = (trainer._step_fn(trainer.cfg.packing.num_seqs(ROW))._cache_size(), trainer._jit_logprobs._cache_size())
    for seed, n in ((4, 16), (5, 11), (6, 7)):
        state, metrics = trainer.train_batch(state, _trajs(seed, n))
        assert int(metrics[0]["skipped"]) == 0
    assert trainer.n_compilations == counts == {"step": 1, "logprobs": 1}
    assert (trainer._step_fn(trainer.cfg.packing.num_seqs(ROW))._cache_size(),
            trainer._jit_logprobs._cache_size()) == caches == (1, 1)
    assert int(state.step) == 4


@pytest.mark.slow
def test_nothing_recompiles_on_the_sharded_engine(params):
    mesh = make_mesh({"data": 2, "tensor": 2}, devices=jax.devices()[:4])
    engine = build_engine(EngineConfig(max_concurrent_decodes=4, max_sequence_length=32, prefill_buckets=(16,),
                                       page_size=8, num_pages=16), CFG, mesh)
    gen_params = engine.place_params(params)
    engine.warmup(gen_params, max_samples=4)
    before = engine.compile_counts()
    state = engine.init_decode_state()
    for i, (prompt, sp) in enumerate((([5, 6, 7], SamplingParams(temperature=0.0, max_new_tokens=5)),
                                      ([9] * 11, SamplingParams(temperature=1.3, top_k=5, max_new_tokens=4, seed=7)))):
        pre = engine.prefill(gen_params, prompt, sp, num_samples=2)
        state = engine.bulk_insert(pre, state, [2 * i, 2 * i + 1])
        for _ in range(3):
            state, step = engine.generate(gen_params, state)
    assert np.asarray(step.valid).any()
    new_params = engine.place_params(jax.tree.map(lambda x: x * 1.01, params))  # a weight swap
    state, _ = engine.generate(new_params, state)
    assert engine.compile_counts() == before, (before, engine.compile_counts())
