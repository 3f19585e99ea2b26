"""Logit parity of the JAX model with transformers (torch CPU), fp32 and bf16, padded and packed."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from jaxrl_async.models import ModelConfig, apply, load_hf
from jaxrl_async.testing import TINY_FAMILIES, make_tiny_hf_model


@pytest.fixture(scope="module", params=TINY_FAMILIES)
def tiny(request, tmp_path_factory):
    d = str(tmp_path_factory.mktemp(request.param))
    make_tiny_hf_model(d, request.param)
    hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    return request.param, d, hf


def _hf_logits(hf, tokens, attention_mask=None, position_ids=None):
    with torch.no_grad():
        out = hf(input_ids=torch.tensor(tokens), attention_mask=None if attention_mask is None else torch.tensor(attention_mask),
                 position_ids=None if position_ids is None else torch.tensor(position_ids))
    return out.logits.float().numpy()


def test_config_reads_family(tiny):
    family, d, hf = tiny
    cfg = ModelConfig.from_hf(d)
    assert cfg.head_dim == 24 and cfg.num_heads == 4 and cfg.num_kv_heads == 2
    assert cfg.qkv_bias == (family == "qwen2")
    assert cfg.qk_norm == family.startswith("qwen3")
    assert cfg.tie_word_embeddings == (family == "qwen3")
    assert cfg.rope_type == ("llama3" if family == "llama" else "default")


@pytest.mark.parametrize("scan", [True, False])
def test_fp32_padded_logits(tiny, scan):
    family, d, hf = tiny
    cfg, params = load_hf(d, scan_layers=scan)
    rng = np.random.default_rng(0)
    B, T = 3, 17
    tokens = rng.integers(3, cfg.vocab_size, (B, T))
    lengths = np.array([17, 11, 5])
    mask = (np.arange(T)[None] < lengths[:, None]).astype(np.int64)
    ref = _hf_logits(hf, tokens, mask)
    ours = np.asarray(jax.jit(apply, static_argnums=1)(params, cfg, jnp.asarray(tokens), None, jnp.asarray(mask)))
    diff = np.abs(ours - ref)[mask.astype(bool)]
    assert diff.max() <= 1e-4, diff.max()


def test_fp32_packed_logits(tiny):
    family, d, hf = tiny
    cfg, params = load_hf(d)
    rng = np.random.default_rng(1)
    lens = [7, 5, 9]
    seqs = [rng.integers(3, cfg.vocab_size, n) for n in lens]
    T = 24
    tokens = np.zeros((1, T), np.int64)
    seg = np.zeros((1, T), np.int32)
    pos = np.zeros((1, T), np.int32)
    o = 0
    for k, s in enumerate(seqs):
        tokens[0, o:o + len(s)] = s
        seg[0, o:o + len(s)] = k + 1
        pos[0, o:o + len(s)] = np.arange(len(s))
        o += len(s)
    ours = np.asarray(apply(params, cfg, jnp.asarray(tokens), jnp.asarray(pos), jnp.asarray(seg)))
    o = 0
    worst = 0.0
    for s in seqs:
        ref = _hf_logits(hf, s[None])
        worst = max(worst, float(np.abs(ours[0, o:o + len(s)] - ref[0]).max()))
        o += len(s)
    assert worst <= 1e-4, worst


def test_bf16_kl(tiny):
    family, d, hf = tiny
    cfg, params = load_hf(d, dtype="bfloat16", param_dtype="bfloat16")
    hf16 = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16).eval()
    rng = np.random.default_rng(2)
    tokens = rng.integers(3, cfg.vocab_size, (2, 16))
    ours = _log_softmax(np.asarray(apply(params, cfg, jnp.asarray(tokens)), dtype=np.float64))
    for ref_model in (hf16, hf):  # transformers bf16, and the fp32 truth
        ref = _log_softmax(_hf_logits(ref_model, tokens).astype(np.float64))
        kl = (np.exp(ref) * (ref - ours)).sum(-1).mean()
        assert kl <= 1e-3, kl


def _log_softmax(x):
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))
