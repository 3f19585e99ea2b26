"""`PagedEngine`: the device side of the generator (JetStream-style continuous batching).

Implements `engine_api.Engine` on the model's pure `forward` with custom `attend` functions (no
forked layer code): `kv_cache.prefill_attend` (prompts packed into one padded row, keeps every
layer's k/v), `kv_cache.chunk_prefill_attend` (a sequence past the largest bucket, in chunks) and a
decode attention over the paged pool (`paged_attention.decode_attend`: the portable live-length
loop `blocked`, the reference `gather`, the TPU/GPU Pallas kernels; `attention="auto"` picks by
platform, and the choice fixes the pool's layout, `self.layout`).

The pure device functions it jits are in `engine_steps.py`. A vision-language model (`qwen2_5_vl.VLConfig`):
prefill runs the vision tower and M-RoPE positions (`vision_prefill.py`), decode adds each slot's rope_delta.

Compiled functions (params are arguments, so a weight swap never retraces; after `warmup`
nothing recompiles, whatever the prompts, slots or sampling parameters):

  prefill       once per bucket of a row's total tokens (prompts packed into [1, bucket])
  prefill_chunk once per chunked buffer length (sequences longer than the largest bucket)
  sample_first  once per power-of-two number of samples of one row, at least `max_prefill_pack`
  insert        once per bucket                 (writes a prompt's k/v into the slot's pages)
  generate      once                            (static decode batch S; the decode attention's
                                                 live-length loop has a traced trip count)
  generate_multi once per sampling program with `max_decode_steps` K > 1 (K steps per dispatch)
  compacted     at most `compact_levels` per sampling program and dispatch length (1, and K), on a thread of
                their own from the end of `warmup` (decode batches of S/2, S/4 rows per replica: below)
  release       once

Decode state (`DecodeState`) = device arrays (`arrays`, a dict pytree) + host bookkeeping
(`host`: page allocator and a mirror of each slot's position/count, used to allocate pages
before a step). Per-slot sampling parameters live in the device arrays (temperature,
top_k, top_p, seed, sample index, stop ids padded to `max_stop_tokens` with -1,
max_new_tokens), so mixing requests never recompiles. States are linear: the functions
donate the device arrays, always continue with the returned state.

Token bookkeeping of slot s: `pos[s]` is the absolute position of its last sampled token
(`last_token[s]`), whose k/v is not yet in the cache. A generate step feeds last_token at
pos, writes its k/v at pos, samples the token at pos + 1 with the request key
fold_in(fold_in(PRNGKey(seed), sample_index), pos + 1) and marks the slot done when the token
is a stop id, when `num_generated` reaches max_new_tokens, or when the sequence reaches
max_sequence_length tokens. Done slots keep their pages (and produce valid=False) until
`release`.

Compacted decode (`compact_decode`, off by default; the `generate` CLI turns it on): a static batch of S rows
pays for every free slot, and on long-tail workloads most slots are free for most of the steps (a slot
utilisation of 0.42 on the generation benchmark). When every decode replica's live slots (inserted, not
released) fit in S/D/2 or S/D/4 rows (never below `compact_min_rows`), the step runs a program of that many
rows per replica on exactly those slots (`engine_steps.decode_rows_fn`: the slots' state is gathered and
scattered back, pages stay where they are), so its matmuls follow the live slots. A multi-step dispatch (K > 1)
compacts the same way, choosing its rows once at its start for all K steps. Each size compiles once, on a
thread of its own: `warmup` starts the compiles once the full step is compiled (they overlap the prefill
compiles and the first steps), else the first step that could use one. By default the step always takes the
smallest size that fits, waiting for its compile if it still runs, so which steps compact depends on the live
slots only; `compact_in_background` instead keeps the full step serving until the compile is done. The price is
bitwise batch invariance: XLA:CPU rounds a row's matmuls differently at another batch size (logits move by
~1e-5), which can flip a sampled token where its random draw lies that close to a boundary. A run stays
reproducible when its schedule is (the same live slots at every step), and without compaction a row's result
never depends on the rest of the batch.

Paging: before each step the host gives every live slot whose next write position starts a
new page one page; if the pool is short it first refreshes the `done` flags from the device
(finished slots need nothing) and then raises `OutOfPagesError` *without changing the
state*, with `.slots` = the slots that could not grow (and `.pages_needed`, `.pages_free`):
the orchestrator preempts (releases and later re-prefills) a slot and retries. The n samples
of one prefill share its full prompt pages (reference counted, see `kv_cache`).

Sharding: params on `model_shardings(cfg, mesh, "generator")` (`place_params`), the pool
kv-heads over `tensor` where divisible, the decode batch over `data` where divisible. When the
slots split over `data` (D decode replicas, S/D slots each), so does the pool: replica r owns
pages [r P/D, (r+1) P/D) of it (per-device KV bytes = pool / D), allocated by its own host
allocator (`kv_cache.ReplicaAllocators`); page tables hold replica-local ids, and the decode
attention and prompt writes run per shard (`shard_map`), so no page crosses devices. The
samples of one prefill share prompt pages within a replica (`order_free_slots` keeps a group
together); an `OutOfPagesError` names the short replica's slots (`pool_of`).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxrl_async.models import qwen2_5_vl
from jaxrl_async.models.config import ModelConfig
from jaxrl_async.models.transformer import Params
from jaxrl_async.generator import kv_cache
from jaxrl_async.generator import engine_warmup
from jaxrl_async.generator.compaction import CompactSteps
from jaxrl_async.generator.program_cache import Program, ProgramCache
from jaxrl_async.generator.host_slots import HostSlots, advance, allocate_pages, need_ahead, need_now
from jaxrl_async.generator.packed_weights import PackedWeights, packed_bytes
from jaxrl_async.kernels import cpu_kernels, paged_attention
from jaxrl_async.generator import sampling
from jaxrl_async.generator.engine_api import Engine, Prefix, PrefillRequest, SamplingParams, StepResult
from jaxrl_async.generator.vision_prefill import VisionPrefill, vl_sequences
from jaxrl_async.generator.engine_steps import (
    SLOT_INTS, decode_multi_fn, decode_rows_fn, decode_step_fn, insert_fn, prefill_chunk_fn, prefill_fn, release_fn,
    sample_first_fn,
)
from jaxrl_async.sharding.activations import traced_with_activation_rules
from jaxrl_async.sharding.mesh import make_mesh
from jaxrl_async.models.shardings import model_shardings
from jaxrl_async.sharding.rules import logical_to_spec

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------
# State containers
# ---------------------------------------------------------------------------------------
@dataclasses.dataclass
class PrefixKV:
    """Prompt k/v of one prefill, [L, bucket, K, E] each (positions >= length are padding)."""

    k: jax.Array
    v: jax.Array
    bucket: int
    prefix_id: int
    offset: int = 0  # the prompt's first token in the buffer (prompts packed into one row)


@dataclasses.dataclass
class PagedPrefix(Prefix):
    """`Prefix` plus `first_done[k]`: sample k is already finished after its first token
    (stop id, max_new_tokens == 1 or max_sequence_length reached)."""

    first_done: np.ndarray | None = None
    rope_delta: int = 0  # M-RoPE models: the sequence's decode positions are index + rope_delta


@dataclasses.dataclass
class DecodeState:
    arrays: dict[str, jax.Array]
    host: HostSlots


def _truncates(sp: SamplingParams) -> bool:
    """The request samples with top-k or top-p (`sampling.needs_truncation` of its parameters)."""
    return sp.temperature > 0 and (sp.top_k > 0 or sp.top_p < 1.0)


# ---------------------------------------------------------------------------------------
# Engine
# ---------------------------------------------------------------------------------------
DECODE_ATTENTION = paged_attention.DECODE_ATTENTION
# decode programs of at most this many rows use the in-place layer matmul on CPU (`engine_steps.decode_step_fn`;
# measured in NOTES: 1.4-2.2x cheaper projections at 4-16 rows (session 16); the whole engine step at 32 rows of
# shape A 1.13-1.16x cheaper, at 64 rows no gain (session 17, `bench_decode_step.py --matmul-rows 0,64`)). With
# AVX-512 the kernel's 512-bit tiles over slices of k (session 19) also win at 64 rows: the 64-slot step of shape A
# 1.10x cheaper than with XLA's dots (`bench_decode_step.py --baseline`, Intel AVX-512).
STACKED_MATMUL_ROWS = 32
STACKED_MATMUL_ROWS_AVX512 = 64


def default_stacked_matmul_rows() -> int:
    """`STACKED_MATMUL_ROWS`, or `STACKED_MATMUL_ROWS_AVX512` on a CPU with AVX-512 (where the kernel has its
    intrinsics path)."""
    return STACKED_MATMUL_ROWS_AVX512 if cpu_kernels.has_avx512() else STACKED_MATMUL_ROWS

DEFAULT_BLOCK_TOKENS = 32  # "blocked": tokens per block of the live-length loop (the fastest of 16-128 on XLA:CPU, NOTES)


def default_buckets(max_prefill_length: int, min_bucket: int = 16) -> tuple[int, ...]:
    """Powers of two from min_bucket below max_prefill_length, then max_prefill_length itself."""
    out, b = [], min_bucket
    while b < max_prefill_length:
        out.append(b)
        b *= 2
    return tuple(out) + (max_prefill_length,)


class PagedEngine(Engine):
    """Paged-KV continuous-batching engine (see the module doc).

    Args:
      cfg: model config (its `dtype` is the compute and KV-cache dtype).
      mesh: generator mesh (axes among `data`, `tensor`); None = first device.
      max_concurrent_decodes: S, the static decode batch.
      max_sequence_length: longest prompt + generation of one slot.
      max_prefill_length: longest prompt (default max_sequence_length - 1).
      prefill_buckets: padded prompt lengths (default powers of two from 16, then max_prefill_length).
      page_size: tokens per KV page.
      num_pages: pool size; None = `kv_cache.auto_num_pages` from device memory.
      cache_memory_fraction: share of the free device memory given to the pool when auto-sizing.
      reserve_weight_push: when auto-sizing, keep room for a second copy of the weights (an RL run's
          pushes arrive while the old weights still serve; standalone generation needs no room).
      max_stop_tokens: width of the per-slot stop-id array.
      attention: decode attention, one of `DECODE_ATTENTION` or "auto" (by the mesh's platform, see
          `paged_attention.resolve`; the choice is logged and kept in `self.attention`); it fixes the
          pool layout (`self.layout`).
      decode_block_pages: pages per block of the "blocked" decode attention (None: `DEFAULT_BLOCK_TOKENS`
          tokens' worth).
      max_prefill_pack: most prompts packed into one prefill row by `prefill_many` (a static size: one
          compilation per bucket whatever the number packed).
      kernel_options: keyword arguments of the kernel paths (`paged_attention._tpu_local` / `_gpu_local`:
          block sizes, vmem limit, interpret).
      record_routing: (MoE models) prefill and decode also return the experts every token was routed to in
          each layer (`Prefix.routing`, `StepResult.routing`, int16), for rollout routing replay. Off: no
          extra output is compiled.
      max_decode_steps: most decode steps one `generate(..., num_steps=K)` dispatch may run (multi-step decode,
          `engine_steps.decode_multi_fn`; at most `page_size`); the orchestrator chooses K per dispatch.
      check_fit: an explicit `num_pages` must fit the free memory too (`kv_cache.check_num_pages`;
          `generator.factory.build_engine` turns it on). A pool that does not fit raises `kv_cache.KVSizingError`.
      max_top_logprobs: K > 0: prefill and every decode step also return the K largest log-probs of the distribution
          each token was sampled from and their ids (`Prefix.first_top_*`, `StepResult.top_*`; a request takes its
          `SamplingParams.top_logprobs` <= K of them). 0: no extra output is compiled (the programs are unchanged).
      stacked_matmul_rows: decode programs of at most this many rows compute the layers' projections with the
          in-place CPU matmul (`cpu_kernels.stacked_matmul`; `engine_steps.decode_step_fn`). None:
          `default_stacked_matmul_rows()` where it applies (the `cpu_paged` attention, so the CPU kernels built,
          on one device, float32 dense layers in a scan), else 0; 0: never. Asking for it where it does not apply
          is an error.
      packed_weights: the decode programs that read the projections in place read them from a copy packed per
          column block (`packed_weights.PackedWeights`: 1.3-1.5x faster reads at a few rows, the same bits; remade
          for every new weight set, off the decode thread where it arrives through `prepare_params`; the layer
          matrices twice in memory, and with `reserve_weight_push` a push's staged copy too, which the KV sizing
          counts). None: on
          wherever `stacked_matmul_rows` > 0. Asking for it where the in-place matmul is off is an error.

    Build engines with `generator.factory.build_engine` (the one sizing path and its one-line errors).
    """

    def __init__(self, cfg: ModelConfig, mesh: Mesh | None = None, *, max_concurrent_decodes: int,
                 max_sequence_length: int, max_prefill_length: int | None = None,
                 prefill_buckets: Sequence[int] | None = None, page_size: int = 16, num_pages: int | None = None,
                 cache_memory_fraction: float = 0.9, max_stop_tokens: int = 8, reserve_weight_push: bool = False,
                 attention: str = "auto", decode_block_pages: int | None = None,
                 kernel_options: dict | None = None, max_prefill_pack: int = 8, record_routing: bool = False,
                 compact_decode: bool = False, compact_levels: int = 2, compact_min_rows: int = 8,
                 compact_in_background: bool = False, check_fit: bool = False, max_decode_steps: int = 1,
                 max_top_logprobs: int = 0, stacked_matmul_rows: int | None = None,
                 packed_weights: bool | None = None, program_cache: "ProgramCache | None" = None):
        if max_concurrent_decodes < 1:
            raise ValueError(f"max_concurrent_decodes must be >= 1, got {max_concurrent_decodes}")
        if max_sequence_length < 2:
            raise ValueError(f"max_sequence_length must be >= 2, got {max_sequence_length}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if max_stop_tokens < 1:
            raise ValueError(f"max_stop_tokens must be >= 1, got {max_stop_tokens}")
        if prefill_buckets is not None:
            buckets = tuple(sorted(set(int(b) for b in prefill_buckets)))
            if not buckets or buckets[0] < 1:
                raise ValueError(f"prefill_buckets must be positive ints, got {prefill_buckets}")
            if max_prefill_length is not None and buckets[-1] != max_prefill_length:
                raise ValueError(f"largest prefill bucket {buckets[-1]} != max_prefill_length {max_prefill_length}")
        else:
            mpl = max_prefill_length if max_prefill_length is not None else max_sequence_length - 1
            buckets = default_buckets(mpl)
        if buckets[-1] >= max_sequence_length:
            raise ValueError(f"max_prefill_length {buckets[-1]} must be < max_sequence_length {max_sequence_length}")
        if not 1 <= max_decode_steps <= page_size:
            raise ValueError(f"max_decode_steps must be in [1, page_size={page_size}] (a dispatch maps at most one "
                             f"new page per slot), got {max_decode_steps}")
        self.max_decode_steps = int(max_decode_steps)
        # a vision-language model (`qwen2_5_vl.VLConfig`): the decoder is its text model; prefill runs the vision
        # tower (`vision_prefill`), decode positions are index + the slot's rope_delta
        self.vl_cfg = cfg if qwen2_5_vl.is_vl(cfg) else None
        self.text_cfg = tcfg = cfg.text if self.vl_cfg is not None else cfg
        self.slot_ints = SLOT_INTS + (("rope_delta",) if self.vl_cfg is not None else ())
        if not 0 <= max_top_logprobs <= cfg.vocab_size:
            raise ValueError(f"max_top_logprobs must be in [0, vocab_size={cfg.vocab_size}], got {max_top_logprobs}")
        self.max_top_logprobs = int(max_top_logprobs)
        if record_routing and not tcfg.num_experts:
            raise ValueError("record_routing needs a mixture-of-experts model (num_experts > 0)")
        self.record_routing = bool(record_routing)
        self.cfg = cfg
        self.mesh = mesh if mesh is not None else make_mesh({"data": 1, "tensor": 1}, devices=jax.devices()[:1])
        self.attention = paged_attention.resolve(attention, self.mesh.devices.flat[0].platform)
        self.layout = paged_attention.layout_for(self.attention)
        # decode programs of at most this many rows read the layers' projection matrices in place
        # (`cpu_kernels.stacked_matmul`): on one CPU device with the CPU kernels, float32 dense layers in a scan
        applies = (self.attention == "cpu_paged" and self.mesh.size == 1 and jnp.dtype(tcfg.dtype) == jnp.float32
                   and not tcfg.num_experts and tcfg.scan_layers)
        if stacked_matmul_rows and not applies:
            raise ValueError("stacked_matmul_rows needs the 'cpu_paged' decode attention on one device and float32 "
                             "dense layers in a scan")
        self.stacked_matmul_rows = (default_stacked_matmul_rows() if applies else 0) if (
            stacked_matmul_rows is None) else int(stacked_matmul_rows)
        if packed_weights and not self.stacked_matmul_rows:
            raise ValueError("packed_weights needs the in-place decode matmul (stacked_matmul_rows > 0)")
        self.packed_weights = bool(self.stacked_matmul_rows) if packed_weights is None else bool(packed_weights)
        self._packed = PackedWeights(tuple(tcfg.layer_stacks())) if self.packed_weights else None
        # the sizing also counts a push's staged copy where it reserves for pushes (`kv_cache.pool_budget`)
        extra_weights = packed_bytes(tcfg) if self.packed_weights else 0
        # the decode steps' sampler as one CPU kernel (`cpu_kernels.sample_rows`) where the kernels run: one CPU device
        self.cpu_sampler = self.attention == "cpu_paged" and self.mesh.size == 1
        self.kernel_options = dict(kernel_options or {})
        if max_prefill_pack < 1:
            raise ValueError(f"max_prefill_pack must be >= 1, got {max_prefill_pack}")
        self.max_prefill_pack = int(max_prefill_pack)
        if decode_block_pages is not None and decode_block_pages < 1:
            raise ValueError(f"decode_block_pages must be >= 1, got {decode_block_pages}")
        self._S = int(max_concurrent_decodes)
        self._max_seq = int(max_sequence_length)
        self.buckets = buckets
        self.page_size = int(page_size)
        self.max_stop_tokens = int(max_stop_tokens)
        self.max_pages_per_seq = kv_cache.pages_for(self._max_seq, self.page_size)
        self.decode_block_pages = min(self.max_pages_per_seq, decode_block_pages or max(
            1, DEFAULT_BLOCK_TOKENS // self.page_size))
        logger.info("PagedEngine: decode attention %r (requested %r, platform %s), block of %d pages",
                    self.attention, attention, self.mesh.devices.flat[0].platform, self.decode_block_pages)
        self.param_shardings = model_shardings(cfg, self.mesh, "generator")
        # decode replicas: when the slots split over `data`, so do the pool's pages (one range per replica)
        slot_ax = logical_to_spec(("batch",), (self._S,), "generator", self.mesh)[0]
        self.pages_axis = slot_ax if isinstance(slot_ax, str) and self.mesh.shape[slot_ax] > 1 else None
        self.kv_replicas = self.mesh.shape[self.pages_axis] if self.pages_axis else 1
        spec_kw = dict(num_layers=tcfg.num_layers, num_kv_heads=tcfg.num_kv_heads, head_dim=tcfg.head_dim,
                       page_size=self.page_size, max_pages_per_seq=self.max_pages_per_seq, dtype=tcfg.dtype)
        size_kw = dict(max_slots=self._S, max_prefill=buckets[-1], max_seq=self._max_seq,
                       reserve_weight_push=reserve_weight_push, replicas=self.kv_replicas,
                       extra_weight_bytes=extra_weights)
        if num_pages is None:
            self.sizing = kv_cache.auto_num_pages(spec_kw, cfg, self.mesh, self.param_shardings,
                                                  fraction=cache_memory_fraction, **size_kw)
            num_pages = self.sizing.num_pages
        else:
            if int(num_pages) % self.kv_replicas:
                raise ValueError(f"num_pages={num_pages} must be a multiple of the {self.kv_replicas} decode replicas "
                                 f"(the generator mesh's {self.pages_axis!r} axis: each owns an equal range of pages)")
            if check_fit:
                kv_cache.check_num_pages(int(num_pages), spec_kw, cfg, self.mesh, self.param_shardings, **size_kw)
            self.sizing = kv_cache.SizingReport(int(num_pages), "explicit", 0, 0, 0, 0, 0)
        self.cache_spec = kv_cache.KVCacheSpec(num_pages=int(num_pages), **spec_kw)
        self.pages_per_replica = self.cache_spec.num_pages // self.kv_replicas
        self.null_page = self.pages_per_replica  # page tables hold replica-local ids; one past the end = null
        if self.kv_replicas > 1:
            logger.info("PagedEngine: KV pool split over %r: %d replicas x %d pages (%d slots each)", self.pages_axis,
                        self.kv_replicas, self.pages_per_replica, self._S // self.kv_replicas)
        self._prefix_ids = itertools.count()
        per = self._S // self.kv_replicas
        self.compact_sizes = tuple(per >> i for i in range(1, compact_levels + 1)
                                   if compact_decode and per >> i >= max(compact_min_rows, 1))
        self.compact_in_background = bool(compact_in_background)
        self.compact_steps = 0  # decode steps that ran compacted (for tests and stats)
        self.program_cache = program_cache
        self._build_shardings()
        self._build_functions()
        self._compacts = CompactSteps(self._rows_step, self.compact_sizes, self.kv_replicas, self._S, self.replicated,
                                      self.compact_in_background, program_cache, self._program_context)

    # -- shardings and compiled functions -------------------------------------------------
    def _named(self, axes, shape) -> NamedSharding:
        return NamedSharding(self.mesh, logical_to_spec(axes, shape, "generator", self.mesh))

    def _build_shardings(self) -> None:
        S, ms = self._S, self.max_stop_tokens
        pool_sh = self.layout.shardings(self.cache_spec, self.mesh, pages_axis=self.pages_axis)
        self.pool_sharding = pool_sh[self.layout.keys[0]]
        self.slot_sharding = self._named(("batch",), (S,))
        self.stacked_slot_sharding = NamedSharding(self.mesh, P(None, *self.slot_sharding.spec))  # [K, S] outputs
        row2 = self._named(("batch", None), (S, ms))
        pt = self._named(("batch", None), (S, self.max_pages_per_seq))
        self.state_shardings = {
            **pool_sh, "page_table": pt, "stop_ids": row2,
            **{n: self.slot_sharding for n in self.slot_ints + ("live", "temperature", "top_p", "seed")},
        }
        self.replicated = NamedSharding(self.mesh, P())

    def _build_functions(self) -> None:
        cfg, ss = self.text_cfg, self.state_shardings
        kv_sh = self._kv_sharding = self._named(("layers", "length", "cache_kv_heads", "head_dim"),
                                                (cfg.num_layers, self.buckets[-1], cfg.num_kv_heads, cfg.head_dim))
        # the model's activations follow the generator rules (decode slots over `data`, heads and MLP
        # width over `tensor`) instead of whatever GSPMD propagates from the weights
        traced = lambda fn: traced_with_activation_rules(fn, self.mesh, "generator")  # noqa: E731
        rec = self.record_routing  # the routing outputs exist only when recording (replicated, small ints)
        self._prefill = jax.jit(traced(functools.partial(prefill_fn, cfg=cfg, record_routing=rec)),
                                out_shardings=(kv_sh, kv_sh) + (self.replicated,) * (1 + rec))
        self._prefill_chunk = jax.jit(traced(functools.partial(prefill_chunk_fn, cfg=cfg, record_routing=rec)),
                                      donate_argnums=(1, 2), out_shardings=(kv_sh, kv_sh) + (self.replicated,) * (1 + rec))
        kv_zeros = lambda T: (jnp.zeros((cfg.num_layers, T, cfg.num_kv_heads, cfg.head_dim), cfg.dtype),) * 2  # noqa: E731
        self._kv_zeros = jax.jit(kv_zeros, static_argnums=0, out_shardings=(kv_sh, kv_sh))
        # two programs each for sampling: with the top-k/top-p machinery, and without it for the (common, RL)
        # batches that need none (same tokens; about half the compile time; `sampling.sample`)
        K = self.max_top_logprobs  # top log-probs outputs (0: none; the programs are the ones without them)
        self._sample_firsts = {t: jax.jit(functools.partial(sample_first_fn, truncation=t, top_logprobs=K))
                               for t in (True, False)}
        null = self.null_page
        kv_axis = self.pool_sharding.spec[self.layout.head_axis]
        self._insert = jax.jit(functools.partial(insert_fn, layout=self.layout, mesh=self.mesh,
                                                 pages_axis=self.pages_axis, kv_axis=kv_axis,
                                                 slot_ints=self.slot_ints),
                               donate_argnums=0, out_shardings=ss)
        self._release = jax.jit(functools.partial(release_fn, null_page=null), donate_argnums=0, out_shardings=ss)
        top_sh = (self._named(("batch", None), (self._S, K)),) * 2 if K else ()
        step_out = (ss, (self.slot_sharding,) * 4 + ((self.replicated,) if rec else ()) + top_sh)
        self._steps = {t: jax.jit(traced(functools.partial(
            decode_step_fn, cfg=cfg, page_size=self.page_size, max_seq=self._max_seq, null_page=null,
            attention=self.attention, block_pages=self.decode_block_pages, kernel_options=self.kernel_options,
            pages_axis=self.pages_axis, truncation=t, record_routing=rec, top_logprobs=K,
            stacked_matmul_rows=self.stacked_matmul_rows, cpu_sampler=self.cpu_sampler)), donate_argnums=1,
            out_shardings=step_out) for t in (True, False)}
        self._step = self._steps[True]  # the full decode step (any sampling parameters; what `plan` compiles)
        self._step_out = step_out
        self._rows_steps: dict = {}  # (truncation, K) -> jitted compacted program (built on first use)
        self._multi_kw = dict(cfg=cfg, page_size=self.page_size, max_seq=self._max_seq, null_page=null,
                              attention=self.attention, block_pages=self.decode_block_pages,
                              kernel_options=self.kernel_options, pages_axis=self.pages_axis, record_routing=rec,
                              top_logprobs=K, stacked_matmul_rows=self.stacked_matmul_rows,
                              cpu_sampler=self.cpu_sampler)
        self._multi_steps: dict = {}  # (truncation, K) -> jitted K-step program (built on first use)
        self._multi_out = (ss, (self.stacked_slot_sharding,) * 4 + ((self.replicated,) if rec else ())
                           + tuple(NamedSharding(self.mesh, P(None, *x.spec)) for x in top_sh))
        self._init = jax.jit(self._init_arrays, out_shardings=ss)
        if self.program_cache is not None:  # calls run the executables `engine_warmup.compile_ahead` installs
            self._prefill, self._insert, self._release, self._init = (
                Program(n, f) for n, f in (("prefill", self._prefill), ("insert", self._insert),
                                           ("release", self._release), ("init", self._init)))
            self._sample_firsts = {t: Program(f"sample_first_{t}", f) for t, f in self._sample_firsts.items()}
            self._steps = {t: Program(f"decode_step_{t}", f) for t, f in self._steps.items()}
            self._step = self._steps[True]
            self._program_context = repr((
                self.vl_cfg if self.vl_cfg is not None else self.text_cfg, self._S, self._max_seq, self.buckets,
                self.page_size, self.cache_spec, self.max_stop_tokens, self.attention, self.decode_block_pages,
                self.kernel_options, self.max_prefill_pack, self.record_routing, self.max_decode_steps,
                self.max_top_logprobs, self.stacked_matmul_rows, self.packed_weights, self.cpu_sampler, self.pages_axis,
                self.kv_replicas, self.null_page, self.slot_ints, type(self.layout).__name__,
                getattr(self.layout, "keys", None), self.state_shardings, self._kv_sharding,
                tuple(d.id for d in self.mesh.devices.flat), self.mesh.axis_names))
        else:
            self._program_context = None
        self._no_new_pages = None  # put on the devices at the first step (the engine builds on compile-only meshes)
        self.vision = None if self.vl_cfg is None else VisionPrefill(self.vl_cfg, traced, kv_sh, self.replicated)

    def compile_counts(self) -> dict[str, int]:
        """Number of compiled variants of each jitted function (for no-recompilation checks)."""
        fns = {"init": self._init, "prefill": self._prefill, "prefill_chunk": self._prefill_chunk,
               "sample_first": self._sample_firsts[True], "sample_first_plain": self._sample_firsts[False],
               "insert": self._insert, "generate": self._steps[True], "generate_plain": self._steps[False],
               "release": self._release}
        counts = {k: f._cache_size() for k, f in fns.items()}
        counts["generate_compact"] = self._compacts.count()  # compiled or compiling
        counts["generate_multi"] = sum(f._cache_size() for f in self._multi_steps.values())
        if self.vision is not None:
            counts.update(self.vision.compile_counts())
        return counts

    def place_params(self, params: Params) -> Params:
        """Put params on the engine's generator shardings (call once per weight set)."""
        return jax.device_put(params, self.param_shardings)

    # -- Engine properties ------------------------------------------------------------------
    @property
    def max_concurrent_decodes(self) -> int:
        return self._S

    @property
    def max_prefill_length(self) -> int:
        return self.buckets[-1]

    @property
    def max_sequence_length(self) -> int:
        return self._max_seq

    @property
    def max_reprefill_length(self) -> int:
        """Longest sequence `prefill` takes: past the largest bucket it runs in chunks of that bucket."""
        return self._max_seq - 1

    @property
    def num_pages(self) -> int:
        return self.cache_spec.num_pages

    def free_pages(self, state: DecodeState) -> int:
        """Free pages of all decode replicas (one sequence takes its pages from its slot's replica: an insert
        that its replica cannot hold raises `OutOfPagesError`; `order_free_slots` puts the emptiest first)."""
        return state.host.alloc.num_free

    def pool_of(self, slot: int) -> int:
        """The decode replica (page pool) of `slot`."""
        return int(slot) // (self._S // self.kv_replicas)

    def order_free_slots(self, state: DecodeState, slots: Sequence[int]) -> list[int]:
        """`slots` with those of the replicas with the most free pages first (a group's samples then land on one
        replica and share its prompt pages); the order within a replica is kept."""
        if self.kv_replicas == 1:
            return list(slots)
        free = [a.num_free for a in state.host.alloc.allocs]
        return sorted(slots, key=lambda s: (-free[self.pool_of(s)], self.pool_of(s)))

    def pages_needed(self, num_tokens: int) -> int:
        return kv_cache.pages_for(num_tokens, self.page_size)

    # -- state ----------------------------------------------------------------------------
    def _init_arrays(self) -> dict[str, jax.Array]:
        S, ms, maxp, null = self._S, self.max_stop_tokens, self.max_pages_per_seq, self.null_page
        z = lambda dt: jnp.zeros((S,), dt)  # noqa: E731
        return {**self.layout.zeros(self.cache_spec), "page_table": jnp.full((S, maxp), null, jnp.int32),
                "stop_ids": jnp.full((S, ms), -1, jnp.int32), "pos": z(jnp.int32), "last_token": z(jnp.int32),
                "num_generated": z(jnp.int32), "max_new": z(jnp.int32), "top_k": z(jnp.int32),
                "sample_index": z(jnp.int32), "done": z(bool), "live": z(bool), "temperature": z(jnp.float32),
                "top_p": jnp.ones((S,), jnp.float32), "seed": z(jnp.uint32),
                **({"rope_delta": z(jnp.int32)} if self.vl_cfg is not None else {})}

    def init_decode_state(self) -> DecodeState:
        return DecodeState(self._init(), HostSlots.empty(self.cache_spec.num_pages, self._S, self.kv_replicas))

    # -- prefill --------------------------------------------------------------------------
    def _validate_sampling(self, sp: SamplingParams) -> None:
        sp.validate()
        if len(sp.stop_token_ids) > self.max_stop_tokens:
            raise ValueError(f"SamplingParams.stop_token_ids has {len(sp.stop_token_ids)} ids, more than "
                             f"max_stop_tokens={self.max_stop_tokens} of this engine")
        if not 0 <= sp.seed < sampling.MAX_SEED:
            raise ValueError(f"SamplingParams.seed must be in [0, 2**32), got {sp.seed}")
        if sp.top_logprobs > self.max_top_logprobs:
            raise ValueError(f"SamplingParams.top_logprobs={sp.top_logprobs} exceeds this engine's max_top_logprobs="
                             f"{self.max_top_logprobs}")

    def bucket_for(self, length: int) -> int:
        for b in self.buckets:
            if length <= b:
                return b
        raise ValueError(f"prompt of {length} tokens is longer than max_prefill_length={self.max_prefill_length}")

    def prefill(self, params: Params, tokens: Sequence[int] | np.ndarray, sampling: SamplingParams,
                num_samples: int = 1, sample_offset: int = 0, images=None) -> PagedPrefix:
        return self.prefill_many(params, [PrefillRequest(tokens, sampling, num_samples, sample_offset, images)])[0]

    def prefill_many(self, params: Params, requests: Sequence[PrefillRequest]) -> list[PagedPrefix]:
        """Prefill several sequences with one host transfer (see `engine_api.Engine.prefill_many`).

        Sequences that fit the largest bucket are packed, in order, into rows of at most that many tokens
        and `max_prefill_pack` prompts (one `prefill` call per row, bucketed by its total tokens: no
        compilation beyond the per-bucket one); longer ones run chunked. The first tokens of every sample
        of a row are drawn by one `sample_first` call; everything is dispatched before the single read
        of all first tokens and log-probs.
        """
        reqs = []
        for r in requests:
            self._validate_sampling(r.sampling)
            toks = np.asarray(r.tokens, dtype=np.int32).reshape(-1)
            n_tok = int(toks.shape[0])
            if n_tok < 1:
                raise ValueError("prefill: empty prompt")
            if r.num_samples < 1 or r.sample_offset < 0:
                raise ValueError(f"prefill: num_samples={r.num_samples} must be >= 1 and "
                                 f"sample_offset={r.sample_offset} >= 0")
            if np.any(toks < 0) or np.any(toks >= self.cfg.vocab_size):
                raise ValueError(f"prefill: token ids must be in [0, {self.cfg.vocab_size})")
            if n_tok > self.max_reprefill_length:
                raise ValueError(f"prefill: {n_tok} tokens leave no room in max_sequence_length={self._max_seq}")
            reqs.append((toks, r))
        seqs = vl_sequences(self.vl_cfg, reqs)  # VL: each one's M-RoPE positions, rope delta, feature rows; else None
        C, N = self.buckets[-1], self.max_prefill_pack
        groups: list[list[int]] = []  # packed rows (indices into reqs); a chunked sequence is a row alone
        for i, (toks, _) in enumerate(reqs):
            n = len(toks)
            g = groups[-1] if groups else None
            if (n <= C and g is not None and len(g) < N and len(reqs[g[0]][0]) <= C
                    and sum(len(reqs[j][0]) for j in g) + n <= C):
                g.append(i)
            else:
                groups.append([i])
        out: list[PagedPrefix | None] = [None] * len(reqs)
        pending = []  # (group, kv, bucket, offsets, firsts, lps) with device first tokens
        for g in groups:
            lens = [len(reqs[i][0]) for i in g]
            total = sum(lens)
            if total <= C:
                bucket = self.bucket_for(total)
                padded = np.zeros((1, bucket), np.int32)
                padded[0, :total] = np.concatenate([reqs[i][0] for i in g])
                lengths = np.zeros(N, np.int32)
                lengths[:len(g)] = lens
                if seqs is not None:
                    k, v, logits = self.vision.prefill_row(params, padded, lengths, [seqs[i] for i in g])
                    ids = []
                else:
                    k, v, logits, *ids = self._prefill(params, padded, lengths)
            else:  # chunked prefill: chunks of the largest bucket, each attending to the ones before it
                (toks, _), = [reqs[i] for i in g]
                bucket = kv_cache.pages_for(total, C) * C
                padded = np.zeros((1, bucket), np.int32)
                padded[0, :total] = toks
                chunk_ids = []
                if seqs is not None:
                    k, v, logits = self.vision.prefill_chunked(params, padded, total, seqs[g[0]], C, self._kv_zeros)
                else:
                    k, v = self._kv_zeros(bucket)
                    for start in range(0, bucket, C):  # dispatched back to back, no host sync
                        k, v, logits, *cid = self._prefill_chunk(params, k, v, padded[:, start:start + C],
                                                                 np.int32(start), np.int32(total))
                        chunk_ids += cid
                logits = logits[None]
                ids = [jnp.concatenate(chunk_ids)] if chunk_ids else []
            offsets = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(int)
            rows, cols = [], {name: [] for name in ("t", "k", "p", "seed", "idx", "pos")}
            for row, i in enumerate(g):
                sp, r = reqs[i][1].sampling, reqs[i][1]
                for j in range(r.num_samples):
                    rows.append(row)
                    for name, val in (("t", sp.temperature), ("k", sp.top_k), ("p", sp.top_p), ("seed", sp.seed),
                                      ("idx", r.sample_offset + j), ("pos", lens[row])):
                        cols[name].append(val)
            n = len(rows)
            nb = self._sample_rows(n)
            pad = lambda xs, dt: np.asarray(xs + [xs[-1]] * (nb - n), dt)  # noqa: B023, E731
            trunc = any(_truncates(reqs[i][1].sampling) for i in g)
            firsts, lps, *top = self._sample_firsts[trunc](logits, pad(rows, np.int32), pad(cols["t"], np.float32),
                                                   pad(cols["k"], np.int32), pad(cols["p"], np.float32),
                                                   pad(cols["seed"], np.uint32), pad(cols["idx"], np.int32),
                                                   pad(cols["pos"], np.int32))
            pending.append((g, k, v, bucket, offsets, (firsts, lps, ids, top)))
        host = jax.device_get([p[-1] for p in pending])  # the one host sync
        for (g, k, v, bucket, offsets, _), (firsts, lps, ids, top) in zip(pending, host):
            at = 0
            for row, i in enumerate(g):
                toks, r = reqs[i]
                sp, n_tok, ns = r.sampling, len(toks), r.num_samples
                first, lp = np.asarray(firsts[at:at + ns]), np.asarray(lps[at:at + ns])
                at += ns
                first_done = (np.isin(first, np.asarray(sp.stop_token_ids, np.int64))
                              | (sp.max_new_tokens <= 1) | (n_tok + 1 >= self._max_seq))
                out[i] = PagedPrefix(kv=PrefixKV(k, v, bucket, next(self._prefix_ids), int(offsets[row])),
                                     length=n_tok, first_tokens=first, first_logprobs=lp, sampling=sp,
                                     sample_indices=tuple(range(r.sample_offset, r.sample_offset + ns)),
                                     first_done=first_done, rope_delta=seqs[i].delta if seqs is not None else 0,
                                     routing=ids[0][offsets[row]:offsets[row] + n_tok] if ids else None,
                                     first_top_logprobs=np.asarray(top[0][at - ns:at]) if top else None,
                                     first_top_ids=np.asarray(top[1][at - ns:at]) if top else None)
        return out  # type: ignore[return-value]

    # -- insert ---------------------------------------------------------------------------
    def insert(self, prefix: Prefix, state: DecodeState, slot: int, sample: int = 0) -> DecodeState:
        return self._insert_samples(prefix, state, [(int(slot), int(sample))])

    def bulk_insert(self, prefix: Prefix, state: DecodeState, slots: Sequence[int]) -> DecodeState:
        """All-or-nothing insert of samples 0..len(slots)-1; they share the full prompt pages."""
        return self._insert_samples(prefix, state, [(int(s), k) for k, s in enumerate(slots)])

    def _insert_samples(self, prefix: Prefix, state: DecodeState, items: list[tuple[int, int]]) -> DecodeState:
        kv: PrefixKV = prefix.kv
        host, allocs = state.host, state.host.alloc
        n = len(prefix.first_tokens)
        slots = [s for s, _ in items]
        if len(set(slots)) != len(slots):
            raise ValueError(f"insert: duplicate slots {slots}")
        for s, k in items:
            if not 0 <= s < self._S:
                raise ValueError(f"insert: slot {s} out of range [0, {self._S})")
            if host.live[s]:
                raise ValueError(f"insert: slot {s} is in use (release it first)")
            if not 0 <= k < n:
                raise ValueError(f"insert: sample {k} out of range, the prefix has {n} samples")
        P_len, ps = prefix.length, self.page_size
        full, has_tail = P_len // ps, P_len % ps > 0
        by_replica: dict[int, list[int]] = {}
        for s in slots:
            by_replica.setdefault(allocs.replica(s), []).append(s)
        shared_of: dict[int, tuple[int, ...] | None] = {}
        for r, rs in by_replica.items():  # all-or-nothing: check every replica before allocating anything
            alloc = allocs.allocs[r]
            shared_of[r] = alloc.prefix_pages.get(kv.prefix_id) if full > 0 else ()
            need = (full if shared_of[r] is None else 0) + len(rs) * int(has_tail)
            if need > alloc.num_free:
                alloc.allocate(need, rs)  # raises OutOfPagesError, nothing changed
        written = set()  # replicas whose full prompt pages this call writes
        for r, shared in shared_of.items():
            if shared is None:
                shared_of[r] = tuple(allocs.allocs[r].allocate(full, by_replica[r]))
                allocs.allocs[r].register_prefix(kv.prefix_id, shared_of[r])
                written.add(r)
        sp = prefix.sampling
        stop_row = np.full(self.max_stop_tokens, -1, np.int32)
        stop_row[:len(sp.stop_token_ids)] = sp.stop_token_ids
        floats = np.asarray([sp.temperature, sp.top_p], np.float32)
        first_done = getattr(prefix, "first_done", None)
        arrays = state.arrays
        t = np.arange(kv.bucket) - kv.offset  # position of buffer token in this prompt (< 0: another prompt's)
        t_page = np.maximum(t, 0)
        dest_offsets = (t_page % ps).astype(np.int32)
        null = self.null_page
        for s, k in items:
            r = allocs.replica(s)
            alloc, shared = allocs.allocs[r], shared_of[r]
            first_here = r in written
            if not first_here:
                alloc.share(shared)
            written.discard(r)  # the replica's later samples share the pages this one writes
            pages = list(shared) + (alloc.allocate(1, [s]) if has_tail else [])
            alloc.slot_pages[s] = pages
            page_of_t = np.asarray(pages + [null], np.int32)[np.minimum(t_page // ps, len(pages))]
            lo = 0 if first_here else full * ps
            dest = np.where((t >= lo) & (t < P_len), page_of_t, null).astype(np.int32)
            page_row = np.full(self.max_pages_per_seq, null, np.int32)
            page_row[:len(pages)] = pages
            tok = int(prefix.first_tokens[k])
            done = bool(first_done[k]) if first_done is not None else (
                tok in sp.stop_token_ids or sp.max_new_tokens <= 1 or P_len + 1 >= self._max_seq)
            ints = np.asarray([P_len, tok, 1, sp.max_new_tokens, sp.top_k, prefix.sample_indices[k], int(done)]
                              + ([getattr(prefix, "rope_delta", 0)] if self.vl_cfg is not None else []), np.int32)
            arrays = self._insert(arrays, kv.k, kv.v, dest, dest_offsets, page_row, np.int32(s), ints, floats,
                                  np.uint32(sp.seed), stop_row, np.int32(r))
            host.live[s], host.done[s], host.pos[s] = True, done, P_len
            host.num_generated[s], host.max_new[s], host.num_pages[s] = 1, sp.max_new_tokens, len(pages)
            host.trunc[s] = _truncates(sp)
        return DecodeState(arrays, host)

    # -- generate -------------------------------------------------------------------------
    def _grow(self, state: DecodeState) -> jax.Array:
        """Map a new page for every active slot whose next write starts one (from its replica's pages); raise
        before changing anything if a replica is short (``host_slots``)."""
        need = need_now(state.host, self.page_size)
        if not need.any():
            if self._no_new_pages is None:
                self._no_new_pages = jax.device_put(np.full(self._S, -1, np.int32), self.slot_sharding)
            return self._no_new_pages
        new_pages, _ = allocate_pages(state.host, need, lambda: state.arrays["done"])
        return jax.device_put(new_pages, self.slot_sharding)

    def _grow_ahead(self, state: DecodeState, k: int) -> tuple[jax.Array, jax.Array]:
        """`_grow` for a K-step dispatch: (new_pages, new_index) [S] of every active slot whose next k writes start a
        page (``host_slots.need_ahead``)."""
        need = need_ahead(state.host, k, self.page_size, self._max_seq)
        new_pages, new_index = allocate_pages(state.host, need, lambda: state.arrays["done"])
        return jax.device_put(new_pages, self.slot_sharding), jax.device_put(new_index, self.slot_sharding)

    def _rows_step(self, trunc: bool, k: int):
        """The jitted compacted program of `k` decode steps per dispatch (`engine_steps.decode_rows_fn`; compiled by
        `CompactSteps`)."""
        fn = self._rows_steps.get((trunc, k))
        if fn is None:
            traced = traced_with_activation_rules(functools.partial(
                decode_rows_fn, pool_keys=self.layout.keys, num_steps=k, truncation=trunc, **self._multi_kw),
                self.mesh, "generator")
            fn = self._rows_steps[(trunc, k)] = jax.jit(
                traced, donate_argnums=1, out_shardings=self._step_out if k == 1 else self._multi_out)
        return fn

    def _multi_step_fn(self, trunc: bool, k: int):
        fn = self._multi_steps.get((trunc, k))
        if fn is None:
            traced = traced_with_activation_rules(functools.partial(
                decode_multi_fn, num_steps=k, truncation=trunc, **self._multi_kw), self.mesh, "generator")
            fn = jax.jit(traced, donate_argnums=1, out_shardings=self._multi_out)
            if self.program_cache is not None:  # `engine_warmup.compile_ahead` installs its executable (no trace)
                fn = Program(f"decode_multi_{trunc}_k{k}", fn)
            self._multi_steps[(trunc, k)] = fn
        return fn

    def generate(self, params: Params, state: DecodeState, num_steps: int = 1) -> tuple[DecodeState, StepResult]:
        """Advance every live slot by `num_steps` tokens in one dispatch (at most `max_decode_steps`; a slot that
        finishes on the way stops there). num_steps > 1: the StepResult's arrays are [K, S] (`StepResult.rows`)."""
        if num_steps != 1:
            if not 1 <= num_steps <= self.max_decode_steps:
                raise ValueError(f"num_steps must be in [1, max_decode_steps={self.max_decode_steps}], got {num_steps}")
            return self._generate_multi(params, state, num_steps)
        params = self._decode_params(params)
        new_pages = self._grow(state)
        h = state.host
        trunc = bool((h.trunc & h.live & ~h.done).any())  # the lean program unless a running slot needs top-k/p
        compact = (self._compacts.choose(params, (state.arrays, new_pages), trunc, h.live) if self.compact_sizes
                   else None)
        if compact is not None:
            prog, rows = compact
            arrays, outs = prog(params, state.arrays, new_pages, rows)
            self.compact_steps += 1
        else:
            arrays, outs = self._steps[trunc](params, state.arrays, new_pages)
        advance(h, 1, self._max_seq)
        return DecodeState(arrays, h), self._step_result(outs)

    def prepare_params(self, params: Params) -> None:
        """The packed copy of a weight set's matrices, made on the caller's thread before the decode thread swaps
        the weights in (`PackedWeights.stage`); without packing, nothing."""
        if self._packed is not None:
            self._packed.stage(params)

    def _decode_params(self, params: Params) -> Params:
        """What the decode programs take as params: with the packed copy of the layer matrices when the engine packs
        them (`packed_weights`; remade here for a new weight set), else params."""
        return params if self._packed is None else self._packed(params)

    def _step_result(self, outs) -> StepResult:
        """The StepResult of a decode program's step tuple (`engine_steps.decode_step_fn`: 4 entries, the routing
        when recording, the top log-probs and ids when max_top_logprobs > 0)."""
        tokens, logprobs, valid, done, *extra = outs
        routing = extra.pop(0) if self.record_routing else None
        top_lp, top_ids = extra if self.max_top_logprobs else (None, None)
        return StepResult(tokens, logprobs, valid, done, routing, top_lp, top_ids)

    def _generate_multi(self, params: Params, state: DecodeState, k: int) -> tuple[DecodeState, StepResult]:
        params = self._decode_params(params)
        new_pages, new_index = self._grow_ahead(state, k)
        h = state.host
        trunc = bool((h.trunc & h.live & ~h.done).any())
        args = (state.arrays, new_pages, new_index)
        compact = self._compacts.choose(params, args, trunc, h.live, k) if self.compact_sizes else None
        if compact is not None:  # the live slots' rows only, for all K steps (`decode_rows_fn`)
            prog, rows = compact
            arrays, outs = prog(params, *args, rows)
            self.compact_steps += k
        else:
            arrays, outs = self._multi_step_fn(trunc, k)(params, *args)
        advance(h, k, self._max_seq)  # the host's view of positions and length limits (stop tokens: from the results)
        return DecodeState(arrays, h), self._step_result(outs)

    # -- release --------------------------------------------------------------------------
    def release(self, state: DecodeState, slot: int) -> DecodeState:
        """Free `slot` and its pages (a free slot is left as is)."""
        h = state.host
        if not 0 <= slot < self._S:
            raise ValueError(f"release: slot {slot} out of range [0, {self._S})")
        if not h.live[slot]:
            return state
        h.alloc.release_slot(slot)
        h.live[slot], h.done[slot], h.num_pages[slot], h.pos[slot], h.trunc[slot] = False, False, 0, 0, False
        return DecodeState(self._release(state.arrays, np.int32(slot)), h)

    # -- warm-up (engine_warmup.py) ------------------------------------------------------
    def warmup(self, params: Params, max_samples: int | None = None, parallel: bool = True,
               truncation: bool = True, max_live: int | None = None) -> None:
        """Compile every bucket's prefill/insert, sample_first up to `max_samples` (default
        max_concurrent_decodes) and generate/release, on scratch states.

        max_live: the most slots the job will hold at once (a one-shot job of fewer requests than slots): the
        compacted steps it can use compile first (`CompactSteps.start_all`); every program still compiles.

        truncation: also compile the sampling programs with the top-k/top-p machinery (False: only the lean
        ones, for runs whose requests never truncate; a truncating request then compiles them at first use).
        parallel: every program compiles at once, ahead of time from abstract arguments on a pool of threads
        (`engine_warmup.compile_ahead`: XLA compiles release the GIL, so one program's Python tracing and lowering
        overlap the others' compiles), then each runs once on scratch states (cache hits); else one after the other.
        """
        engine_warmup.warmup(self, params, max_samples, parallel, truncation, max_live)

    def _sample_rows(self, n: int) -> int:
        """Rows of the `sample_first` call for n samples of one prefill row: a power of two >= n, at least
        `max_prefill_pack` (one compilation for up to a pack's worth)."""
        return max(1 << (n - 1).bit_length(), self.max_prefill_pack)
