"""The layer matrices packed per column block for the CPU decode programs (issue 28; NOTES, session 24).

A decode step at a few rows reads every projection matrix once (`cpu_kernels.stacked_matmul`, in place from its
[L, K, N] stack). In the model's layout a column block of 64 reads 256 bytes per row of the matrix at a stride of N
floats, a new 4 KiB page every row or few rows, which the hardware prefetchers lose: the kernel read shape A's
matrices at 5-7 GB/s where the host streams 18 GB/s. Packed per column block ([L, ceil(N / 64), K, 64], each block
contiguous; `cpu_kernels.pack_columns`) the same products read 1.3-1.5x faster (`benchmarks/matmul_layouts.cc`).

`PackedWeights` keeps such a copy of the matrices the decode programs read in place, and hands the programs the
params with the copy under `PACKED_KEY` ({stack: {matrix: packed}}; `engine_steps.decode_step_fn` gives it to
`transformer.stacked_layer_matmul`, prefill and the trainer never see it). The copy is remade whenever the matrices
are other arrays than the ones it was made from (checked by identity, holding those arrays so that an id cannot
come back): a weight swap, a push, a LoRA merge all hand the engine new arrays, so a dispatch never decodes with a
stale copy. Cost: the layer matrices twice in the generator's memory (only on one CPU device, where the kernels run)
and one copy of them per new weight set (~75 MB at shape A: tens of ms; ~1-2 s for a 0.6B float32 model).

Off the decode thread: `stage(params)` makes the copy of a weight set that has not reached the decode programs yet
(the orchestrator's `update_params` calls it through `PagedEngine.prepare_params` on the pusher's thread, before the
decode thread swaps the weights in), so the first dispatch with the new weights finds its copy made instead of
packing between two steps. While staged, the old and the new copy are both held (what the KV sizing reserves
beside a weight push's incoming copy); the first dispatch with the new weights drops the old one.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any

import jax

from jaxrl_async.kernels import cpu_kernels

__all__ = ["PACKED_KEY", "PackedWeights", "packable_matrices"]

logger = logging.getLogger(__name__)

PACKED_KEY = "packed_columns"


def packable_matrices(params: Any, stacks: tuple[str, ...]) -> dict[str, dict[str, jax.Array]]:
    """{stack: {matrix: [L, ...] array}} of the matrices `transformer.stacked_layer_matmul` reads in place: float32
    q k v o gate up down of a dense stack (no router), without LoRA adapters."""
    from jaxrl_async.models.transformer import in_place_candidates

    out: dict = {}
    for name in stacks:
        stack = params.get(name) if isinstance(params, dict) else None
        mats = in_place_candidates(stack) if isinstance(stack, dict) else {}
        if mats:
            out[name] = mats
    return out


def _pack(w: jax.Array, contracted: int) -> jax.Array:
    """w [L, *contracted dims, *free dims] -> [L, ceil(N / 64), K, 64] on w's devices (K, N: the products). On the
    one CPU device where the kernels run, numpy reads w's memory as it is and the copy goes back without another
    (`pack_columns`' aligned memory): no transfer, so a caller's transfer guard (the weight push's) does not apply."""
    k_in = math.prod(w.shape[1:1 + contracted])
    with jax.transfer_guard("allow"):
        return jax.device_put(cpu_kernels.pack_columns(jax.device_get(w).reshape(w.shape[0], k_in, -1)), w.sharding)


class PackedWeights:
    """The packed copy of one engine's decode matrices, remade for each new weight set (see the module doc)."""

    def __init__(self, stacks: tuple[str, ...]):
        self.stacks = tuple(stacks)
        self.packs = 0  # copies made (a test's and a log's count)
        self.staged_packs = 0  # of which made by `stage` (off the decode thread)
        self._lock = threading.Lock()
        self._source: tuple = ()  # the arrays the copy was made from (held: identity is the check)
        self._packed: dict = {}
        self._staged: tuple[tuple, dict] | None = None  # (source, copy) of a weight set not decoded with yet

    def _matrices(self, params: Any) -> tuple[dict, tuple]:
        """(`packable_matrices` of params, those arrays in order: the identity a copy is checked against)."""
        mats = packable_matrices(params, self.stacks)
        return mats, tuple(a for m in mats.values() for a in m.values())

    @staticmethod
    def _same(a: tuple, b: tuple) -> bool:
        return len(a) == len(b) and all(x is y for x, y in zip(a, b))

    def _make(self, mats: dict, source: tuple, where: str) -> dict:
        from jaxrl_async.models.lora import TARGETS

        t0 = time.perf_counter()
        packed = {name: {k: _pack(w, TARGETS[k][1]) for k, w in m.items()} for name, m in mats.items()}
        logger.debug("PackedWeights: packed %d matrices (%.1f MB) in %.3f s (%s)", len(source),
                     sum(a.nbytes for a in source) / 1e6, time.perf_counter() - t0, where)
        return packed

    def stage(self, params: Any) -> bool:
        """Make the copy of `params`' matrices now, on the caller's thread, for the dispatches that will decode with
        them (a weight set the decode thread has not swapped in yet). True if a copy was made (False: params has no
        packable matrices, or their copy is already the current or the staged one). A newer staged set replaces an
        older one that was never decoded with."""
        mats, source = self._matrices(params)
        if not mats:
            return False
        with self._lock:
            if self._same(source, self._source) or (self._staged is not None and self._same(source, self._staged[0])):
                return False
            self._staged = None  # superseded (its weights will never be decoded with): freed before the new copy
        packed = self._make(mats, source, "staged")  # outside the lock: the decode thread keeps its copy meanwhile
        with self._lock:
            self.packs += 1
            self.staged_packs += 1
            if not self._same(source, self._source):  # (the decode thread may have packed them itself meanwhile)
                self._staged = (source, packed)
        return True

    def __call__(self, params: Any) -> Any:
        """params with the packed copy of its matrices under `PACKED_KEY` (params itself if it has none)."""
        mats, source = self._matrices(params)
        if not mats:
            return params
        with self._lock:
            if not self._same(source, self._source):
                staged, self._staged = self._staged, None
                self._source, self._packed = (), {}  # the old copy is freed before a new one is made
                if staged is not None and self._same(source, staged[0]):
                    self._packed = staged[1]  # made off the decode thread (`stage`)
                else:
                    self._packed = self._make(mats, source, "on the decode thread")
                    self.packs += 1
                self._source = source
            packed = self._packed
        return {**params, PACKED_KEY: packed}


def packed_bytes(cfg) -> int:
    """Bytes of the packed copy `PackedWeights` makes of a dense float32 model's layer matrices (columns padded to
    blocks of 64; with LoRA, the generator holds unmerged adapters on ``cfg.lora.targets``, whose matrices are not
    packed): what the engine's KV sizing sets aside for it."""
    pad = lambda n: -(-n // cpu_kernels.PACK_COLUMNS) * cpu_kernels.PACK_COLUMNS  # noqa: E731
    D, F, E = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_heads * E, cfg.num_kv_heads * E
    sizes = {"q": D * pad(q), "k": D * pad(kv), "v": D * pad(kv), "o": q * pad(D), "gate": D * pad(F),
             "up": D * pad(F), "down": F * pad(D)}
    adapted = set(cfg.lora.targets) if getattr(cfg, "lora", None) is not None else set()
    return 4 * cfg.num_layers * sum(n for k, n in sizes.items() if k not in adapted)
