"""Helpers that build tiny, random Hugging Face checkpoints locally (no hub access).

Used by the tests, the benchmarks and the examples: `make_tiny_hf_model(dir, "qwen3")` writes a
`save_pretrained` directory of a small model of the requested family whose weights are
random with non-trivial norms and biases (so parity checks exercise every tensor).
"""

from __future__ import annotations

import os
from typing import Any

TINY_FAMILIES = ("qwen3", "qwen3_untied", "qwen2", "llama")
MOE_FAMILIES = ("qwen3_moe",)


def tiny_hf_config(family: str, vocab_size: int = 256, **overrides) -> Any:
    """A transformers config of a tiny model: head_dim != hidden/heads, GQA ratio 2."""
    import transformers

    common: dict[str, Any] = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=24, max_position_embeddings=512,
        rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    if family in ("qwen3", "qwen3_untied"):
        common.update(tie_word_embeddings=family == "qwen3", rope_parameters={"rope_theta": 10000.0, "rope_type": "default"})
        common.update(overrides)
        return transformers.Qwen3Config(**common)
    if family == "qwen2":
        common.update(tie_word_embeddings=False, rope_parameters={"rope_theta": 10000.0, "rope_type": "default"})
        common.update(overrides)
        return transformers.Qwen2Config(**common)
    if family == "llama":
        common.update(tie_word_embeddings=False, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
        common.update(overrides)
        return transformers.LlamaConfig(**common)
    if family == "qwen3_moe":  # 4 experts, top-2, every layer sparse
        common.update(tie_word_embeddings=False, rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
                      num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                      decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.001)
        common.update(overrides)
        return transformers.Qwen3MoeConfig(**common)
    raise ValueError(f"unknown tiny family {family!r}; known: {TINY_FAMILIES + MOE_FAMILIES}")


def make_tiny_hf_model(out_dir: str, family: str = "qwen3", seed: int = 0, std: float = 0.15, **overrides) -> str:
    """Write a random tiny model of `family` with `save_pretrained` into out_dir; returns out_dir."""
    import torch
    import transformers

    cfg = tiny_hf_config(family, **overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    _randomise(model, std, ("norm.weight",))
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    return out_dir


def _randomise(model, std: float, norm_suffixes: tuple[str, ...]) -> None:
    """Random weights in place (torch's global generator): norm scales 1 + 0.2 N(0, 1), biases 0.2 N(0, 1), the
    rest std N(0, 1), in parameter order."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(norm_suffixes):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn_like(p))
            else:
                p.copy_(std * torch.randn_like(p))


# special tokens of the tiny Qwen2.5-VL (`make_tiny_vl_model`): inside the 256-token vocabulary
TINY_VL_TOKENS = dict(image_token_id=250, video_token_id=251, vision_start_token_id=252, vision_end_token_id=253)


def tiny_vl_config(vocab_size: int = 256, tie_word_embeddings: bool = False, **vision_overrides) -> Any:
    """A transformers ``Qwen2_5_VLConfig`` of a tiny model: a 2-layer qwen2 text model (head_dim 16, GQA 2, M-RoPE
    sections 2/3/3) and a 3-block vision tower (4 x 4 pixel patches, 2 x 2 merge, windows of 2 x 2 merge units
    with block 1 attending fully)."""
    import transformers

    vision = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, in_channels=3, patch_size=4,
                  spatial_merge_size=2, temporal_patch_size=2, window_size=16, out_hidden_size=64,
                  fullatt_block_indexes=[1])
    vision.update(vision_overrides)
    text = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
                bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=tie_word_embeddings)
    return transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=tie_word_embeddings,
                                         **TINY_VL_TOKENS)


def make_tiny_vl_model(out_dir: str, seed: int = 0, std: float = 0.15, **overrides) -> str:
    """Write a random tiny ``Qwen2_5_VLForConditionalGeneration`` (`tiny_vl_config`) with ``save_pretrained``
    (norms 1 + noise, non-zero biases, as `make_tiny_hf_model`); returns out_dir."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.Qwen2_5_VLForConditionalGeneration(tiny_vl_config(**overrides)).to(torch.float32)
    _randomise(model, std, ("norm.weight", "norm1.weight", "norm2.weight", "ln_q.weight"))
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    return out_dir


def make_tiny_vl_tokenizer(out_dir: str, vocab_size: int = 256) -> str:
    """Save a character-level tokenizer with Qwen2.5-VL's special tokens and chat template into out_dir (nothing
    downloaded): ids 0..2 ``<|endoftext|>`` (pad), ``<|im_start|>``, ``<|im_end|>`` (eos), 3 ``<unk>``, 4 newline,
    printable ASCII, fillers, and ``<|image_pad|>``, ``<|video_pad|>``, ``<|vision_start|>``, ``<|vision_end|>`` at
    `TINY_VL_TOKENS`' ids (250..253), so the ids fit `make_tiny_vl_model`."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from jaxrl_async.data.tokenizer import QWEN2_5_VL_CHAT_TEMPLATE

    vl = {"<|image_pad|>": TINY_VL_TOKENS["image_token_id"], "<|video_pad|>": TINY_VL_TOKENS["video_token_id"],
          "<|vision_start|>": TINY_VL_TOKENS["vision_start_token_id"],
          "<|vision_end|>": TINY_VL_TOKENS["vision_end_token_id"]}
    vocab = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2, "<unk>": 3, "\n": 4}
    for c in range(32, 127):
        vocab[chr(c)] = len(vocab)
    while len(vocab) < vocab_size:
        i = len(vocab)
        vocab[next((t for t, j in vl.items() if j == i), f"<|filler_{i}|>")] = i
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *vl]])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|endoftext|>", eos_token="<|im_end|>",
                                   unk_token="<unk>", clean_up_tokenization_spaces=False)
    fast.chat_template = QWEN2_5_VL_CHAT_TEMPLATE
    os.makedirs(out_dir, exist_ok=True)
    fast.save_pretrained(out_dir)
    return out_dir


def make_tiny_tokenizer(out_dir: str, vocab_size: int = 256) -> str:
    """Save a character-level Hugging Face tokenizer (ids < vocab_size) into out_dir.

    ids 0..2 are <pad>, <s>, </s> (matching `tiny_hf_config`); printable ASCII follows.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)]
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    for ch in chars:
        if len(vocab) >= vocab_size:
            break
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")
    os.makedirs(out_dir, exist_ok=True)
    fast.save_pretrained(out_dir)
    return out_dir


def decode_prompts(engine, params, prompts: list[list[int]], temperature: float,
                   max_new_tokens: int) -> list[tuple[list[int], list[float]]]:
    """Drive a ``PagedEngine`` directly: prompt i is prefilled into slot i (sampling seed i), then the batch
    decodes ``max_new_tokens - 1`` steps. Returns (tokens, behaviour log-probs) per prompt, the first token
    included (the parity tests compare them with transformers and with the trainer's log-probs)."""
    from jaxrl_async.generator.engine_api import SamplingParams

    state = engine.init_decode_state()
    outs = []
    for slot, prompt in enumerate(prompts):
        sp = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, seed=slot)
        pre = engine.prefill(params, prompt, sp)
        state = engine.insert(pre, state, slot)
        outs.append(([int(pre.first_tokens[0])], [float(pre.first_logprobs[0])]))
    for _ in range(max_new_tokens - 1):
        state, step = engine.generate(params, state)
        step = step.to_host()
        for slot, (toks, lps) in enumerate(outs):
            if step.valid[slot]:
                toks.append(int(step.tokens[slot]))
                lps.append(float(step.logprobs[slot]))
    return outs


def check_engine_against_hf_and_trainer(cfg, params, hf, mesh=None) -> None:
    """Parity of a small paged engine (on `mesh`, default one device) with a transformers model `hf` and with the
    trainer: three prompts decoded 10 tokens greedily must equal `hf.generate` token for token, and at temperature
    0.7 the behaviour log-probs must equal `sequence_logprobs` (one device) within 1e-5 (asserts; the model tests'
    shared check)."""
    import jax.numpy as jnp
    import numpy as np
    import torch

    from jaxrl_async.models import sequence_logprobs
    from jaxrl_async.generator.factory import EngineConfig, build_engine

    engine = build_engine(EngineConfig(max_concurrent_decodes=4, max_sequence_length=64, prefill_buckets=(32,),
                                       page_size=8, num_pages=64), cfg, mesh)
    p = engine.place_params(params)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, cfg.vocab_size, n).tolist() for n in (5, 12, 20)]
    max_new = 10
    for temp in (0.0, 0.7):
        outs = decode_prompts(engine, p, prompts, temperature=temp, max_new_tokens=max_new)
        for slot, prompt in enumerate(prompts):
            gen, lps = outs[slot]
            if temp == 0.0:
                with torch.no_grad():
                    ref = hf.generate(input_ids=torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new,
                                      eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
                assert gen == ref, (slot, gen, ref)
                continue
            seq, seg = np.zeros((1, 64), np.int32), np.zeros((1, 64), np.int32)
            n = len(prompt) + len(gen)
            seq[0, :n], seg[0, :n] = prompt + gen, 1
            ref_lp, _ = sequence_logprobs(params, cfg, jnp.asarray(seq), jnp.asarray(seg), temperature=temp)
            diff = np.abs(np.asarray(ref_lp)[0, len(prompt):n] - np.asarray(lps)).max()
            assert diff <= 1e-5, (slot, diff)


def grouped_matmul_against_ragged_dot(fn, sizes, K: int, F: int, seed: int = 7):
    """Run a grouped matmul `fn(rows [M, K], w [X, K, F], group_sizes)` and `jax.lax.ragged_dot` on the same random
    fp32 inputs (group sizes `sizes`, X = len(sizes)): returns (out, ref, (d rows, d w) of fn, of ragged_dot) for a
    random cotangent, jitted; the MoE kernel tests assert their own tolerances on them."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(seed)
    sizes = np.asarray(sizes, np.int32)
    M, X = int(sizes.sum()), len(sizes)
    rows = jnp.asarray(rng.standard_normal((M, K)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((X, K, F)), jnp.float32)
    g = jnp.asarray(sizes)
    cot = jnp.asarray(rng.standard_normal((M, F)), jnp.float32)
    ref = jax.lax.ragged_dot(rows, w, g)
    out = jax.jit(lambda r, w: fn(r, w, g))(rows, w)
    grad = lambda f: jax.grad(lambda r, w: (f(r, w, g) * cot).sum(), argnums=(0, 1))(rows, w)  # noqa: E731
    return out, ref, grad(fn), grad(jax.lax.ragged_dot)


def float64_rope_tables(cfg, positions):
    """cos, sin (numpy float64, HF layout) of the float32 rope angles that every float32 implementation
    computes (position * inv_freq, rounded once): the exact tables, free of either side's float32 cos/sin."""
    import numpy as np

    from jaxrl_async.models.transformer import rope_inv_freq

    ang = (np.asarray(positions).astype(np.float32)[..., None] * rope_inv_freq(cfg)).astype(np.float32)
    ang = np.concatenate([ang, ang], -1).astype(np.float64)
    return np.cos(ang), np.sin(ang)


def ours_in_float64(params, cfg, tokens):
    """Our `apply` evaluated in float64 (logits [B, T, V] numpy float64; positions 0..T-1, one sequence per
    row), a measuring device for formula checks against transformers in float64 (NOTES.md, "Logit parity with
    transformers"): the model code pins float32 statistics and accumulators (norms, softmax, logits), which
    this swaps to float64 by replacing `jnp.float32` in the model modules for the call; rope tables are
    `float64_rope_tables`. Not thread-safe (it patches module globals)."""
    import copy
    import types

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxrl_async.kernels import flash
    from jaxrl_async.models import lora, transformer

    class _F64(types.ModuleType):
        def __getattr__(self, name):
            return jnp.float64 if name == "float32" else getattr(jnp, name)

    B, T = np.asarray(tokens).shape
    cos, sin = float64_rope_tables(cfg, np.broadcast_to(np.arange(T), (B, T)))
    cfg64 = copy.copy(cfg)
    object.__setattr__(cfg64, "dtype", "float64")  # past ModelConfig's validation (float32 | bfloat16)
    mods = (transformer, flash, lora)
    saved = [m.jnp for m in mods], transformer.rope_cos_sin
    with jax.enable_x64(True):
        try:
            for m in mods:
                m.jnp = _F64("jnp64")
            transformer.rope_cos_sin = lambda c, p: (jnp.asarray(cos), jnp.asarray(sin))
            p64 = jax.tree.map(lambda x: np.asarray(x, np.float64), params)
            return np.asarray(transformer.apply(p64, cfg64, jnp.asarray(tokens)), np.float64)
        finally:
            for m, j in zip(mods, saved[0]):
                m.jnp = j
            transformer.rope_cos_sin = saved[1]


def hf_in_float64(model, cfg):
    """A transformers Qwen3 / Qwen2 / Llama model (or a PEFT model around one) converted to float64 in place,
    with the two float32 islands of its code removed: RMSNorm (casts its input to float32) and the rotary
    embedding (float32 cos/sin whatever the model dtype), replaced by `float64_rope_tables`. Returns the model;
    call it with position ids 0..T-1 (the default). Instance-level patches: other models are untouched."""
    import numpy as np
    import torch

    if getattr(model.config, "_attn_implementation", None) == "eager":
        raise ValueError("hf_in_float64: eager attention runs its softmax in float32; load with sdpa")
    model.double()

    def rms(self, h):
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    for mod in model.modules():
        name = type(mod).__name__
        if name.endswith("RMSNorm"):
            mod.forward = rms.__get__(mod)
        elif name.endswith("RotaryEmbedding"):
            def rope(x, position_ids):
                return tuple(torch.tensor(t) for t in float64_rope_tables(cfg, np.asarray(position_ids)))

            mod.forward = rope
    return model


def subprocess_xla_flags(device_count: int | None = None) -> str:
    """XLA_FLAGS for a process a test starts: this process's flags (the test suite's compile options) without its
    simulated device count, plus ``device_count`` simulated CPU devices when given (else the process decides, e.g.
    by ``mesh.cpu_devices``, as a user's run does)."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    if device_count is not None:
        flags.append(f"--xla_force_host_platform_device_count={device_count}")
    return " ".join(flags)
