"""Export of a mixture-of-experts LoRA checkpoint (adapters on attention and on the experts' gate/up/down):
merged Hugging Face weights, and a PEFT adapter directory in PEFT's fused-expert form
(``target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]``) that
``peft.PeftModel.from_pretrained`` loads onto the transformers Qwen3-MoE base; both reproduce our logits
(fp32, <= 1e-5 as the dense LoRA export tests)."""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest

from jaxrl_async.checkpoint import CheckpointConfig, Checkpointer, TrainMeta
from jaxrl_async.cli.export import main, peft_adapter_tensors
from jaxrl_async.models import apply, load_hf, lora, transformer
from jaxrl_async.testing import make_tiny_hf_model, make_tiny_tokenizer

TOKENS = np.array([[1, 17, 42, 99, 3, 250, 7, 64], [1, 5, 5, 200, 31, 8, 2, 0]], np.int32)
CASES = {  # a sparse-only model with every target; gate alone of the fused gate_up + down, on 3 layers
    "moe": (dict(), ("q", "k", "v", "o", "gate", "up", "down")),
    "gate_down": (dict(num_hidden_layers=3), ("v", "gate", "down")),
}


@pytest.fixture(scope="module", params=list(CASES))
def run(request, tmp_path_factory):
    """A run dir whose checkpoint holds a tiny Qwen3-MoE base + trained-looking adapters (B != 0)."""
    overrides, targets = CASES[request.param]
    root = tmp_path_factory.mktemp("moe_lora_export_" + request.param)
    hf_dir = make_tiny_hf_model(str(root / "hf"), "qwen3_moe", seed=3, **overrides)
    tok_dir = make_tiny_tokenizer(str(root / "tok"))
    cfg, base = load_hf(hf_dir)
    cfg = cfg.replace(lora=lora.LoraSpec(rank=3, alpha=5.0, targets=targets))
    adapters = transformer.init_adapters(cfg, jax.random.key(1))
    out = {}
    for stack, a in adapters.items():
        keys = jax.random.split(jax.random.fold_in(jax.random.key(2), len(out)), len(a))
        out[stack] = {k: (v if k.endswith("_a") else 0.2 * jax.random.normal(kk, v.shape))
                      for kk, (k, v) in zip(keys, sorted(a.items()))}
    params = lora.join(out, base)
    run_dir = str(root / "run")
    with Checkpointer(run_dir, CheckpointConfig(keep_last=2), model_config=cfg, tokenizer_dir=tok_dir) as ck:
        ck.save({"params": params}, TrainMeta(step=1, policy_version=1))
    ours = np.asarray(jax.jit(apply, static_argnums=1)(params, cfg, TOKENS))
    base_logits = np.asarray(jax.jit(apply, static_argnums=1)(base, cfg.replace(lora=None), TOKENS))
    assert np.abs(ours - base_logits).max() > 1e-2  # the adapters matter
    return request.param, run_dir, params, cfg, ours


def _logits(model):
    import torch

    with torch.no_grad():
        return model(torch.tensor(TOKENS, dtype=torch.long)).logits.float().numpy()


def _hf_model(d):
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()


def test_merged_export_reproduces_the_lora_logits(run, tmp_path):
    _, run_dir, _, _, ours = run
    out = str(tmp_path / "merged")
    assert main(["--run-dir", run_dir, "--out", out]) == 0
    got = _logits(_hf_model(out))
    print(f"merged export vs ours ({run[0]}): max abs {np.abs(got - ours).max():.2e} (|logit| <= {np.abs(ours).max():.1f})")
    np.testing.assert_allclose(got, ours, atol=1e-5, rtol=0)


def test_peft_export_loads_onto_the_transformers_base_and_reproduces_the_logits(run, tmp_path):
    import peft

    case, run_dir, params, cfg, ours = run
    out = str(tmp_path / "peft")
    assert main(["--run-dir", run_dir, "--out", out, "--lora", "peft"]) == 0
    conf = json.load(open(os.path.join(out, "adapter_config.json")))
    assert conf["r"] == 3 and conf["lora_alpha"] == 5.0 and conf["lora_dropout"] == 0.0
    assert conf["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    attn = {"moe": ["q_proj", "k_proj", "v_proj", "o_proj"], "gate_down": ["v_proj"]}[case]
    assert sorted(conf["target_modules"]) == sorted(attn)
    base = _hf_model(conf["base_model_name_or_path"])
    model = peft.PeftModel.from_pretrained(base, out).eval()
    # every saved tensor was loaded onto a module of the model (none silently ignored)
    loaded = {n.replace(".default", ""): p for n, p in model.named_parameters() if "lora_" in n}
    saved = peft_adapter_tensors(params, cfg)
    assert len(saved) == len(loaded) and all(k in loaded for k in saved), sorted(set(saved) ^ set(loaded))[:4]
    for k, v in saved.items():
        np.testing.assert_array_equal(loaded[k].detach().numpy(), v)
    got = _logits(model)
    print(f"PEFT vs ours ({case}): max abs {np.abs(got - ours).max():.2e} (|logit| <= {np.abs(ours).max():.1f})")
    np.testing.assert_allclose(got, ours, atol=1e-5, rtol=0)
    merged = _logits(model.merge_and_unload())
    print(f"PEFT merge_and_unload vs ours ({case}): max abs {np.abs(merged - ours).max():.2e}")
    np.testing.assert_allclose(merged, ours, atol=1e-5, rtol=0)


def test_peft_expert_tensor_layout():
    """The relayout itself (PEFT's ParamWrapper): lora_A [X r, in] expert-major rows, lora_B [out, r X]
    expert-minor columns, gate_up's B rows = [gate | up] with an unadapted half zero, nesting names."""
    from jaxrl_async.checkpoint.hf_export import peft_expert_tensors as _peft_expert_tensors

    X, D, F, r = 3, 5, 4, 2
    rng = np.random.default_rng(0)
    a_gu, b_g = rng.standard_normal((1, X, D, r)), rng.standard_normal((1, X, r, 1, F))
    a_d, b_d = rng.standard_normal((1, X, F, r)), rng.standard_normal((1, X, r, D))
    spec = lora.LoraSpec(rank=r, alpha=2.0, targets=("gate", "down"))
    t = _peft_expert_tensors({"moe_gate_up_lora_a": a_gu, "moe_gate_up_lora_b": b_g, "moe_down_lora_a": a_d,
                              "moe_down_lora_b": b_d}, spec, 0, "p")
    assert sorted(t) == ["p.base_layer.lora_A.weight", "p.base_layer.lora_B.weight", "p.lora_A.weight",
                         "p.lora_B.weight"]
    A, B = t["p.base_layer.lora_A.weight"], t["p.base_layer.lora_B.weight"]
    assert A.shape == (X * r, D) and B.shape == (2 * F, r * X)
    # PEFT's delta of expert e on the [X, out, in] parameter: einsum("o r e, e r i -> e o i")
    delta = np.einsum("ore,eri->eoi", B.reshape(2 * F, r, X), A.reshape(X, r, D))
    for e in range(X):
        np.testing.assert_allclose(delta[e, :F], (a_gu[0, e] @ b_g[0, e, :, 0]).T, rtol=1e-6)
        assert not np.any(delta[e, F:])  # up is not adapted
    delta_d = np.einsum("ore,eri->eoi", t["p.lora_B.weight"].reshape(D, r, X), t["p.lora_A.weight"].reshape(X, r, F))
    np.testing.assert_allclose(delta_d[1], (a_d[0, 1] @ b_d[0, 1]).T, rtol=1e-6)
    only_down = _peft_expert_tensors({"moe_down_lora_a": a_d, "moe_down_lora_b": b_d},
                                     lora.LoraSpec(rank=r, targets=("down",)), 0, "p")
    assert sorted(only_down) == ["p.lora_A.weight", "p.lora_B.weight"]


def test_peft_export_of_dense_mlp_adapters_in_a_mixed_model_is_refused(tmp_path, capsys):
    """PEFT (0.21, transformers 5) rewrites gate_proj/up_proj/down_proj target_modules of a Qwen3-MoE model
    onto its experts: a model with dense-MLP layers and gate/up/down targets exports merged only (one line
    naming the field); its merged export reproduces the logits."""
    hf_dir = make_tiny_hf_model(str(tmp_path / "hf"), "qwen3_moe", seed=3, num_hidden_layers=3, mlp_only_layers=[1])
    cfg, base = load_hf(hf_dir)
    cfg = cfg.replace(lora=lora.LoraSpec(rank=2, alpha=3.0, targets=("q", "down")))
    adapters = transformer.init_adapters(cfg, jax.random.key(1))
    adapters = {s: {k: v if k.endswith("_a") else v + 0.3 for k, v in a.items()} for s, a in adapters.items()}
    params = lora.join(adapters, base)
    run_dir = str(tmp_path / "run")
    with Checkpointer(run_dir, CheckpointConfig(keep_last=2), model_config=cfg) as ck:
        ck.save({"params": params}, TrainMeta(step=1, policy_version=1))
    capsys.readouterr()
    assert main(["--run-dir", run_dir, "--out", str(tmp_path / "peft"), "--lora", "peft"]) == 2
    err = [ln for ln in capsys.readouterr().err.strip().splitlines() if "error" in ln]  # (+ a no-tokenizer warning)
    assert len(err) == 1 and "--lora peft: model.lora.targets ['down'] on a mixture of experts" in err[0], err
    assert main(["--run-dir", run_dir, "--out", str(tmp_path / "merged")]) == 0
    ours = np.asarray(jax.jit(apply, static_argnums=1)(params, cfg, TOKENS))
    np.testing.assert_allclose(_logits(_hf_model(str(tmp_path / "merged"))), ours, atol=1e-5, rtol=0)
