"""Qwen3-MoE (`models/moe.py`): tiny random models made with transformers (4 experts, top-2, `norm_topk_prob`
both ways). fp32 logits vs transformers (padded, packed, scanned and unrolled layers); the dropless grouped
matmul vs a dense every-expert reference; export -> transformers -> identical logits; sharded import over
expert x fsdp and expert x tensor meshes; the paged generator's greedy tokens vs transformers `generate`
and its behaviour log-probs vs the trainer's."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from jaxrl_async.models import ModelConfig, apply, load_hf, sequence_logprobs
from jaxrl_async.models.config import preset
from jaxrl_async.models.hf_io import save_hf
from jaxrl_async.models.moe import grouped_swiglu, load_balancing_loss, routing
from jaxrl_async.testing import (
    check_engine_against_hf_and_trainer, grouped_matmul_against_ragged_dot, make_tiny_hf_model,
)


@pytest.fixture(scope="module", params=[True, False], ids=["norm_topk", "no_norm_topk"])
def moe(request, tmp_path_factory):
    d = make_tiny_hf_model(str(tmp_path_factory.mktemp("moe")), "qwen3_moe", norm_topk_prob=request.param)
    hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    return d, hf


def _hf_logits(hf, tokens, mask=None):
    with torch.no_grad():
        return hf(input_ids=torch.tensor(tokens), attention_mask=None if mask is None else torch.tensor(mask)
                  ).logits.float().numpy()


def test_config_and_presets(moe):
    d, _ = moe
    cfg = ModelConfig.from_hf(d)
    hf_cfg = json.load(open(os.path.join(d, "config.json")))
    assert (cfg.model_type, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == ("qwen3_moe", 4, 2, 32)
    assert cfg.norm_topk_prob == hf_cfg["norm_topk_prob"] and cfg.qk_norm
    p30, p235 = preset("qwen3-30b-a3b"), preset("qwen3-235b-a22b")  # published sizes: 30.5B / 3.3B active
    assert abs(p30.num_params() / 1e9 - 30.5) < 0.05 and abs(p30.num_active_params() / 1e9 - 3.3) < 0.1
    assert round(p235.num_params() / 1e9) == 235 and round(p235.num_active_params() / 1e9) == 22


def test_layer_kinds_are_validated():
    """Dense layers among sparse ones are supported (tests/models/test_moe_layers.py); a schedule without a
    sparse layer, or out-of-range dense layers, is refused naming the field."""
    cfg = preset("qwen3-30b-a3b").replace(num_layers=4)
    with pytest.raises(ValueError, match="ModelConfig.mlp_only_layers: no sparse layer"):
        cfg.replace(mlp_only_layers=(0, 1, 2, 3))
    with pytest.raises(ValueError, match=r"ModelConfig.mlp_only_layers: \[7\] are not layer indices"):
        cfg.replace(mlp_only_layers=[7])
    with pytest.raises(ValueError, match="ModelConfig.decoder_sparse_step"):
        cfg.replace(decoder_sparse_step=0)


@pytest.mark.parametrize("scan", [True, False])
def test_fp32_padded_logits_match_transformers(moe, scan):
    d, hf = moe
    cfg, params = load_hf(d, scan_layers=scan)
    rng = np.random.default_rng(0)
    B, T = 3, 17
    tokens = rng.integers(3, cfg.vocab_size, (B, T))
    mask = (np.arange(T)[None] < np.array([17, 11, 5])[:, None]).astype(np.int64)
    ours = np.asarray(jax.jit(apply, static_argnums=1)(params, cfg, jnp.asarray(tokens), None, jnp.asarray(mask)))
    diff = np.abs(ours - _hf_logits(hf, tokens, mask))[mask.astype(bool)]
    assert diff.max() <= 1e-4, diff.max()


def test_fp32_packed_logits_match_transformers(moe):
    d, hf = moe
    cfg, params = load_hf(d)
    rng = np.random.default_rng(1)
    seqs = [rng.integers(3, cfg.vocab_size, n) for n in (7, 5, 9)]
    tokens, seg, pos = np.zeros((1, 24), np.int64), np.zeros((1, 24), np.int32), np.zeros((1, 24), np.int32)
    o = 0
    for k, s in enumerate(seqs):
        tokens[0, o:o + len(s)], seg[0, o:o + len(s)], pos[0, o:o + len(s)] = s, k + 1, np.arange(len(s))
        o += len(s)
    ours = np.asarray(apply(params, cfg, jnp.asarray(tokens), jnp.asarray(pos), jnp.asarray(seg)))
    o, worst = 0, 0.0
    for s in seqs:
        worst = max(worst, float(np.abs(ours[0, o:o + len(s)] - _hf_logits(hf, s[None])[0]).max()))
        o += len(s)
    assert worst <= 1e-4, worst


def _dense_swiglu(x, ids, w, wg, wu, wd, impl=None):
    """Reference MoE MLP: every expert on every token, weighted by the routing weights of the chosen ones."""
    every = jnp.stack([(jax.nn.silu(x @ wg[e]) * (x @ wu[e])) @ wd[e] for e in range(wg.shape[0])], axis=1)
    dense_w = jnp.zeros((x.shape[0], wg.shape[0])).at[jnp.arange(x.shape[0])[:, None], ids].set(w)
    return jnp.einsum("nx,nxd->nd", dense_w, every)


def test_grouped_matmul_equals_every_expert_dense_reference():
    """Dropless: every (token, choice) pair is computed, whatever the load (here one expert gets most)."""
    rng = np.random.default_rng(3)
    N, D, F, X, k = 37, 16, 8, 5, 3
    x = jnp.asarray(rng.standard_normal((N, D)), jnp.float32)
    router = jnp.asarray(rng.standard_normal((D, X)), jnp.float32)
    wg, wu = (jnp.asarray(rng.standard_normal((X, D, F)), jnp.float32) for _ in range(2))
    wd = jnp.asarray(rng.standard_normal((X, F, D)), jnp.float32)
    ids, w, logits = routing(x, router, k, True)
    skewed = jnp.tile(jnp.asarray([[2, 0, 1]]), (N, 1)).at[:5].set(jnp.asarray([4, 3, 2]))  # expert 2 takes all
    for case_ids in (ids, skewed):
        case_w = jnp.take_along_axis(jax.nn.softmax(logits, -1), case_ids, -1)
        out = grouped_swiglu(x, case_ids, case_w, wg, wu, wd)
        ref = _dense_swiglu(x, case_ids, case_w, wg, wu, wd)
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5)
    assert float(load_balancing_loss(logits, skewed)) > float(load_balancing_loss(logits, ids))
    # replay: imposing the same ids reproduces the weights; other ids are honoured exactly
    ids2, w2, _ = routing(x, router, k, True, expert_ids=ids)
    np.testing.assert_array_equal(np.asarray(ids2), np.asarray(ids))
    np.testing.assert_allclose(np.asarray(w2), np.asarray(w), rtol=1e-6)
    forced = jnp.tile(jnp.asarray([[0, 1, 4]]), (N, 1))
    ids3, w3, _ = routing(x, router, k, True, expert_ids=forced)
    np.testing.assert_array_equal(np.asarray(ids3), np.asarray(forced))
    np.testing.assert_allclose(np.asarray(w3.sum(-1)), 1.0, rtol=1e-6)
    aux = float(load_balancing_loss(logits, ids))
    assert aux > 1.0  # imbalanced routing costs more than the balanced optimum (1.0 for uniform routing)


def test_export_roundtrip_identical_logits(moe, tmp_path):
    d, hf = moe
    cfg, params = load_hf(d)
    out = str(tmp_path / "export")
    save_hf(params, cfg, out)
    hf2 = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokens = np.random.default_rng(4).integers(3, cfg.vocab_size, (2, 11))
    np.testing.assert_array_equal(_hf_logits(hf2, tokens), _hf_logits(hf, tokens))


@pytest.mark.parametrize("shape,rules", [({"expert": 4, "fsdp": 2}, "trainer"), ({"expert": 2, "tensor": 4}, "trainer"),
                                         ({"data": 2, "expert": 4}, "generator")])
def test_sharded_import_over_experts_equals_one_device(moe, shape, rules):
    from jaxrl_async.models.shardings import model_shardings
    from jaxrl_async.sharding import make_mesh

    d, _ = moe
    cfg, ref_params = load_hf(d)
    tokens = jnp.asarray(np.random.default_rng(0).integers(3, cfg.vocab_size, (4, 16)))
    ref = np.asarray(apply(ref_params, cfg, tokens))
    mesh = make_mesh(shape)
    cfg, params = load_hf(d, shardings=lambda c: model_shardings(c, mesh, rules))
    w = params["layers"]["moe_gate"]
    assert "expert" in str(w.sharding.spec) and w.addressable_shards[0].data.shape[1] == 4 // shape["expert"]
    out = np.asarray(jax.jit(apply, static_argnums=1)(params, cfg, tokens))
    np.testing.assert_allclose(out, ref, atol=2e-5, rtol=0)


def test_generator_greedy_matches_transformers_and_logprobs_match_the_trainer(moe):
    d, hf = moe
    check_engine_against_hf_and_trainer(*load_hf(d), hf)


def test_parameter_gradients_equal_the_dense_reference(moe, monkeypatch):
    """Training differentiates through the sort, ragged_dot and scatter-add: parameter gradients of the
    log-likelihood equal those of a dense every-expert implementation (fp32)."""
    from jaxrl_async.models import moe as moe_lib

    d, _ = moe
    cfg, params = load_hf(d)
    rng = np.random.default_rng(6)
    tokens = jnp.asarray(rng.integers(3, cfg.vocab_size, (2, 12)), jnp.int32)
    seg = jnp.asarray(np.r_[np.ones(12), np.r_[np.ones(8), np.zeros(4)]].reshape(2, 12), jnp.int32)

    def loss(p):
        return sequence_logprobs(p, cfg, tokens, seg)[0].sum()

    g_grouped = jax.grad(loss)(params)

    monkeypatch.setattr(moe_lib, "grouped_swiglu", _dense_swiglu)
    g_dense = jax.grad(loss)(params)
    for key in ("moe_gate", "moe_up", "moe_down", "router", "q"):
        a, b = np.asarray(g_grouped["layers"][key]), np.asarray(g_dense["layers"][key])
        assert np.abs(a).max() > 0
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6, err_msg=key)


def test_lora_on_expert_mlps_takes_no_dropout():
    """Expert adapters exist (tests/models/test_moe_lora.py) but, as PEFT's target_parameters, without dropout:
    the refusal names the field."""
    from jaxrl_async.models.lora import LoraSpec

    cfg = preset("qwen3-30b-a3b")
    with pytest.raises(ValueError, match=r"^ModelConfig\.lora\.dropout: 0.1: the expert adapters"):
        cfg.replace(lora=LoraSpec(rank=8, alpha=16.0, targets=("q", "gate"), dropout=0.1))
    assert cfg.replace(lora=LoraSpec(rank=8, alpha=16.0, targets=("q", "v"), dropout=0.1)).lora.rank == 8
    assert cfg.replace(lora=LoraSpec(rank=8, alpha=16.0, targets=("q", "gate"))).lora.targets == ("q", "gate")


@pytest.mark.parametrize("tile", [1, 4, 16, 64])
def test_tiled_grouped_matmul_equals_ragged_dot_values_and_gradients(tile):
    """The GPU path (single-expert tiles, groups padded to the tile, empty groups, a group larger than many
    tiles) equals ragged_dot in fp32, and so do the gradients of rows and weights."""
    from jaxrl_async.kernels.grouped_matmul import tiled_grouped_matmul

    out, ref, gt, gr = grouped_matmul_against_ragged_dot(
        lambda r, w, g: tiled_grouped_matmul(r, w, g, jnp.float32, tile), [0, 13, 1, 0, 40, 6], K=8, F=5)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-6, atol=1e-6)
    for a, b in zip(gr, gt):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6)
