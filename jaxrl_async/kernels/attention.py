"""Training / scoring / prefill attention implementations behind one switch (``ModelConfig.attention``).

Every implementation computes the same function: grouped-query attention (H query heads over K
key/value heads, no repetition of K/V) that is causal within a segment and never crosses segments.
``segment_ids`` [B, T] number the sequences of a row (packing); 0 marks padding, which attends
nothing and is attended by nothing. Segments are contiguous runs (what ``trainer.packing`` and
every caller produce).

| name        | what                                                                            |
|-------------|---------------------------------------------------------------------------------|
| ``xla``     | the reference (``kernels/flash.py``): float32 scores [B, K, G, T, T] and a [B, T, T] mask materialised |
| ``blockwise``| pure-JAX flash attention: online softmax over key/value blocks with float32    |
|             | accumulators, fully masked blocks (causal upper triangle, earlier segments of a |
|             | packed row) skipped, custom VJP (FlashAttention-2 backward): memory O(T·block)  |
|             | in forward and backward, on every platform                                      |
| ``splash``  | the Pallas TPU splash-attention kernel (``kernels/attention_pallas.py``)                |
| ``gpu_flash``| the Pallas-Triton flash-attention kernel for NVIDIA GPUs (``kernels/attention_pallas.py``)|
| ``auto``    | ``splash`` on TPU, ``gpu_flash`` on GPU; elsewhere ``blockwise`` from           |
|             | ``BLOCKWISE_MIN_LEN`` tokens per row and ``xla`` below                          |

Not offered: ``jax.nn.dot_product_attention(implementation="cudnn")``: it takes causal masks and
per-row sequence lengths (padding) but no segment ids, so it cannot serve packed rows (the trainer's
normal case), and a compile without a GPU does not build the cuDNN graph, so nothing here could check it.

Numerics follow the reference: scores and softmax statistics in float32, probabilities cast to the
compute dtype for the value matmul, outputs accumulated in float32. Rows of padding (segment 0)
give 0 in ``blockwise`` (the reference averages V there); no loss ever reads them.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable

import jax

from jaxrl_async.kernels import attention_pallas as pallas
from jaxrl_async.kernels.flash import (  # noqa: F401  (the implementations, importable from the switch)
    DEFAULT_BLOCK, blockwise_attention, grouped_attention, segment_mask, xla_attention,
)
from jaxrl_async.kernels.platform import kernel_platform

log = logging.getLogger("jaxrl_async")

AttendFn = Callable[..., tuple[jax.Array, Any]]

ATTENTION_IMPLS = ("auto", "xla", "blockwise", "splash", "gpu_flash")
#: ``auto`` switches to ``blockwise`` at this row length (CPU crossover measured in benchmarks/RESULTS.md)
BLOCKWISE_MIN_LEN = 512


# ---------------------------------------------------------------------------------------
# The switch
# ---------------------------------------------------------------------------------------
def resolve_attention(impl: str, seq_len: int, platform: str | None = None) -> str:
    """The implementation ``impl`` stands for at rows of ``seq_len`` tokens on ``platform`` (default:
    the platform of the program being traced, ``kernels.platform.kernel_platform``)."""
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention must be one of {ATTENTION_IMPLS}, got {impl!r}")
    if impl != "auto":
        return impl
    if platform is None:
        platform = kernel_platform()
    if platform == "tpu":
        name = "splash"
    elif platform in ("gpu", "cuda"):
        name = "gpu_flash"
    else:
        name = "blockwise" if seq_len >= BLOCKWISE_MIN_LEN else "xla"
    _log_choice(platform, seq_len, name)
    return name


@functools.lru_cache(maxsize=None)
def _log_choice(platform: str, seq_len: int, name: str) -> None:
    log.info("attention auto: %s for rows of %d tokens on %s", name, seq_len, platform)


def segment_attention(segment_ids: jax.Array, scale: float, impl: str = "xla",
                      block: int = DEFAULT_BLOCK) -> AttendFn:
    """The training/scoring/prefill attention: causal within a segment, none across (packing-safe),
    computed by ``impl`` (``ATTENTION_IMPLS``; ``auto`` resolved from the platform and row length).
    ``gpu_flash`` uses blocks of at most 128 tokens (its forward block lives in GPU shared memory)."""
    name = resolve_attention(impl, segment_ids.shape[-1])
    if name != "xla" and pallas.context_shards(segment_ids.shape[-1]) > 1:
        # rows split over the `context` mesh axis: chunks of queries against all-gathered keys

        def attend(q, k, v, layer_idx, state):
            del layer_idx
            return pallas.context_parallel_attention(name, q, k, v, segment_ids, scale, block), state

        return attend
    if name == "xla":
        mask = segment_mask(segment_ids)

        def attend(q, k, v, layer_idx, state):
            del layer_idx
            return grouped_attention(q, k, v, mask, scale), state
    elif name == "blockwise":
        def attend(q, k, v, layer_idx, state):
            del layer_idx
            return blockwise_attention(q, k, v, segment_ids, scale, block, block), state
    else:
        kernel = (functools.partial(pallas.splash_attention, block=block) if name == "splash"
                  else functools.partial(pallas.gpu_flash_attention, block=min(block, 128)))

        def attend(q, k, v, layer_idx, state):
            del layer_idx
            return kernel(q, k, v, segment_ids, scale), state

    return attend
