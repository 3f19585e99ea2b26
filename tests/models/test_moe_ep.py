"""Expert parallelism (`moe.expert_parallel_swiglu`): experts split over an `expert` mesh axis, tokens exchanged
inside `shard_map` (all-gather over the expert group, local experts, reduce-scatter back). fp32 values and
gradients equal the one-device grouped matmul on trainer (expert x fsdp, expert x tensor) and generator
(data x expert) meshes, with uneven routing (experts without a token on a shard), top-1 and top-3; the compiled
exchange never gathers the expert weights over `expert`; whole-model log-probs and gradients (a dense layer among
sparse ones, norm_topk_prob both ways), the trainer's whole step on an fsdp x expert mesh and the paged generator
on a data x expert mesh equal one device."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

from jaxrl_async.models import load_hf, sequence_logprobs
from jaxrl_async.models import moe as moe_lib
from jaxrl_async.models.moe import expert_parallel_size, expert_parallel_swiglu, grouped_swiglu
from jaxrl_async.sharding import make_mesh
from jaxrl_async.sharding.activations import activation_rules
from jaxrl_async.sharding.rules import logical_to_spec
from jaxrl_async.testing import check_engine_against_hf_and_trainer, make_tiny_hf_model

B, T, D, X, F = 8, 4, 16, 8, 12


def _skewed_routing(rng, k):
    """ids [B, T, k] (distinct per token): the first half of the batch routes only to experts 0..k (so on a
    trainer mesh some shards send nothing to most experts), the rest anywhere but expert X - 1 (never chosen)."""
    scores = rng.random((B, T, X))
    scores[: B // 2, :, k + 1:] -= 2.0
    scores[..., X - 1] -= 4.0
    return np.argsort(-scores, axis=-1)[..., :k].astype(np.int32)


def _inputs(k, seed=0):
    rng = np.random.default_rng(seed)
    h = rng.normal(size=(B, T, D)).astype(np.float32)
    ids = _skewed_routing(rng, k)
    gates = rng.random((B, T, k)).astype(np.float32)
    w = {"moe_gate": 0.3 * rng.normal(size=(X, D, F)), "moe_up": 0.3 * rng.normal(size=(X, D, F)),
         "moe_down": 0.3 * rng.normal(size=(X, F, D))}
    return h, ids, gates, {n: v.astype(np.float32) for n, v in w.items()}


def _reference(h, ids, gates, w):
    out = grouped_swiglu(h.reshape(B * T, D), ids.reshape(B * T, -1), gates.reshape(B * T, -1), w["moe_gate"],
                         w["moe_up"], w["moe_down"], "ragged")
    return out.reshape(B, T, D)


def _place(mesh, rules, h, ids, gates, w):
    tok = NamedSharding(mesh, logical_to_spec(("batch", "length", None), h.shape, rules, mesh))
    axes = moe_lib.EXPERT_WEIGHT_AXES
    w = {n: jax.device_put(v, NamedSharding(mesh, logical_to_spec(axes[n], v.shape, rules, mesh))) for n, v in w.items()}
    return jax.device_put(h, tok), jax.device_put(ids, tok), jax.device_put(gates, tok), w


def _value_and_grads(fn, h, ids, gates, w):
    cot = jnp.asarray(np.random.default_rng(1).normal(size=(B, T, D)).astype(np.float32))
    loss = lambda h, g, w: jnp.sum(fn(h, ids, g, w) * cot)  # noqa: E731
    return jax.jit(lambda h, g, w: (fn(h, ids, g, w), jax.grad(loss, argnums=(0, 1, 2))(h, g, w)))(h, gates, w)


@pytest.mark.parametrize("shape,rules,k", [
    ({"fsdp": 2, "expert": 4}, "trainer", 2),  # tokens split over expert: gathered and reduce-scattered
    ({"expert": 2, "tensor": 2, "fsdp": 2}, "trainer", 3),  # + the expert width split over tensor
    ({"data": 2, "expert": 4}, "generator", 1),  # tokens replicated over expert: local experts + psum
    ({"data": 2, "expert": 2, "tensor": 2}, "generator", 2),
])
def test_exchange_equals_one_device_values_and_gradients(shape, rules, k):
    h, ids, gates, w = _inputs(k)
    counts = np.stack([np.bincount(ids[i].reshape(-1), minlength=X) for i in range(B)])
    assert (counts == 0).any() and counts[:, X - 1].sum() == 0  # uneven: experts without tokens on a shard
    out_ref, grads_ref = _value_and_grads(_reference, *map(jnp.asarray, (h, ids, gates)), w)
    mesh = make_mesh(shape)
    assert expert_parallel_size(mesh, rules, X) == shape["expert"]
    ep = lambda h, i, g, w: expert_parallel_swiglu(h, i, g, w, mesh, rules, impl="ragged")  # noqa: E731
    out, grads = _value_and_grads(ep, *_place(mesh, rules, h, ids, gates, w))
    np.testing.assert_allclose(np.asarray(out), np.asarray(out_ref), rtol=1e-5, atol=1e-5)
    flat_ref, flat = jax.tree.leaves(grads_ref), jax.tree.leaves(grads)
    assert len(flat) == 5
    for a, b in zip(flat, flat_ref):
        assert np.abs(np.asarray(b)).max() > 1e-2
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    # experts nobody routed to get a zero gradient, exactly
    assert np.all(np.asarray(grads[2]["moe_down"])[X - 1] == 0)


@pytest.mark.parametrize("shape,rules", [
    ({"fsdp": 2, "expert": 4}, "trainer"),
    ({"data": 2, "expert": 2, "tensor": 2}, "generator"),  # the down adapter's A split over tensor with its experts
])
def test_exchange_with_expert_adapters_equals_one_device(shape, rules):
    """LoRA on the experts (`lora.expert_adapters`) inside the exchange: the adapters split over `expert` with
    their experts; values and the gradients of tokens, gates, weights and adapters equal one device."""
    h, ids, gates, w = _inputs(2)
    rng = np.random.default_rng(5)
    r = 3
    shapes = {"gate_up_a": (X, D, r), "gate_b": (X, r, F), "up_b": (X, r, F), "down_a": (X, F, r), "down_b": (X, r, D)}
    ad = {n: (0.3 * rng.normal(size=sh)).astype(np.float32) for n, sh in shapes.items()}
    scale = 0.5

    def ref(h, i, g, wa):
        w, a = wa
        out = grouped_swiglu(h.reshape(B * T, D), i.reshape(B * T, -1), g.reshape(B * T, -1), w["moe_gate"],
                             w["moe_up"], w["moe_down"], "ragged", lora={**a, "scale": scale})
        return out.reshape(B, T, D)

    out_ref, grads_ref = _value_and_grads(ref, *map(jnp.asarray, (h, ids, gates)), (w, ad))
    no_lora = _reference(*map(jnp.asarray, (h, ids, gates)), w)
    assert np.abs(np.asarray(out_ref) - np.asarray(no_lora)).max() > 1e-2  # the adapters matter
    mesh = make_mesh(shape)
    h_, ids_, gates_, w_ = _place(mesh, rules, h, ids, gates, w)
    axes = moe_lib.EXPERT_ADAPTER_AXES
    ad_ = {n: jax.device_put(v, NamedSharding(mesh, logical_to_spec(axes[n], v.shape, rules, mesh)))
           for n, v in ad.items()}

    def ep(h, i, g, wa):
        w, a = wa
        with activation_rules(mesh, rules):
            return moe_lib.expert_swiglu(h, i, g, w, "ragged", lora={**a, "scale": scale})

    out, grads = _value_and_grads(ep, h_, ids_, gates_, (w_, ad_))
    np.testing.assert_allclose(np.asarray(out), np.asarray(out_ref), rtol=1e-5, atol=1e-5)
    flat_ref, flat = jax.tree.leaves(grads_ref), jax.tree.leaves(grads)
    assert len(flat) == 10
    for a, b in zip(flat, flat_ref):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_compiled_exchange_keeps_experts_sharded():
    """The point of the exchange: the expert weights are never gathered over `expert` (GSPMD left alone gathers
    routed rows or weights); tokens are all-gathered and their results reduce-scattered within expert groups."""
    h, ids, gates, w = _inputs(2)
    mesh = make_mesh({"fsdp": 2, "expert": 4})
    args = _place(mesh, "trainer", h, ids, gates, w)
    fn = jax.jit(lambda h, i, g, w: expert_parallel_swiglu(h, i, g, w, mesh, "trainer", impl="ragged"))
    hlo = fn.lower(*args).compile().as_text()
    gathers = re.findall(r"= (\S+) all-gather\(", hlo)
    assert any(s.startswith(f"f32[{X // 4},{D},{F}]") for s in gathers), gathers  # local experts, fsdp-gathered
    assert not any(s.startswith(f"f32[{X},") for s in gathers), gathers  # never all experts
    assert re.search(r"reduce-scatter\(", hlo)


_MIXED: dict = {}


def _mixed(tmp_path_factory, norm_topk_prob):
    """8 experts, top-3, layer 1 dense among sparse layers 0 and 2 (made once per flag)."""
    if norm_topk_prob not in _MIXED:
        _MIXED[norm_topk_prob] = make_tiny_hf_model(
            str(tmp_path_factory.mktemp("moe_ep")), "qwen3_moe", num_hidden_layers=3, mlp_only_layers=[1],
            num_experts=8, num_experts_per_tok=3, norm_topk_prob=norm_topk_prob)
    return _MIXED[norm_topk_prob]


def _logprobs_and_grads(cfg, params, tokens, seg, mesh=None, rules=None):
    def f(p):
        with activation_rules(mesh, rules):
            return jax.value_and_grad(lambda p: sequence_logprobs(p, cfg, tokens, seg)[0].sum())(p)

    return jax.jit(f)(params)


@pytest.mark.parametrize("shape,rules,norm_topk_prob", [
    ({"fsdp": 2, "expert": 4}, "trainer", True),
    ({"data": 2, "expert": 4}, "generator", False),
    pytest.param({"fsdp": 2, "expert": 4}, "trainer", False, marks=pytest.mark.slow),
    pytest.param({"data": 2, "expert": 4}, "generator", True, marks=pytest.mark.slow),
    pytest.param({"expert": 2, "tensor": 2, "fsdp": 2}, "trainer", True, marks=pytest.mark.slow),
])
def test_model_logprobs_and_gradients_equal_one_device(tmp_path_factory, shape, rules, norm_topk_prob, monkeypatch):
    from jaxrl_async.models.shardings import model_shardings

    mixed = _mixed(tmp_path_factory, norm_topk_prob)
    cfg, ref_params = load_hf(mixed)
    rng = np.random.default_rng(2)
    tokens = jnp.asarray(rng.integers(3, cfg.vocab_size, (8, 12)), jnp.int32)
    seg = jnp.asarray(np.r_[np.ones(84), np.ones(7), np.zeros(5)].reshape(8, 12), jnp.int32)
    v_ref, g_ref = _logprobs_and_grads(cfg, ref_params, tokens, seg)
    calls = []
    monkeypatch.setattr(moe_lib, "expert_parallel_swiglu",
                        lambda *a, **kw: calls.append(1) or expert_parallel_swiglu(*a, **kw))
    mesh = make_mesh(shape)
    _, params = load_hf(mixed, shardings=lambda c: model_shardings(c, mesh, rules))
    assert params["layers"]["moe_gate"].addressable_shards[0].data.shape[1] == 8 // shape["expert"]
    v, g = _logprobs_and_grads(cfg, params, tokens, seg, mesh, rules)
    assert calls  # the MoE layers took the expert-parallel path
    np.testing.assert_allclose(float(v), float(v_ref), rtol=1e-6)
    for stack, key in (("layers", "moe_gate"), ("layers", "moe_up"), ("layers", "moe_down"), ("layers", "router"),
                       ("layers", "q"), ("dense_layers", "gate")):
        a, b = np.asarray(g[stack][key]), np.asarray(g_ref[stack][key])
        assert np.abs(b).max() > 1e-2
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, err_msg=f"{stack}/{key}")


def test_generator_on_a_data_x_expert_mesh_matches_transformers_and_the_trainer(tmp_path, monkeypatch):
    import torch
    import transformers

    d = make_tiny_hf_model(str(tmp_path / "moe"), "qwen3_moe", num_experts=8, num_experts_per_tok=2)
    hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    calls = []
    monkeypatch.setattr(moe_lib, "expert_parallel_swiglu",
                        lambda *a, **kw: calls.append(1) or expert_parallel_swiglu(*a, **kw))
    check_engine_against_hf_and_trainer(*load_hf(d), hf, mesh=make_mesh({"data": 2, "expert": 2, "tensor": 1},
                                                                     devices=jax.devices()[:4]))
    assert calls


def test_trainer_step_on_an_fsdp_x_expert_mesh_equals_one_device(monkeypatch):
    """The trainer's whole step (packing rows over data x fsdp x expert, loss, gradients, AdamW) on an
    fsdp 2 x expert 4 mesh: loss, gradient norm and updated parameters equal the one-device step (fp32)."""
    from jaxrl_async.models.config import ModelConfig
    from jaxrl_async.models.transformer import init_params
    from jaxrl_async.rl.losses import PolicyLossConfig
    from jaxrl_async.trainer import OptimizerConfig, PackingConfig, Trainer, TrainStepConfig, TrainSequence

    cfg = ModelConfig(model_type="qwen3_moe", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=8, rope_theta=10000.0, qk_norm=True, num_experts=8,
                      num_experts_per_tok=2, moe_intermediate_size=16)
    params = jax.jit(init_params, static_argnums=(0, 2))(cfg, jax.random.key(0), 0.1)
    lr = 1e-2
    # AdamW's first update is lr g / (|g| + eps): eps 1e-6 (not 1e-8) keeps experts with near-zero gradients from
    # turning fp32 summation-order noise (~1e-11) into update differences of 1e-3 lr
    tcfg = TrainStepConfig(optimizer=OptimizerConfig(lr=lr, eps=1e-6, weight_decay=0.0, max_grad_norm=None),
                         packing=PackingConfig(tokens_per_micro=8 * 16, row_len_buckets=(16,), max_seqs_per_row=1))
    rng = np.random.default_rng(4)
    trajs = []
    for _ in range(8):
        n = int(rng.integers(6, 17))
        mask = (np.arange(n) >= 2).astype(np.int32)
        trajs.append(TrainSequence(tokens=rng.integers(0, cfg.vocab_size, n), loss_mask=mask,
                                behaviour_logprobs=np.where(mask > 0, -rng.uniform(0.5, 4.0, n), 0.0),
                                advantages=np.where(mask > 0, rng.normal(size=n), 0.0),
                                versions=np.where(mask > 0, 2, -1)))
    one = Trainer(cfg, tcfg, loss_cfg=PolicyLossConfig())
    mesh = make_mesh({"fsdp": 2, "expert": 4})
    ep = Trainer(cfg, tcfg, mesh, loss_cfg=PolicyLossConfig())
    assert ep.cfg.packing.row_multiple == 8  # rows split over fsdp x expert
    calls = []
    monkeypatch.setattr(moe_lib, "expert_parallel_swiglu",
                        lambda *a, **kw: calls.append(1) or expert_parallel_swiglu(*a, **kw))
    s8, m8 = ep.train_batch(ep.init_state(params), trajs)
    s1, m1 = one.train_batch(one.init_state(params), trajs)
    assert calls
    assert s8.params["layers"]["moe_gate"].sharding.spec[1] == "expert"
    np.testing.assert_allclose(float(m8[0]["loss"]), float(m1[0]["loss"]), rtol=1e-5)
    np.testing.assert_allclose(float(m8[0]["grad_norm"]), float(m1[0]["grad_norm"]), rtol=1e-5)
    diff = jax.tree.map(lambda a, b: float(np.max(np.abs(np.asarray(a) - np.asarray(b)))), s8.params, s1.params)
    assert max(jax.tree.leaves(diff)) <= 1e-3 * lr, [(jax.tree_util.keystr(k), v)
                                                     for k, v in jax.tree.leaves_with_path(diff) if v > 1e-6]
    moved = jax.tree.map(lambda a, b: float(np.max(np.abs(np.asarray(a) - np.asarray(b)))), s1.params, params)
    assert max(jax.tree.leaves(moved)) > 0.5 * lr
