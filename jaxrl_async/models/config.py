"""Model configuration for the decoder-only Qwen/Llama family.

`ModelConfig` holds the architecture (read from a Hugging Face `config.json`) and the
numerical policy (compute dtype, parameter dtype, remat, scan over layers). It is frozen
and hashable so it can be a static argument of jitted functions.

Supported architectures (selected by `model_type`):

| model_type | HF class            | differences                                   |
|------------|---------------------|-----------------------------------------------|
| qwen3      | Qwen3ForCausalLM    | RMSNorm on q and k per head (q_norm, k_norm)  |
| qwen2      | Qwen2ForCausalLM    | bias on q, k, v projections                   |
| llama      | LlamaForCausalLM    | optional "llama3" RoPE scaling, attention_bias|
| qwen3_moe  | Qwen3MoeForCausalLM | qwen3 attention; MLPs mixtures of experts     |
|            |                     | (`models/moe.py`: top-k routing, dropless     |
|            |                     | grouped matmuls), dense ones where            |
|            |                     | `mlp_only_layers`/`decoder_sparse_step` say   |

Qwen2.5 checkpoints use `model_type: qwen2`.
Qwen2.5-VL (`model_type: qwen2_5_vl`) is `qwen2_5_vl.VLConfig`: a qwen2 `ModelConfig` with `mrope_section`
(M-RoPE) and the vision tower's `vision.VisionConfig`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Mapping

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen2", "llama", "qwen3_moe")
_ARCH_BY_TYPE = {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM"}
_DTYPES = ("float32", "bfloat16", "float16")


class UnsupportedModelError(ValueError):
    """The checkpoint describes a model this package does not implement."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    model_type: str = "qwen3"
    vocab_size: int = 151936
    hidden_size: int = 1024
    intermediate_size: int = 3072
    num_layers: int = 28
    num_heads: int = 16
    num_kv_heads: int = 8
    head_dim: int = 128
    rope_theta: float = 1_000_000.0
    # Sorted (key, value) pairs of the HF rope parameters other than rope_theta/rope_type,
    # e.g. (("factor", 8.0), ("high_freq_factor", 4.0), ...) for llama3. Tuple => hashable.
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    rope_type: str = "default"
    # multimodal rotary positions (Qwen2.5-VL's M-RoPE, `models/qwen2_5_vl.py`): the rotary frequencies split into
    # temporal / height / width sections of these sizes (summing to head_dim / 2), each rotated by its own row of
    # [3, B, T] positions; () = ordinary 1D RoPE. 1D positions [B, T] mean the same position on all three rows.
    mrope_section: tuple[int, ...] = ()
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 40960
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = True
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    # mixture of experts (qwen3_moe; 0 experts = a dense MLP): every layer's MLP is `num_experts` SwiGLU experts
    # of width `moe_intermediate_size`, `num_experts_per_tok` per token (top-k of the float32 router softmax,
    # renormalised when `norm_topk_prob`); `router_aux_loss_coef` as in the HF config (the load-balancing loss)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    router_aux_loss_coef: float = 0.0
    # dense MLP layers among the sparse ones (transformers' rule): layer i is sparse iff i is not in
    # `mlp_only_layers` and (i + 1) % `decoder_sparse_step` == 0; dense layers use `intermediate_size`
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # numerical policy
    dtype: str = "float32"  # compute dtype of activations and matmuls
    param_dtype: str = "float32"  # storage dtype of the parameters (master weights in training)
    remat: str = "none"  # jax.checkpoint policy per layer, by name (`models/remat.py`: none, full, minimal, ...)
    scan_layers: bool = True  # lax.scan over the stacked layers (fast compile) or a Python loop
    # training / scoring / prefill attention (`kernels/attention.py`): auto, xla, blockwise, splash, gpu_flash
    attention: str = "auto"
    attention_block: int = 512  # query and key block of "blockwise" (tokens)
    # grouped matmul of the MoE experts (`models/moe.py`): auto (megablox on TPU, tiled on GPU, else ragged_dot),
    # ragged, tiled, megablox
    moe_kernel: str = "auto"
    # LoRA adapters (`models/lora.py`: LoraSpec, or its dict): adds `layers/{target}_lora_{a,b}` to the params
    lora: Any = None

    def __post_init__(self):
        if isinstance(self.lora, Mapping):
            from jaxrl_async.models.lora import LoraSpec

            object.__setattr__(self, "lora", LoraSpec(**self.lora))
        if not isinstance(self.mrope_section, tuple):
            object.__setattr__(self, "mrope_section", tuple(int(i) for i in self.mrope_section))
        if not isinstance(self.mlp_only_layers, tuple):  # hashable (a static argument of jitted functions)
            object.__setattr__(self, "mlp_only_layers", tuple(sorted(int(i) for i in self.mlp_only_layers)))
        self.validate()

    # -- validation -------------------------------------------------------------------
    def validate(self) -> None:
        def bad(field, msg):
            raise ValueError(f"ModelConfig.{field}: {msg}")

        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"ModelConfig.model_type: {self.model_type!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        for f in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
            v = getattr(self, f)
            if not isinstance(v, int) or v <= 0:
                bad(f, f"must be a positive int, got {v!r}")
        if self.num_heads % self.num_kv_heads:
            bad("num_kv_heads", f"{self.num_kv_heads} must divide num_heads={self.num_heads}")
        if (self.model_type == "qwen3_moe") != (self.num_experts > 0):
            bad("num_experts", f"qwen3_moe needs num_experts > 0 and other types 0, got {self.num_experts} for "
                f"{self.model_type}")
        if self.num_experts:
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                bad("num_experts_per_tok", f"must be in [1, num_experts={self.num_experts}], got "
                    f"{self.num_experts_per_tok}")
            if self.moe_intermediate_size <= 0:
                bad("moe_intermediate_size", f"must be a positive int, got {self.moe_intermediate_size}")
            if not isinstance(self.decoder_sparse_step, int) or self.decoder_sparse_step <= 0:
                bad("decoder_sparse_step", f"must be a positive int, got {self.decoder_sparse_step!r}")
            out = [i for i in self.mlp_only_layers if not 0 <= i < self.num_layers]
            if out:
                bad("mlp_only_layers", f"{out} are not layer indices (0..{self.num_layers - 1})")
            if not self.sparse_layer_ids:
                bad("mlp_only_layers", f"no sparse layer left (decoder_sparse_step={self.decoder_sparse_step}, "
                    f"mlp_only_layers={list(self.mlp_only_layers)}): use a dense model_type")
        elif self.decoder_sparse_step != 1 or self.mlp_only_layers:
            bad("mlp_only_layers", "dense layers among sparse ones need num_experts > 0")
        if self.head_dim % 2:
            bad("head_dim", f"must be even for RoPE, got {self.head_dim}")
        if self.dtype not in _DTYPES:
            bad("dtype", f"must be one of {_DTYPES}, got {self.dtype!r}")
        if self.param_dtype not in _DTYPES:
            bad("param_dtype", f"must be one of {_DTYPES}, got {self.param_dtype!r}")
        if self.moe_kernel not in ("auto", "ragged", "tiled", "megablox"):  # kernels.grouped_matmul.MOE_KERNELS
            bad("moe_kernel", f"must be one of auto, ragged, tiled, megablox, got {self.moe_kernel!r}")
        from jaxrl_async.models.remat import REMAT_POLICIES

        if self.remat not in REMAT_POLICIES:
            bad("remat", f"must be one of {REMAT_POLICIES}, got {self.remat!r}")
        from jaxrl_async.kernels.attention import ATTENTION_IMPLS

        if self.attention not in ATTENTION_IMPLS:
            bad("attention", f"must be one of {ATTENTION_IMPLS}, got {self.attention!r}")
        if not isinstance(self.attention_block, int) or self.attention_block < 1:
            bad("attention_block", f"must be a positive int, got {self.attention_block!r}")
        if self.rope_type not in ("default", "llama3"):
            raise UnsupportedModelError(
                f"ModelConfig.rope_type: RoPE scaling {self.rope_type!r} is not supported (default, llama3)"
            )
        if self.mrope_section and (len(self.mrope_section) != 3 or sum(self.mrope_section) != self.head_dim // 2):
            bad("mrope_section", f"{self.mrope_section} must be 3 sizes summing to head_dim / 2 = {self.head_dim // 2}")
        if self.lora is not None:
            from jaxrl_async.models.lora import LoraSpec

            if not isinstance(self.lora, LoraSpec):
                bad("lora", f"must be a LoraSpec, a dict of its fields or None, got {self.lora!r}")
            on_mlp = sorted(set(self.lora.targets) & {"gate", "up", "down"})
            if self.num_experts and on_mlp and self.lora.dropout > 0:
                bad("lora.dropout", f"{self.lora.dropout}: the expert adapters of a mixture of experts (targets "
                    f"{on_mlp}) take no dropout (as PEFT's target_parameters); set dropout 0 or target q/k/v/o only")
        if self.rope_type == "llama3":
            keys = dict(self.rope_scaling or ())
            for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
                if k not in keys:
                    bad("rope_scaling", f"llama3 RoPE needs {k!r}")

    # -- derived ----------------------------------------------------------------------
    @property
    def group_size(self) -> int:
        """Query heads per key/value head (GQA ratio)."""
        return self.num_heads // self.num_kv_heads

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return tuple(self.eos_token_id)

    def is_sparse_layer(self, i: int) -> bool:
        """Layer i's MLP is a mixture of experts (transformers' Qwen3-MoE rule)."""
        return bool(self.num_experts) and i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0

    @property
    def sparse_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if self.is_sparse_layer(i))

    def layer_stacks(self) -> dict[str, tuple[int, ...]]:
        """Stacked parameter groups -> the model layers they hold, in order: ``layers`` (every layer of a
        dense model; the sparse layers of a mixture of experts) and ``dense_layers`` (a mixture of experts'
        dense-MLP layers, only when it has some). Slice s of a stack is layer ``ids[s]``."""
        if not self.num_experts:
            return {"layers": tuple(range(self.num_layers))}
        sparse = self.sparse_layer_ids
        dense = tuple(i for i in range(self.num_layers) if i not in sparse)
        return {"layers": sparse, **({"dense_layers": dense} if dense else {})}

    def layer_schedule(self) -> tuple[tuple[str, int, int, int], ...]:
        """Runs of consecutive same-kind layers: (stack, first slice in the stack, count, first layer)."""
        where = {i: (name, s) for name, ids in self.layer_stacks().items() for s, i in enumerate(ids)}
        runs: list[list] = []
        for i in range(self.num_layers):
            name, s = where[i]
            if runs and runs[-1][0] == name:
                runs[-1][2] += 1
            else:
                runs.append([name, s, 1, i])
        return tuple(tuple(r) for r in runs)

    def num_params(self) -> int:
        d, f, h, k, hd, v, L = (self.hidden_size, self.intermediate_size, self.num_heads, self.num_kv_heads,
                                self.head_dim, self.vocab_size, self.num_layers)
        attn = d * h * hd + 2 * d * k * hd + h * hd * d
        attn += (h + 2 * k) * hd if self.qkv_bias else 0
        attn += d if self.o_bias else 0
        attn += 2 * hd if self.qk_norm else 0
        mlp = 3 * d * f + ((2 * f + d) if self.mlp_bias else 0)
        n_sparse = len(self.sparse_layer_ids)
        moe = self.num_experts * 3 * d * self.moe_intermediate_size + d * self.num_experts
        emb = v * d * (1 if self.tie_word_embeddings else 2)
        return L * (attn + 2 * d) + (L - n_sparse) * mlp + n_sparse * moe + emb + d

    def num_active_params(self) -> int:
        """Parameters a token uses (MoE: the router and its top-k experts; dense: all)."""
        if not self.num_experts:
            return self.num_params()
        idle = (self.num_experts - self.num_experts_per_tok) * 3 * self.hidden_size * self.moe_intermediate_size
        return self.num_params() - len(self.sparse_layer_ids) * idle

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)

    # -- Hugging Face config.json -------------------------------------------------------
    @classmethod
    def from_hf(cls, hf: Mapping[str, Any] | str | os.PathLike, **policy) -> "ModelConfig":
        """Build from a HF `config.json` dict, a path to it, or a model directory.

        Reads `rope_theta` from `rope_parameters` (transformers >= 5) or the top level (older files).
        `policy` overrides numerical fields (dtype, param_dtype, remat, scan_layers).
        """
        source = "config"
        if not isinstance(hf, Mapping):
            path = os.fspath(hf)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            source = path
            try:
                with open(path) as fh:
                    hf = json.load(fh)
            except FileNotFoundError:
                raise FileNotFoundError(f"{path}: no config.json found") from None
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: invalid JSON ({e})") from None
        hf = dict(hf)
        mt = hf.get("model_type")
        if mt not in SUPPORTED_MODEL_TYPES:
            archs = hf.get("architectures")
            raise UnsupportedModelError(
                f"{source}: model_type {mt!r} (architectures={archs}) is not supported; "
                f"supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if hf.get("use_sliding_window"):
            raise UnsupportedModelError(f"{source}: use_sliding_window=true is not supported")
        moe = {}
        if mt == "qwen3_moe":
            n_exp = hf.get("num_experts", hf.get("num_local_experts"))
            if n_exp is None:
                raise ValueError(f"{source}: missing required field 'num_experts'")
            moe = dict(num_experts=int(n_exp), num_experts_per_tok=int(hf.get("num_experts_per_tok", 8)),
                       moe_intermediate_size=int(hf["moe_intermediate_size"]),
                       norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                       router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.0)),
                       decoder_sparse_step=int(hf.get("decoder_sparse_step", 1)),
                       mlp_only_layers=tuple(sorted(int(i) for i in hf.get("mlp_only_layers") or ())))
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"{source}: hidden_act {act!r} is not supported (silu only)")

        def req(key):
            if key not in hf:
                raise ValueError(f"{source}: missing required field {key!r}")
            return hf[key]

        hidden = int(req("hidden_size"))
        heads = int(req("num_attention_heads"))
        rope = dict(hf.get("rope_parameters") or {})
        legacy_scaling = hf.get("rope_scaling") or {}
        rope_theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
        scaling = {**legacy_scaling, **rope}
        rope_type = scaling.get("rope_type", scaling.get("type", "default")) or "default"
        extra = tuple(sorted((k, v) for k, v in scaling.items() if k not in ("rope_theta", "rope_type", "type")))
        head_dim = hf.get("head_dim") or hidden // heads
        attention_bias = bool(hf.get("attention_bias", False))
        kw = dict(
            model_type=mt,
            vocab_size=int(req("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(req("intermediate_size")),
            num_layers=int(req("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rope_theta=float(rope_theta),
            rope_type=rope_type,
            rope_scaling=extra if rope_type != "default" else None,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 32768)),
            qkv_bias=True if mt == "qwen2" else attention_bias,
            o_bias=attention_bias if mt in ("qwen3", "llama", "qwen3_moe") else False,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            qk_norm=mt in ("qwen3", "qwen3_moe"),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=tuple(hf["eos_token_id"]) if isinstance(hf.get("eos_token_id"), list) else hf.get("eos_token_id"),
            pad_token_id=hf.get("pad_token_id"),
            **moe,
        )
        kw.update(policy)
        return cls(**kw)

    def to_hf(self) -> dict[str, Any]:
        """The HF `config.json` dict for this architecture (transformers 5 layout)."""
        rope_parameters: dict[str, Any] = {"rope_theta": self.rope_theta, "rope_type": self.rope_type}
        rope_parameters.update(dict(self.rope_scaling or ()))
        out: dict[str, Any] = {
            "architectures": [_ARCH_BY_TYPE[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": rope_parameters,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "dtype": self.param_dtype,
            "use_cache": True,
        }
        if self.model_type in ("qwen3", "llama", "qwen3_moe"):
            out["attention_bias"] = self.o_bias
        if self.model_type == "qwen3_moe":
            out.update(num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                       moe_intermediate_size=self.moe_intermediate_size, norm_topk_prob=self.norm_topk_prob,
                       router_aux_loss_coef=self.router_aux_loss_coef,
                       decoder_sparse_step=self.decoder_sparse_step, mlp_only_layers=list(self.mlp_only_layers),
                       use_sliding_window=False, output_router_logits=False)
        if self.model_type == "qwen2":
            out["use_sliding_window"] = False
        if self.model_type == "llama":
            out["mlp_bias"] = self.mlp_bias
        return out


def _qwen3(hidden, inter, layers, heads, kv, tied) -> ModelConfig:
    return ModelConfig(
        model_type="qwen3", vocab_size=151936, hidden_size=hidden, intermediate_size=inter, num_layers=layers,
        num_heads=heads, num_kv_heads=kv, head_dim=128, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=tied, max_position_embeddings=40960, qk_norm=True,
        bos_token_id=151643, eos_token_id=151645, dtype="bfloat16", param_dtype="float32",
    )


# Exact dimensions of the published Qwen3 dense models (config.json of Qwen/Qwen3-*).
# Used for planning on paper; weights are never downloaded by this package.
PRESETS: dict[str, ModelConfig] = {
    "qwen3-0.6b": _qwen3(1024, 3072, 28, 16, 8, True),
    "qwen3-1.7b": _qwen3(2048, 6144, 28, 16, 8, True),
    "qwen3-4b": _qwen3(2560, 9728, 36, 32, 8, True),
    "qwen3-8b": _qwen3(4096, 12288, 36, 32, 8, False),
    "qwen3-14b": _qwen3(5120, 17408, 40, 40, 8, False),
    "qwen3-32b": _qwen3(5120, 25600, 64, 64, 8, False),
}


def _qwen3_moe(hidden, inter, moe_inter, layers, heads, kv, experts, top_k) -> ModelConfig:
    return _qwen3(hidden, inter, layers, heads, kv, False).replace(
        model_type="qwen3_moe", num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=moe_inter,
        norm_topk_prob=True, router_aux_loss_coef=0.001)


# Published Qwen3 mixture-of-experts dimensions (config.json of Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B)
PRESETS.update({
    "qwen3-30b-a3b": _qwen3_moe(2048, 6144, 768, 48, 32, 4, 128, 8),
    "qwen3-235b-a22b": _qwen3_moe(4096, 12288, 1536, 94, 64, 4, 128, 8),
})


def preset(name: str, **overrides) -> ModelConfig:
    try:
        cfg = PRESETS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; known: {', '.join(PRESETS)}") from None
    return cfg.replace(**overrides) if overrides else cfg


def llama3_inv_freq_scale(cfg: ModelConfig, inv_freq):
    """Apply "llama3" RoPE scaling to inverse frequencies (as transformers' _compute_llama3_parameters)."""
    import numpy as np

    p = dict(cfg.rope_scaling or ())
    factor, lo, hi = float(p["factor"]), float(p["low_freq_factor"]), float(p["high_freq_factor"])
    old_ctx = float(p["original_max_position_embeddings"])
    low_freq_wavelen = old_ctx / lo
    high_freq_wavelen = old_ctx / hi
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(is_medium, smoothed, scaled)
