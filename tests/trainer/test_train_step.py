"""Train step: accumulation == full batch, packed == padded, sharded == single device, PPO with r == 1
is the behaviour-weighted policy gradient, non-finite guard, no recompilation, bad batches.

One tiny random model; the step/gradient functions compile once per shape and are shared by the
tests through module-scoped trainers (compilation dominates the run time on CPU).
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_async.models.config import ModelConfig
from jaxrl_async.models.transformer import init_params, sequence_logprobs
from jaxrl_async.rl.losses import PolicyLossConfig
from jaxrl_async.sharding import make_mesh
from jaxrl_async.trainer import (
    OptimizerConfig, PackingConfig, PackingError, Trainer, TrainStepConfig, TrainSequence, pack,
)

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=8, rope_theta=10000.0)
ROW = 16
# Full minibatch in one micro-batch of 8 rows; the same rows split into micro-batches of 2 rows; padded.
FULL = PackingConfig(tokens_per_micro=8 * ROW, row_len_buckets=(ROW,), max_seqs_per_row=4)
MICRO = dataclasses.replace(FULL, tokens_per_micro=2 * ROW)
PADDED = dataclasses.replace(FULL, max_seqs_per_row=1)
LR, EPS = 1e-2, 1e-8
OPT = OptimizerConfig(lr=LR, eps=EPS, weight_decay=0.0, max_grad_norm=None)
LOSS = PolicyLossConfig()  # decoupled PPO, eps 0.2, behaviour weight: token mask at upper = 5


def make_trajs(seed, n=8, lo=5, hi=ROW, with_prox=False):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        L = int(rng.integers(lo, hi + 1))
        p = int(rng.integers(1, 4))
        mask = (np.arange(L) >= p).astype(np.int32)
        behav = np.where(mask > 0, -rng.uniform(0.5, 6.0, L), 0.0)  # w = exp(lp - behav) spans the mask at 5
        t = TrainSequence(tokens=rng.integers(0, CFG.vocab_size, L), loss_mask=mask, behaviour_logprobs=behav,
                       advantages=np.where(mask > 0, rng.normal(size=L), 0.0),
                       versions=np.where(mask > 0, 2, -1))
        if with_prox:
            t.proximal_logprobs = np.where(mask > 0, -4.2 + 0.3 * rng.normal(size=L), 0.0)  # r far from 1: clips
        out.append(t)
    return out


@pytest.fixture(scope="module")
def params():
    return jax.jit(init_params, static_argnums=(0, 2))(CFG, jax.random.key(0), 0.1)


@pytest.fixture(scope="module")
def trainer():
    return Trainer(CFG, TrainStepConfig(optimizer=OPT, packing=FULL), loss_cfg=LOSS)


def _host(tree):
    return jax.tree.map(lambda x: np.asarray(x, np.float64), tree)


def _rel_err(a, b):
    """max over leaves of ||a - b|| / ||b||."""
    errs = jax.tree.map(lambda x, y: np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-30), _host(a), _host(b))
    return max(jax.tree.leaves(errs))


@pytest.mark.default_xla_opt  # a 1e-6 bound on fp32 sums (tests/conftest.py)
def test_accumulation_over_micro_batches_equals_full_batch(trainer, params):
    trajs = make_trajs(1, with_prox=True)
    full, micro = pack(trajs, FULL), pack(trajs, MICRO)
    assert full.n_micro == 1 and micro.n_micro == 4 and micro.n_real_micro == 3  # 5 rows of 2 -> 3 -> bucket 4
    g_full, loss_full, st_full = trainer.gradients(params, full)
    g_micro, loss_micro, st_micro = trainer.gradients(params, micro)
    assert _rel_err(g_micro, g_full) <= 1e-6
    np.testing.assert_allclose(float(loss_micro), float(loss_full), rtol=1e-6)
    assert float(st_full["clip_frac"]) > 0 and float(st_full["behave_mask_frac"]) > 0  # every branch is live
    for k in ("n_tokens", "clip_frac", "behave_mask_frac", "behave_weight_max", "ratio", "entropy"):
        np.testing.assert_allclose(float(st_micro[k]), float(st_full[k]), rtol=1e-6, err_msg=k)
    assert float(st_full["n_tokens"]) == full.n_loss_tokens
    # the global normaliser matters: a per-micro-batch token mean is a different (wrong) gradient
    assert _rel_err(jax.tree.map(lambda g: 2 * g, g_micro), g_full) > 0.5


def test_packed_and_padded_batches_give_the_same_loss_and_gradient(trainer, params):
    trajs = make_trajs(2, lo=3, hi=8, with_prox=True)
    packed, padded = pack(trajs, FULL), pack(trajs, PADDED)
    assert packed.n_real_micro == 1 and (packed.batch.segment_ids.max(axis=-1) > 1).any()  # really packed
    assert padded.batch.segment_ids.max() == 1
    g_pk, loss_pk, _ = trainer.gradients(params, packed)
    g_pd, loss_pd, _ = trainer.gradients(params, padded)
    np.testing.assert_allclose(float(loss_pk), float(loss_pd), rtol=1e-5)
    assert _rel_err(g_pk, g_pd) <= 1e-5


def _reference_pg(params, trajs, upper=5.0):
    """-sum_t m_t w_t A_t log pi(t) / sum m with w = exp(log pi_theta - log pi_behav), masked above `upper`.

    One trajectory per row (padded), computed independently of packing and of the loss module.
    """
    T = max(len(t) for t in trajs)
    B = len(trajs)
    tok, seg, m, A, lb = (np.zeros((B, T), np.int32), np.zeros((B, T), np.int32), np.zeros((B, T)),
                          np.zeros((B, T)), np.zeros((B, T)))
    for i, t in enumerate(trajs):
        n = len(t)
        tok[i, :n], seg[i, :n], m[i, :n], A[i, :n], lb[i, :n] = (
            t.tokens, 1, t.loss_mask, t.advantages, t.behaviour_logprobs)

    def surrogate(p):
        lp, _ = sequence_logprobs(p, CFG, jnp.asarray(tok), jnp.asarray(seg))
        w = jnp.exp(jax.lax.stop_gradient(lp) - lb)
        w = jnp.where(w <= upper, w, 0.0)
        # the PPO loss value at r == 1 is -sum m w A / sum m; its gradient is the surrogate's
        return -jnp.sum(m * w * A * lp) / m.sum(), -jnp.sum(m * w * A) / m.sum()

    (_, ppo_value), grad = jax.jit(jax.value_and_grad(surrogate, has_aux=True))(params)
    return ppo_value, grad


def test_single_minibatch_recompute_is_behaviour_weighted_policy_gradient(trainer, params):
    trajs = make_trajs(3)
    ref_loss, ref_g = _reference_pg(params, trajs)
    # the gradient the step computes (recomputed proximal => r == 1, clipping never active)
    packed = trainer.pack(trajs)
    batch = trainer.with_recomputed_proximal(params, trainer.put_batch(packed))
    g, loss, stats = trainer.gradients(params, packed, batch)
    assert _rel_err(g, ref_g) <= 1e-5
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    assert float(stats["clip_frac"]) == 0.0 and abs(float(stats["ratio"]) - 1.0) < 1e-6
    assert float(stats["behave_mask_frac"]) > 0  # some w > 5 were masked
    # and the update: first AdamW step (no decay, no clip) = -lr * g / (|g| + eps) elementwise
    state = trainer.init_state(params)
    state, metrics = trainer.train_batch(state, trajs)
    assert len(metrics) == 1 and int(metrics[0]["skipped"]) == 0 and int(state.step) == 1
    expected = jax.tree.map(lambda p, gr: p - LR * gr / (np.abs(gr) + EPS), _host(params), _host(ref_g))
    diff = jax.tree.map(lambda a, b: np.max(np.abs(a - b)), _host(state.params), expected)
    assert max(jax.tree.leaves(diff)) <= 1e-3 * LR, diff
    np.testing.assert_allclose(float(metrics[0]["loss"]), float(ref_loss), rtol=1e-5)


def test_sharded_step_equals_single_device_step(trainer, params):
    assert jax.device_count() >= 8
    mesh = make_mesh({"fsdp": 4, "tensor": 2})
    sharded = Trainer(CFG, TrainStepConfig(optimizer=OPT, packing=FULL), mesh, loss_cfg=LOSS)
    assert sharded.cfg.packing.row_multiple == 4
    trajs = make_trajs(4)
    s1, m1 = trainer.train_batch(trainer.init_state(params), trajs)
    s8, m8 = sharded.train_batch(sharded.init_state(params), trajs)
    q = s8.params["layers"]["q"]
    assert q.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor", None)
    moments = [x for x in jax.tree.leaves(s8.opt_state) if x.shape == q.shape]
    assert len(moments) == 2 and all(x.sharding.spec == q.sharding.spec for x in moments)  # Adam mu, nu
    np.testing.assert_allclose(float(m8[0]["loss"]), float(m1[0]["loss"]), rtol=1e-5)
    np.testing.assert_allclose(float(m8[0]["grad_norm"]), float(m1[0]["grad_norm"]), rtol=1e-5)
    diff = jax.tree.map(lambda a, b: np.max(np.abs(a - b)), _host(s8.params), _host(s1.params))
    assert max(jax.tree.leaves(diff)) <= 1e-3 * LR, diff
    moved = jax.tree.map(lambda a, b: np.max(np.abs(a - b)), _host(s1.params), _host(params))
    assert max(jax.tree.leaves(moved)) > 0.5 * LR  # the update did happen


def test_non_finite_batch_is_skipped_and_counted(trainer, params):
    trajs = make_trajs(5)
    trajs[3].advantages = trajs[3].advantages.copy()
    trajs[3].advantages[-1] = np.nan
    with pytest.raises(PackingError, match="trajectory 3: field advantages is not finite"):
        trainer.pack(trajs)
    bad = pack(trajs, dataclasses.replace(FULL, check_finite=False))  # bypass the host check: the step guards
    state = trainer.init_state(params)
    before_p, before_o = _host(state.params), _host(state.opt_state)
    state, metrics = trainer.step(state, bad)
    assert int(metrics["skipped"]) == 1 and not np.isfinite(float(metrics["loss"]))
    assert int(state.n_skipped) == 1 and int(state.step) == 0
    jax.tree.map(np.testing.assert_array_equal, _host(state.params), before_p)
    jax.tree.map(np.testing.assert_array_equal, _host(state.opt_state), before_o)
    state, metrics = trainer.step(state, trainer.pack(make_trajs(6)))  # a good batch still trains
    assert int(metrics["skipped"]) == 0 and int(state.step) == 1 and int(state.n_skipped) == 1


def test_no_recompilation_across_contents_of_a_bucket(trainer, params):
    state = trainer.init_state(params)
    state, _ = trainer.train_batch(state, make_trajs(7))
    counts = trainer.n_compilations
    assert counts["step"] >= 1 and counts["logprobs"] >= 1
    for seed, n in ((8, 8), (9, 6), (10, 5)):  # different lengths, counts, tokens; same [1, 8, 16] bucket
        trajs = make_trajs(seed, n=n)
        assert trainer.pack(trajs).batch.shape == (1, 8, ROW)
        state, metrics = trainer.train_batch(state, trajs)
        assert int(metrics[0]["skipped"]) == 0
    assert trainer.n_compilations == counts
    assert int(state.step) == 4


def test_ppo_minibatches_share_the_proximal_of_the_batch_start(params):
    """ppo_n_minibatches=2: pi_prox of both minibatches comes from the weights before the first
    update, so r == 1 on the first minibatch only (AReaL: recompute with theta_k before any update)."""
    tr = Trainer(CFG, TrainStepConfig(optimizer=OPT, packing=FULL, ppo_n_minibatches=2), loss_cfg=LOSS)
    state, metrics = tr.train_batch(tr.init_state(params), make_trajs(13))
    assert [m["sequences"] for m in metrics] == [4, 4] and int(state.step) == 2
    assert abs(float(metrics[0]["ratio"]) - 1.0) < 1e-6 and abs(float(metrics[0]["approx_kl"])) < 1e-6
    assert abs(float(metrics[1]["ratio"]) - 1.0) > 1e-4


def test_loglinear_proximal_matches_hand_derived_alpha(trainer, params):
    """proximal='loglinear', current version 3: alpha = (3 - 1 - v_b) / (3 - v_b) = 2/3, 1/2, 0 for v_b = 0, 1, 2,
    log pi_prox = log pi_behav + alpha (log pi_theta - log pi_behav): same gradient as those values given."""
    trajs = make_trajs(14)
    rng = np.random.default_rng(0)
    for t in trajs:
        t.versions = np.where(t.loss_mask > 0, rng.integers(0, 3, len(t)), -1)
    loglin = Trainer(CFG, TrainStepConfig(optimizer=OPT, packing=FULL, proximal="loglinear"), loss_cfg=LOSS)
    packed = pack(trajs, FULL)
    g_ll, loss_ll, _ = loglin.gradients(params, packed, policy_version=3)
    lp, _ = trainer.compute_logprobs(params, trainer.put_batch(packed))
    alpha = np.select([packed.batch.versions == 0, packed.batch.versions == 1], [2 / 3, 1 / 2], 0.0)
    lb = packed.batch.behaviour_logprobs
    prox = np.where(packed.batch.loss_mask > 0, lb + alpha * (np.asarray(lp) - lb), 0.0).astype(np.float32)
    g_given, loss_given, _ = trainer.gradients(params, packed, trainer.put_batch(packed.batch.replace(
        proximal_logprobs=prox)))
    assert (alpha[packed.batch.loss_mask > 0] > 0).any()
    np.testing.assert_allclose(float(loss_ll), float(loss_given), rtol=1e-5)
    assert _rel_err(g_ll, g_given) <= 1e-5


def test_bad_device_batch_shapes_and_minibatch_split(trainer, params):
    packed = trainer.pack(make_trajs(11))
    b = packed.batch.replace(advantages=packed.batch.advantages[:, :, :-1])
    with pytest.raises(PackingError, match=r"batch field advantages has shape \(1, 8, 15\)"):
        trainer.put_batch(b)
    with pytest.raises(PackingError, match="ppo_n_minibatches=3"):
        Trainer(CFG, TrainStepConfig(optimizer=OPT, packing=FULL, ppo_n_minibatches=3), loss_cfg=LOSS).train_batch(
            None, make_trajs(12, n=2))
    with pytest.raises(ValueError, match="TrainStepConfig.proximal"):
        TrainStepConfig(proximal="ema")


def test_bf16_compute_keeps_fp32_master_weights_and_gradients(trainer, params):
    """cfg.dtype=bfloat16: matmuls in bf16, parameters/gradients/accumulator stay fp32; loss close to fp32."""
    tr16 = Trainer(CFG.replace(dtype="bfloat16"), TrainStepConfig(optimizer=OPT, packing=FULL), loss_cfg=LOSS)
    packed = pack(make_trajs(15), FULL)
    g16, loss16, _ = tr16.gradients(params, packed)
    g32, loss32, _ = trainer.gradients(params, packed)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(g16))
    assert tr16.state_shardings is not None and tr16.model_cfg.param_dtype == "float32"
    np.testing.assert_allclose(float(loss16), float(loss32), rtol=5e-2)
    assert 1e-6 < _rel_err(g16, g32) < 0.1  # bf16 really ran, and still agrees to bf16 precision


def test_empty_bucket_micro_batches_are_skipped_and_change_nothing(params):
    """3 real micro-batches rounded up to 4 (power-of-two bucket) vs exactly 3: the same update, bit for
    bit; the step and the proximal pass branch on emptiness (a `cond` in the micro-batch loop), so the
    empty one costs no forward/backward (time saved: benchmarks/bench_micro_padding.py, RESULTS)."""
    trajs = make_trajs(11, n=6)
    common = dict(optimizer=OPT, proximal="recompute")
    pad = Trainer(CFG, TrainStepConfig(packing=dataclasses.replace(PADDED, tokens_per_micro=2 * ROW), **common),
                  loss_cfg=LOSS)
    exact = Trainer(CFG, TrainStepConfig(packing=dataclasses.replace(PADDED, tokens_per_micro=2 * ROW,
                                                                   n_micro_buckets=(3,)), **common), loss_cfg=LOSS)
    assert (pad.pack(trajs).n_micro, pad.pack(trajs).n_real_micro, exact.pack(trajs).n_micro) == (4, 3, 3)
    s_pad, m_pad = pad.train_batch(pad.init_state(params), trajs)
    s_exact, m_exact = exact.train_batch(exact.init_state(params), trajs)
    assert float(m_pad[0]["loss"]) == float(m_exact[0]["loss"])
    assert float(m_pad[0]["grad_norm"]) == float(m_exact[0]["grad_norm"])
    for a, b in zip(jax.tree.leaves(s_pad.params), jax.tree.leaves(s_exact.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    batch = pad.put_batch(pad.pack(trajs))
    step = functools.partial(pad._step_impl, num_seqs=pad.pack(trajs).num_seqs)
    step_jaxpr = str(jax.make_jaxpr(step)(pad.init_state(params), batch, jnp.float32(1.0), jnp.int32(0)))
    lp_jaxpr = str(jax.make_jaxpr(pad._logprobs_impl)(params, batch))
    assert "cond[" in step_jaxpr and "cond[" in lp_jaxpr


def test_step_metrics_cover_every_minibatch():
    from jaxrl_async.trainer.train_step import step_metrics

    mb = [{"loss": jnp.float32(float("nan")), "grad_norm": jnp.float32(float("inf")), "lr": 1e-3, "skipped": 1,
           "clip_frac": 0.5, "loss_tokens": 30, "behave_prox_abs_max": 0.2, "tokens": 40},
          {"loss": jnp.float32(1.0), "grad_norm": jnp.float32(2.0), "lr": 2e-3, "skipped": 0, "clip_frac": 0.1,
           "loss_tokens": 10, "behave_prox_abs_max": 0.7, "tokens": 12}]
    m = step_metrics(mb)
    # a non-finite FIRST minibatch reaches the run's check (the last one alone looked fine)
    assert not np.isfinite(m["loss"]) and not np.isfinite(m["grad_norm"])
    assert (m["skipped"], m["minibatches"], m["lr"]) == (1, 2, 2e-3)
    assert m["clip_frac"] == pytest.approx(0.75 * 0.5 + 0.25 * 0.1) and m["behave_prox_abs_max"] == 0.7
    ok = step_metrics([{**mb[1], "grad_norm": 3.0}, mb[1]])
    assert ok["loss"] == 1.0 and ok["grad_norm"] == 3.0 and "tokens" not in ok
