"""HF import/export: round trips through transformers, tied/untied files, sharded files, errors."""
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from jaxrl_async.models import CheckpointMismatchError, ModelConfig, UnsupportedModelError, apply, load_hf, save_hf
from jaxrl_async.models.safetensors_io import INDEX_NAME, SafetensorsReader, write_safetensors
from jaxrl_async.testing import make_tiny_hf_model


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    out = {}
    for fam in ("qwen3", "qwen3_untied", "qwen2", "llama"):
        out[fam] = make_tiny_hf_model(str(tmp_path_factory.mktemp(fam)), fam)
    return out


def _tokens(cfg, B=2, T=12, seed=0):
    return np.random.default_rng(seed).integers(3, cfg.vocab_size, (B, T))


def _hf_logits(model_dir, tokens):
    m, info = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, output_loading_info=True)
    with torch.no_grad():
        logits = m.eval()(input_ids=torch.tensor(tokens)).logits.float().numpy()
    return logits, info


@pytest.mark.parametrize("family", ["qwen3", "qwen3_untied", "qwen2", "llama"])
@pytest.mark.parametrize("max_shard_bytes", [2**30, 40_000])
def test_export_round_trip(tiny_dirs, tmp_path, family, max_shard_bytes):
    cfg, params = load_hf(tiny_dirs[family])
    out = str(tmp_path / "export")
    names = save_hf(params, cfg, out, max_shard_bytes=max_shard_bytes)
    assert (len(names) > 1) == (max_shard_bytes < 2**30)
    assert os.path.exists(os.path.join(out, INDEX_NAME)) == (len(names) > 1)
    tokens = _tokens(cfg)
    ref, info = _hf_logits(out, tokens)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    ours = np.asarray(apply(params, cfg, jnp.asarray(tokens)))
    assert np.abs(ours - ref).max() <= 1e-5
    # tied embeddings are written the way transformers expects
    keys = SafetensorsReader.from_dir(out).keys()
    assert ("lm_head.weight" in keys) == (not cfg.tie_word_embeddings)
    exported = json.load(open(os.path.join(out, "config.json")))
    assert exported["tie_word_embeddings"] == cfg.tie_word_embeddings
    assert os.path.exists(os.path.join(out, "generation_config.json"))
    # and re-import gives identical parameters
    cfg2, params2 = load_hf(out)
    assert cfg2.replace(dtype=cfg.dtype) == cfg
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params2)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bf16_export_and_import(tiny_dirs, tmp_path):
    cfg, params = load_hf(tiny_dirs["qwen3"])
    out = str(tmp_path / "bf16")
    save_hf(params, cfg, out, dtype="bfloat16")
    m = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert next(m.parameters()).dtype == torch.bfloat16
    cfg2, p2 = load_hf(out, param_dtype="float32")
    np.testing.assert_allclose(np.asarray(p2["embed"]), np.asarray(params["embed"]), rtol=1e-2, atol=1e-2)


def test_tied_file_with_redundant_lm_head_imports(tiny_dirs, tmp_path):
    src = tiny_dirs["qwen3"]
    d = str(tmp_path / "tied_with_head")
    shutil.copytree(src, d)
    reader = SafetensorsReader.from_dir(d)
    tensors = {k: np.array(reader.get(k)) for k in reader.keys()}
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
    del reader
    write_safetensors(os.path.join(d, "model.safetensors"), tensors)
    cfg, params = load_hf(d)
    assert cfg.tie_word_embeddings and "lm_head" not in params


def test_tokenizer_files_copied(tiny_dirs, tmp_path):
    cfg, params = load_hf(tiny_dirs["qwen3"])
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    (tok_dir / "tokenizer.json").write_text("{}")
    (tok_dir / "tokenizer_config.json").write_text("{}")
    out = tmp_path / "exp"
    save_hf(params, cfg, str(out), tokenizer_dir=str(tok_dir))
    assert (out / "tokenizer.json").exists() and (out / "tokenizer_config.json").exists()


def _rewrite(d, mutate):
    reader = SafetensorsReader.from_dir(d)
    tensors = {k: np.array(reader.get(k)) for k in reader.keys()}
    del reader
    mutate(tensors)
    write_safetensors(os.path.join(d, "model.safetensors"), tensors)


def test_errors_name_the_tensors(tiny_dirs, tmp_path):
    d = str(tmp_path / "bad")
    shutil.copytree(tiny_dirs["qwen2"], d)
    _rewrite(d, lambda t: (t.pop("model.layers.1.self_attn.k_proj.bias"),
                           t.__setitem__("model.layers.0.extra.weight", np.zeros(3, np.float32)),
                           t.__setitem__("model.layers.0.mlp.up_proj.weight", np.zeros((5, 64), np.float32))))
    with pytest.raises(CheckpointMismatchError) as e:
        load_hf(d)
    msg = str(e.value)
    assert "model.layers.1.self_attn.k_proj.bias" in msg
    assert "model.layers.0.extra.weight" in msg
    assert "model.layers.0.mlp.up_proj.weight" in msg and "(5, 64)" in msg
    assert d in msg


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        load_hf(str(tmp_path))
    with pytest.raises(UnsupportedModelError, match="rope"):
        ModelConfig.from_hf({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 10,
                             "intermediate_size": 8, "num_hidden_layers": 1,
                             "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}})


def test_rope_theta_top_level_legacy():
    base = {"model_type": "qwen3", "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 10,
            "intermediate_size": 8, "num_hidden_layers": 1}
    assert ModelConfig.from_hf({**base, "rope_theta": 12345.0}).rope_theta == 12345.0
    assert ModelConfig.from_hf({**base, "rope_parameters": {"rope_theta": 777.0, "rope_type": "default"}}).rope_theta == 777.0
