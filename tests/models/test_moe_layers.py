"""Qwen3-MoE models with dense MLP layers among the sparse ones (`mlp_only_layers`, `decoder_sparse_step`):
two stacks of layers (`layers`: sparse, `dense_layers`: dense) run as a schedule of same-kind runs, checked
against transformers (logits padded and packed, export, generate), on sharded meshes, with LoRA on the
attention, in the FLOP count and through a run checkpoint."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from jaxrl_async.models import ModelConfig, apply, load_hf
from jaxrl_async.models.hf_io import save_hf
from jaxrl_async.testing import check_engine_against_hf_and_trainer, make_tiny_hf_model

# layer 1 dense by `mlp_only_layers` (runs sparse, dense, sparse x 2); every other layer sparse by
# `decoder_sparse_step` = 2 (dense, sparse, dense, sparse: runs of one)
CASES = {"mlp_only_layers": dict(num_hidden_layers=4, mlp_only_layers=[1]),
         "sparse_step_2": dict(num_hidden_layers=4, decoder_sparse_step=2)}


@pytest.fixture(scope="module", params=list(CASES))
def mixed(request, tmp_path_factory):
    d = make_tiny_hf_model(str(tmp_path_factory.mktemp("mixed")), "qwen3_moe", **CASES[request.param])
    hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    return request.param, d, hf


def _hf_logits(hf, tokens, mask=None):
    with torch.no_grad():
        return hf(input_ids=torch.tensor(tokens), attention_mask=None if mask is None else torch.tensor(mask)
                  ).logits.float().numpy()


def test_stacks_follow_transformers_rule_and_count_its_parameters(mixed):
    case, d, hf = mixed
    cfg, params = load_hf(d)
    dense = [i for i, layer in enumerate(hf.model.layers) if not hasattr(layer.mlp, "experts")]
    assert dense == ([1] if case == "mlp_only_layers" else [0, 2])
    assert cfg.layer_stacks() == {"layers": tuple(i for i in range(4) if i not in dense), "dense_layers": tuple(dense)}
    assert params["dense_layers"]["gate"].shape == (len(dense), 64, 96) and "router" not in params["dense_layers"]
    assert params["layers"]["moe_gate"].shape == (4 - len(dense), 4, 64, 32) and "gate" not in params["layers"]
    n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    assert cfg.num_params() == n == sum(p.numel() for p in hf.parameters())
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg  # the checkpoint manager stores the HF config


def test_model_flops_count_each_layer_kind(mixed):
    """Per token, the model FLOPs of the learnable matmuls are 2 x the active matmul parameters (the dense
    layers' SwiGLU, the sparse layers' router and k experts): checked through num_active_params."""
    from jaxrl_async.trainer.flops import forward_flops

    _, d, _ = mixed
    cfg = ModelConfig.from_hf(d)
    D, E, L, V = cfg.hidden_size, cfg.head_dim, cfg.num_layers, cfg.vocab_size
    non_matmul = V * D * (0 if cfg.tie_word_embeddings else 1) + 2 * L * D + D + 2 * L * E  # lookup and norms
    one_token = forward_flops(cfg, 1, 1) - 4.0 * cfg.num_heads * E / 2 * L  # minus attention at S = 1
    assert one_token == 2.0 * (cfg.num_active_params() - non_matmul)
    all_dense_mlp = cfg.replace(model_type="qwen3", num_experts=0, num_experts_per_tok=0, moe_intermediate_size=0,
                                decoder_sparse_step=1, mlp_only_layers=())
    assert all_dense_mlp.num_params() - cfg.num_params() == len(cfg.sparse_layer_ids) * (
        3 * D * cfg.intermediate_size - 3 * D * cfg.moe_intermediate_size * cfg.num_experts - D * cfg.num_experts)


@pytest.mark.parametrize("scan", [True, False])
def test_fp32_padded_logits_match_transformers(mixed, scan):
    _, d, hf = mixed
    cfg, params = load_hf(d, scan_layers=scan)
    rng = np.random.default_rng(0)
    B, T = 3, 17
    tokens = rng.integers(3, cfg.vocab_size, (B, T))
    mask = (np.arange(T)[None] < np.array([17, 11, 5])[:, None]).astype(np.int64)
    ours = np.asarray(jax.jit(apply, static_argnums=1)(params, cfg, jnp.asarray(tokens), None, jnp.asarray(mask)))
    diff = np.abs(ours - _hf_logits(hf, tokens, mask))[mask.astype(bool)]
    assert diff.max() <= 1e-4, diff.max()


def test_fp32_packed_logits_match_transformers(mixed):
    _, d, hf = mixed
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


def test_export_roundtrip_identical_logits(mixed, tmp_path):
    _, d, hf = mixed
    cfg, params = load_hf(d)
    out = str(tmp_path / "export")
    save_hf(params, cfg, out)
    written = json.load(open(os.path.join(out, "config.json")))
    src = json.load(open(os.path.join(d, "config.json")))
    assert (written["mlp_only_layers"], written["decoder_sparse_step"]) == (src["mlp_only_layers"],
                                                                           src["decoder_sparse_step"])
    hf2 = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokens = np.random.default_rng(4).integers(3, cfg.vocab_size, (2, 11))
    np.testing.assert_array_equal(_hf_logits(hf2, tokens), _hf_logits(hf, tokens))


def test_generator_greedy_matches_transformers_and_logprobs_match_the_trainer(mixed):
    _, d, hf = mixed
    check_engine_against_hf_and_trainer(*load_hf(d), hf)


@pytest.mark.parametrize("shape,rules", [({"expert": 4, "fsdp": 2}, "trainer"), ({"expert": 2, "tensor": 4}, "trainer"),
                                         ({"data": 2, "expert": 4}, "generator")])
def test_sharded_import_equals_one_device(mixed, shape, rules):
    from jaxrl_async.models.shardings import model_shardings
    from jaxrl_async.sharding import make_mesh

    _, d, _ = mixed
    cfg, ref_params = load_hf(d)
    tokens = jnp.asarray(np.random.default_rng(0).integers(3, cfg.vocab_size, (4, 16)))
    ref = np.asarray(apply(ref_params, cfg, tokens))
    mesh = make_mesh(shape)
    cfg, params = load_hf(d, shardings=lambda c: model_shardings(c, mesh, rules))
    assert "expert" in str(params["layers"]["moe_gate"].sharding.spec)
    for stack in ("layers", "dense_layers"):
        for k in params[stack]:
            np.testing.assert_array_equal(np.asarray(params[stack][k]), np.asarray(ref_params[stack][k]))
    out = np.asarray(jax.jit(apply, static_argnums=1)(params, cfg, tokens))
    np.testing.assert_allclose(out, ref, atol=2e-5, rtol=0)


def test_lora_on_attention_covers_both_stacks(mixed):
    """Adapters on q and v live in both stacks; the adapted forward equals the merged weights', and the
    PEFT export names every model layer once (slice s of a stack is its model layer)."""
    from jaxrl_async.cli.export import peft_adapter_tensors
    from jaxrl_async.models import lora
    from jaxrl_async.models import transformer

    _, d, _ = mixed
    cfg, base = load_hf(d)
    cfg = cfg.replace(lora=lora.LoraSpec(rank=2, alpha=4.0, targets=("q", "v")))
    adapters = transformer.init_adapters(cfg, jax.random.key(0))
    assert set(adapters) == {"layers", "dense_layers"}
    rng = np.random.default_rng(2)
    adapters = jax.tree.map(lambda a: jnp.asarray(rng.standard_normal(a.shape) * 0.3, jnp.float32), adapters)
    params = lora.join(adapters, base)
    assert lora.has_adapters(params)
    tokens = jnp.asarray(rng.integers(3, cfg.vocab_size, (2, 9)))
    with_adapters = np.asarray(apply(params, cfg, tokens))
    merged = np.asarray(apply(lora.merge(params, cfg.lora), cfg.replace(lora=None), tokens))
    assert np.abs(with_adapters - np.asarray(apply(base, cfg.replace(lora=None), tokens))).max() > 1e-2
    np.testing.assert_allclose(with_adapters, merged, atol=2e-5, rtol=0)
    names = peft_adapter_tensors(params, cfg)
    for i in range(cfg.num_layers):
        stack = "layers" if cfg.is_sparse_layer(i) else "dense_layers"
        s = cfg.layer_stacks()[stack].index(i)
        a = names[f"base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight"]
        np.testing.assert_array_equal(a, np.asarray(adapters[stack]["q_lora_a"][s]).reshape(-1, 2).T)
    assert len(names) == cfg.num_layers * 2 * 2


def test_checkpoint_round_trip_keeps_both_stacks_and_the_layer_kinds(mixed, tmp_path):
    """The run checkpoint (Orbax, `checkpoint.Checkpointer`) stores the model config as its HF config: the
    layer kinds survive, and both stacks restore exactly onto a sharded target."""
    from jaxrl_async.checkpoint import Checkpointer, TrainMeta, abstract_like, rng_to_json
    from jaxrl_async.models.shardings import model_shardings
    from jaxrl_async.sharding import make_mesh

    _, d, _ = mixed
    mesh = make_mesh({"fsdp": 4, "expert": 2})
    cfg, params = load_hf(d, shardings=lambda c: model_shardings(c, mesh, "trainer"))
    meta = TrainMeta(step=3, policy_version=3, rng={"train": rng_to_json(jax.random.key(0))}, data_state={},
                     staleness={}, config={})
    run = str(tmp_path / "run")
    with Checkpointer(run, model_config=cfg) as ck:
        ck.save({"params": params}, meta)
        ck.wait()
    r = Checkpointer(run, model_config=cfg).restore(targets={"params": abstract_like(params)})
    assert r.model_config == cfg and r.model_config.layer_stacks() == cfg.layer_stacks()
    for stack in ("layers", "dense_layers"):
        for k, v in params[stack].items():
            np.testing.assert_array_equal(np.asarray(r.arrays["params"][stack][k]), np.asarray(v))
            assert r.arrays["params"][stack][k].sharding == v.sharding
