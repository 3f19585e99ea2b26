"""Rollout routing replay (R3) and the router metrics on tiny random Qwen3-MoE models (fp32, real generator and
trainer): the generator records the experts of every token (prefill and decode) and they reach the trainer
aligned with the tokens; when the generator's routing is made to differ from the trainer's (a perturbed router
on the generator side), the trainer without replay reports the top-k mismatch fraction and a large behaviour /
proximal gap, and with replay it routes every recorded token to exactly the recorded experts and the gap closes
(top-1 routing with `norm_topk_prob`: the gate is 1 whatever the router, so routing is the only difference)."""

from __future__ import annotations

import functools
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_async.models import load_hf
from jaxrl_async.models.moe import routing_scope
from jaxrl_async.models.transformer import sequence_logprobs
from jaxrl_async.generator.factory import EngineConfig, build_engine
from jaxrl_async.generator.engine_api import SamplingParams
from jaxrl_async.generator.orchestrator import Generator
from jaxrl_async.testing import make_tiny_hf_model
from jaxrl_async.trainer.packing import PackingConfig, TrainSequence
from jaxrl_async.trainer.train_step import Trainer, TrainStepConfig


@pytest.fixture(scope="module")
def top1(tmp_path_factory):
    d = make_tiny_hf_model(str(tmp_path_factory.mktemp("moe_top1")), "qwen3_moe", num_experts_per_tok=1)
    return load_hf(d)


def _perturbed_router(params, scale: float, seed: int = 0):
    r = params["layers"]["router"]
    noise = jax.random.normal(jax.random.key(seed), r.shape, r.dtype) * scale * jnp.std(r)
    return {**params, "layers": {**params["layers"], "router": r + noise}}


_ENGINES: dict = {}


def _engine(cfg):
    """One recording engine per model config for the whole module (params are arguments: no recompilation)."""
    if cfg not in _ENGINES:
        _ENGINES[cfg] = build_engine(EngineConfig(max_concurrent_decodes=4, max_sequence_length=64,
                                                  prefill_buckets=(32,), page_size=8,
                                                  num_pages=64), cfg, record_routing=True)
    return _ENGINES[cfg]


def _generate(cfg, params, prompts, *, max_new=12):
    engine = _engine(cfg)
    with Generator(engine, engine.place_params(params)) as g:
        hs = [g.submit(pr, SamplingParams(temperature=1.0, max_new_tokens=max_new, n=2, seed=i))
              for i, pr in enumerate(prompts)]
        return [s for h in hs for s in h.result(300).samples]


def _trajectories(samples, with_routing=True):
    out = []
    for i, s in enumerate(samples):
        P, C = len(s.prompt_ids), len(s.completion_ids)
        out.append(TrainSequence(
            tokens=np.asarray(s.prompt_ids + s.completion_ids, np.int32),
            loss_mask=np.r_[np.zeros(P), np.ones(C)].astype(np.int32),
            behaviour_logprobs=np.r_[np.zeros(P), s.logprobs].astype(np.float32),
            advantages=np.r_[np.zeros(P), np.full(C, 1.0 if i % 2 else -1.0)].astype(np.float32),
            versions=np.r_[np.full(P, -1), s.versions].astype(np.int32),
            routing=s.routing if with_routing else None))
    return out


@functools.partial(jax.jit, static_argnums=(0,))
def _forward_ids(cfg, params, toks, seg, rec):
    kw = {} if rec is None else {"expert_ids": rec, "replay": True}
    with routing_scope(record=True, **kw) as sc:
        sequence_logprobs(params, cfg, toks, seg)
    return sc.result["ids"]


def _trainer_ids(cfg, params, toks, rec=None, T=64):
    """The trainer forward's experts [n, L, k] for one sequence (with `rec` [n, L, k]: replaying it), in one
    compiled program per (model, replay) padded to T tokens."""
    n = len(toks)
    t, seg = np.zeros((1, T), np.int32), np.zeros((1, T), np.int32)
    t[0, :n], seg[0, :n] = toks, 1
    if rec is not None:
        r = np.full((T,) + rec.shape[1:], -1, np.int16)
        r[:n] = rec
        rec = jnp.asarray(np.swapaxes(r, 0, 1)[:, None])
    return np.swapaxes(np.asarray(_forward_ids(cfg, params, t, seg, rec))[:, 0], 0, 1)[:n]


def _prompts(cfg, lengths=(5, 12, 20, 30)):
    rng = np.random.default_rng(0)
    return [rng.integers(3, cfg.vocab_size, n).tolist() for n in lengths]


def _train(cfg, params, trajs, replay):
    tr = Trainer(cfg, TrainStepConfig(packing=PackingConfig(tokens_per_micro=128, row_len_buckets=(64,)),
                                    routing_replay=replay))
    _, ms = tr.train_batch(tr.init_state(params), trajs)
    return {k: float(v) for k, v in ms[0].items() if np.ndim(v) == 0}


@pytest.mark.parametrize("layers", [{}, {"num_hidden_layers": 4, "mlp_only_layers": [1]}],
                         ids=["all_sparse", "dense_among_sparse"])
def test_recorded_routing_equals_the_trainers_and_travels_aligned_with_the_tokens(tmp_path, layers):
    """Same weights: the experts recorded at prefill (packed rows, several prompts) and at decode are the trainer
    forward's for every token but the last (never fed back: -1); behaviour log-probs within 1e-5; the trainer's
    mismatch metric is 0. With a dense-MLP layer among the sparse ones routing is per sparse layer."""
    cfg, params = load_hf(make_tiny_hf_model(str(tmp_path), "qwen3_moe", **layers))
    n_sparse = len(cfg.sparse_layer_ids)
    assert n_sparse == cfg.num_layers - (1 if layers else 0)
    samples = _generate(cfg, params, _prompts(cfg))
    for s in samples:
        toks = s.prompt_ids + s.completion_ids
        assert s.routing.shape == (len(toks), n_sparse, cfg.num_experts_per_tok)
        assert (s.routing[-1] == -1).all() and (s.routing[:-1] >= 0).all()
        own = _trainer_ids(cfg, params, toks)[:-1]
        np.testing.assert_array_equal(np.sort(own, -1), np.sort(s.routing[:-1], -1))
    m = _train(cfg, params, _trajectories(samples), replay=False)
    assert m["behave_prox_abs_max"] <= 1e-5
    assert m["moe/topk_mismatch_frac"] == 0.0
    n_rec = sum(len(s.prompt_ids) + len(s.completion_ids) - 1 for s in samples)
    assert m["moe/recorded_tokens"] == n_rec * n_sparse  # (token, sparse layer) pairs


def test_replay_uses_the_recorded_experts_and_closes_the_gap(top1):
    cfg, params = top1
    gen_params = _perturbed_router(params, 0.5)
    samples = _generate(cfg, gen_params, _prompts(cfg))
    # the generator's routing differs from the trainer's own on a fraction of the tokens
    own = [_trainer_ids(cfg, params, s.prompt_ids + s.completion_ids)[:-1] for s in samples]
    differ = np.concatenate([(o != s.routing[:-1]).any(-1).ravel() for o, s in zip(own, samples)])
    expected = differ.mean()
    assert 0.02 < expected < 0.9, expected
    # with replay the trainer routes every recorded token to exactly the recorded experts
    for s in samples:
        toks = s.prompt_ids + s.completion_ids
        np.testing.assert_array_equal(_trainer_ids(cfg, params, toks, s.routing)[:-1], s.routing[:-1])
    trajs = _trajectories(samples)
    off = _train(cfg, params, trajs, replay=False)
    on = _train(cfg, params, trajs, replay=True)
    # the mismatch metric reports the fraction of (token, layer) pairs whether or not the trainer replays (with
    # replay, the trainer's own top-k of the layers after the first is taken on the replayed hidden states)
    np.testing.assert_allclose(off["moe/topk_mismatch_frac"], expected, rtol=1e-6)
    assert on["moe/topk_mismatch_frac"] > 0.02
    assert off["behave_prox_abs_max"] > 1e-3, off["behave_prox_abs_max"]
    assert on["behave_prox_abs_max"] <= 1e-5, on["behave_prox_abs_max"]
    assert on["moe/unrouted_trajectories"] == 0


def test_recompute_kv_records_the_reprefill_routing(top1):
    """A weight update mid-flight with recompute_kv re-prefills the live sequences (prompt + tokens so far) under
    the new weights: the recording keeps each position's LAST routing (the re-prefill's, whose KV every later
    token attends to), so replay reproduces the log-prob of every token sampled after the update within 1e-5 when
    the routing is the only difference."""
    from jaxrl_async.trainer.packing import unpack

    cfg, params = top1
    gen_a, gen_b = _perturbed_router(params, 0.5, seed=1), _perturbed_router(params, 0.5, seed=2)
    engine = _engine(cfg)
    inner, steps, reached, gate = engine.generate, [0], threading.Event(), threading.Event()

    def gated(p, state):  # decode step 5 waits for the test: the update lands mid-generation
        steps[0] += 1
        if steps[0] == 5:
            reached.set()
            gate.wait(120)
        return inner(p, state)

    engine.generate = gated
    try:
        with Generator(engine, engine.place_params(gen_a), kv_update_policy="recompute_kv") as g:
            hs = [g.submit(pr, SamplingParams(temperature=1.0, max_new_tokens=24, n=2, seed=i))
                  for i, pr in enumerate(_prompts(cfg, (6, 9)))]
            assert reached.wait(300)
            g.update_params(engine.place_params(gen_b), 1)
            gate.set()
            samples = [s for h in hs for s in h.result(300).samples]
    finally:
        del engine.generate  # back to the class's method
    assert all(s.num_recomputes == 1 and 0 in s.versions and 1 in s.versions for s in samples)
    trajs = _trajectories(samples)
    tr = Trainer(cfg, TrainStepConfig(packing=PackingConfig(tokens_per_micro=128, row_len_buckets=(64,)),
                                    routing_replay=True))
    packed = tr.pack(trajs)
    lp, _ = tr.compute_logprobs(params, tr.put_batch(packed))
    after = [np.abs(a - t.behaviour_logprobs)[t.versions == 1] for a, t in zip(unpack(np.asarray(lp), packed), trajs)]
    after = np.concatenate(after)
    assert after.size > 0 and after.max() <= 1e-5, after.max()


def test_router_metrics_and_aux_loss_in_the_objective(top1):
    """Expert load per layer sums to 1 per layer; the aux loss equals transformers' formula over all layers; the
    objective grows by coef x aux (the policy-loss gradient unchanged at coef 0)."""
    cfg, params = top1
    samples = _generate(cfg, params, _prompts(cfg, (7, 11)), max_new=6)
    trajs = _trajectories(samples, with_routing=False)
    pk = PackingConfig(tokens_per_micro=128, row_len_buckets=(64,))
    tr0 = Trainer(cfg, TrainStepConfig(packing=pk))
    tr1 = Trainer(cfg, TrainStepConfig(packing=pk, router_aux_loss_coef=0.5))
    packed = tr0.pack(trajs)
    _, loss0, st0 = tr0.gradients(params, packed)
    _, loss1, _ = tr1.gradients(params, packed)
    from jaxrl_async.trainer.train_step import _moe_metrics

    m = _moe_metrics(dict(st0), cfg.num_experts_per_tok)
    load = np.asarray(m["moe/load"])
    assert load.shape == (cfg.num_layers, cfg.num_experts)
    np.testing.assert_allclose(load.sum(-1), 1.0, rtol=1e-6)
    assert "moe/topk_mismatch_frac" not in m  # nothing recorded
    # transformers' load_balancing_loss_func on the router logits of every layer (padding masked out)
    import torch
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    b = packed.batch
    assert b.shape[0] == 1  # one micro-batch: the per-micro-batch aux loss is the minibatch's
    logits = []
    for layer in range(cfg.num_layers):
        h_logits = _router_logits(cfg, params, b, layer)
        logits.append(torch.tensor(h_logits.reshape(-1, cfg.num_experts)))
    mask = torch.tensor((b.segment_ids[0] != 0).astype(np.int64))
    ref = float(load_balancing_loss_func(tuple(logits), cfg.num_experts, cfg.num_experts_per_tok, mask))
    np.testing.assert_allclose(float(m["moe/aux_loss"]), ref, rtol=1e-5)
    np.testing.assert_allclose(float(loss1) - float(loss0), 0.5 * ref, rtol=1e-4)
    ent = float(m["moe/router_entropy"])
    assert 0.0 < ent < np.log(cfg.num_experts)


def _router_logits(cfg, params, b, layer):
    """float32 router logits [rows, T, X] of `layer` (the stats scope's probabilities, recomputed here from the
    layer input captured through `moe.routing`)."""
    import jaxrl_async.models.moe as moe

    captured = {}
    orig = moe.routing

    def spy(h, router, k, norm, expert_ids=None):
        out = orig(h, router, k, norm, expert_ids)
        captured.setdefault("logits", []).append(out[2])
        return out

    moe.routing = spy
    try:
        cfg_u = cfg.replace(scan_layers=False)
        sequence_logprobs(params, cfg_u, jnp.asarray(b.tokens[0]), jnp.asarray(b.segment_ids[0]),
                          jnp.asarray(b.positions[0]))
    finally:
        moe.routing = orig
    return np.asarray(captured["logits"][layer])


def test_routing_survives_the_checkpointed_group_record():
    """Finished groups saved in a checkpoint keep their trajectories' routing bit for bit (and groups without
    routing stay without)."""
    import types

    from jaxrl_async.checkpoint import pack_records
    from jaxrl_async.checkpoint.codec import unpack_records
    from jaxrl_async.rollout.workflow import Trajectory as WTrajectory, TrajectoryGroup
    from jaxrl_async.loop.state import group_from_record, group_record

    rng = np.random.default_rng(0)
    routed = rng.integers(0, 4, (7, 2, 2)).astype(np.int16)
    routed[-1] = -1
    trajs = [WTrajectory.from_completion([5, 6, 7], [8, 9, 10, 11], [-0.5] * 4, [0] * 4, 1.0, "length",
                                         routing=r) for r in (routed, None)]
    group = TrajectoryGroup({"id": "x"}, trajs, 3, {})
    g = types.SimpleNamespace(item=group, ticket=types.SimpleNamespace(admit_version=0), head_version=0)
    skeleton, pools = pack_records([group_record(g, 5)])
    back = group_from_record(unpack_records(skeleton, pools)[0], {"id": "x"})
    assert back.trajectories[0].routing.dtype == np.int16
    np.testing.assert_array_equal(back.trajectories[0].routing, routed)
    assert back.trajectories[1].routing is None


@pytest.mark.parametrize("overrides, message", [
    (["trainer.routing_replay=true"], "config error: trainer.routing_replay: needs rollout.record_routing = true"),
    (["rollout.record_routing=true"], "config error: rollout.record_routing: needs a mixture-of-experts model"),
    (["rollout.record_routing=true", "trainer.routing_replay=true"], "rollout.record_routing: needs a mixture-of-"),
    (["trainer.router_aux_loss_coef=-1"], "config error: trainer.router_aux_loss_coef: must be a finite float >= 0"),
])
def test_config_errors_name_the_field(overrides, message):
    from jaxrl_async.config import ConfigError, RunConfig, apply_overrides, validate

    with pytest.raises(ConfigError) as e:
        validate(apply_overrides(RunConfig(), overrides), num_devices=8)
    assert message in str(e.value)


def test_moe_config_validates_and_dense_models_refuse_recording():
    from jaxrl_async.config import RunConfig, apply_overrides, validate
    from jaxrl_async.models import ModelConfig

    moe = ["model.model_type=qwen3_moe", "model.num_experts=4", "model.num_experts_per_tok=2",
           "model.moe_intermediate_size=32", "rollout.record_routing=true", "trainer.routing_replay=true"]
    validate(apply_overrides(RunConfig(), moe), num_devices=8)
    dense = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                        num_kv_heads=1, head_dim=16)
    with pytest.raises(ValueError, match="record_routing needs a mixture-of-experts model"):
        build_engine(EngineConfig(max_concurrent_decodes=2, max_sequence_length=32, page_size=8,
                                  num_pages=8), dense, record_routing=True)
    with pytest.raises(ValueError, match="TrainStepConfig.routing_replay: needs a mixture-of-experts model"):
        Trainer(dense, TrainStepConfig(routing_replay=True))


def test_multi_turn_routing_is_merged_over_the_turns_last_routing_winning():
    """`Trajectory.from_turns`: turn 2's prefill routed turn 1's tokens and the inserted ones again; each position
    keeps the last routing (the KV later tokens attended to), the last token stays unrecorded."""
    import types

    from jaxrl_async.rollout.workflow import Trajectory as WTrajectory

    def sample(prompt, completion, fill):
        r = np.full((len(prompt) + len(completion), 1, 2), fill, np.int16)
        r[-1] = -1  # the last token is never fed back
        return types.SimpleNamespace(prompt_ids=prompt, completion_ids=completion, logprobs=[-1.0] * len(completion),
                                     versions=[0] * len(completion), finish_reason="stop", routing=r)

    first = sample([1, 2, 3], [4, 5], 1)
    second = sample([1, 2, 3, 4, 5, 9, 9], [6, 7, 8], 2)
    t = WTrajectory.from_turns([1, 2, 3], [first, ([9, 9], False), second], 1.0)
    assert t.routing.shape == (10, 1, 2)
    assert (t.routing[:-1] == 2).all() and (t.routing[-1] == -1).all()
    single = WTrajectory.from_turns([1, 2, 3], [first], 1.0)
    assert (single.routing[:-1] == 1).all() and (single.routing[-1] == -1).all()
    no_routing = types.SimpleNamespace(**{**vars(first), "routing": None})
    assert WTrajectory.from_turns([1, 2, 3], [no_routing], 1.0).routing is None


def test_aux_loss_coefficient_defaults_to_the_models(top1):
    """`trainer.router_aux_loss_coef` None takes the checkpoint's HF `router_aux_loss_coef`; a value overrides it;
    dense models get 0."""
    from jaxrl_async.trainer.factory import trainer_config
    from jaxrl_async.config import RunConfig, apply_overrides

    cfg, _ = top1
    assert cfg.router_aux_loss_coef == 0.001  # the tiny model's config.json
    run = RunConfig()
    assert trainer_config(run, cfg).router_aux_loss_coef == 0.001
    assert trainer_config(apply_overrides(run, ["trainer.router_aux_loss_coef=0.02"]), cfg).router_aux_loss_coef == 0.02
    assert trainer_config(run, cfg.replace(num_experts=0, num_experts_per_tok=0, model_type="qwen3")
                          ).router_aux_loss_coef == 0.0
    assert trainer_config(run).routing_replay is False
