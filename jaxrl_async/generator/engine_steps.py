"""The device side of `PagedEngine` as pure functions (jitted by the engine; params are arguments, so a weight swap
never retraces): prefill of packed prompts, chunked prefill, first-token sampling, insert of a prompt's k/v into a
slot's pages (on its decode replica's shard of the pool), release, and the decode step. Bookkeeping conventions
are in `engine.py`'s module doc.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxrl_async.models.config import ModelConfig
from jaxrl_async.models.transformer import (Params, forward, logits_from_hidden, rope_full, rope_half_cos_sin,
                                             stacked_layer_matmul)
from jaxrl_async.generator import kv_cache
from jaxrl_async.generator.packed_weights import PACKED_KEY
from jaxrl_async.kernels import cpu_kernels, paged_attention
from jaxrl_async.generator import sampling

# decode programs of these row counts (with the in-place layer matmul) compute a tied LM head with
# `cpu_kernels.matmul_nt`: 1.24-1.41x XLA's dot at 8-32 rows of a [16384, 512] embedding, 1.4-2.4x of [4096, 384]
# (session 17); other counts run a generic path slower than XLA's. With AVX-512 also 64 rows (the 512-bit tile:
# 1.07-1.21x XLA's dot on [1024, 64] to [16384, 512], session 19)
NT_LOGITS_ROWS = (8, 16, 32) + ((64,) if cpu_kernels.has_avx512() else ())

SLOT_INTS = ("pos", "last_token", "num_generated", "max_new", "top_k", "sample_index", "done")
STEP_WRITES = ("page_table", "pos", "num_generated", "last_token", "done")  # the slot state a decode step changes


# ---------------------------------------------------------------------------------------
# Pure device functions
# ---------------------------------------------------------------------------------------
def _routed_forward(record: bool, *args, embeds=None, rope=None):
    """`forward(*args)`, and with `record` the experts each token was routed to ([L, B, T, k] int16; else None).
    ``embeds``: input embeddings instead of the token lookup (a vision-language prompt's, `vision_prefill`);
    ``rope``: the positions' (cos, sin), computed by the caller (`forward`)."""
    kw = {k: v for k, v in (("embeds", embeds), ("rope", rope)) if v is not None}
    if not record:
        return forward(*args, **kw), None
    from jaxrl_async.models.moe import routing_scope

    with routing_scope(record=True) as scope:
        out = forward(*args, **kw)
    return out, scope.result["ids"].astype(jnp.int16)


def prefill_fn(params: Params, tokens: jax.Array, length: jax.Array, *, cfg: ModelConfig, record_routing: bool = False,
               positions: jax.Array | None = None, embeds: jax.Array | None = None):
    """Run prompts packed into one row [1, T]: prompt i holds tokens [off_i, off_i + length[i]) with
    off = the exclusive cumsum of `length` [N] (0 = an unused entry); causal attention within each prompt
    only, positions restarting at 0 per prompt. Returns (k [L, T, K, E], v, logits [N, V] at each prompt's
    last token). A scalar `length` is one prompt (logits [V]). `record_routing` (MoE): also the experts of
    every token of the row, [T, L, k] int16. ``positions`` (M-RoPE [3, 1, T]) / ``embeds`` [1, T, D]: given by
    a vision-language prefill (`vision_prefill`) instead of the per-prompt 0.. positions and the token lookup."""
    T = tokens.shape[1]
    single = jnp.ndim(length) == 0
    lengths = jnp.atleast_1d(length).astype(jnp.int32)
    ends = jnp.cumsum(lengths)
    offs = ends - lengths
    t = jnp.arange(T, dtype=jnp.int32)
    seg = jnp.searchsorted(ends, t, side="right").astype(jnp.int32)  # prompt index of token t
    valid = t < ends[-1]
    seg_c = jnp.minimum(seg, lengths.shape[0] - 1)
    if positions is None:
        positions = jnp.where(valid, t - offs[seg_c], 0)[None]
    segment_ids = jnp.where(valid, seg + 1, 0)[None]
    buf = jnp.zeros((cfg.num_layers, T, cfg.num_kv_heads, cfg.head_dim), jnp.dtype(cfg.dtype))
    attend = kv_cache.prefill_attend(segment_ids, cfg.head_dim ** -0.5, cfg.attention, cfg.attention_block)
    (hidden, (k, v)), ids = _routed_forward(record_routing, params, cfg, tokens, positions, attend, (buf, buf),
                                            embeds=embeds)
    last = jnp.take(hidden[0], jnp.clip(ends - 1, 0, T - 1), axis=0)  # [N, D]
    logits = logits_from_hidden(params, last)
    if record_routing:
        return k, v, (logits[0] if single else logits), jnp.swapaxes(ids[:, 0], 0, 1)
    return k, v, (logits[0] if single else logits)


def prefill_chunk_fn(params: Params, k_buf, v_buf, tokens: jax.Array, start: jax.Array, length: jax.Array, *,
                     cfg: ModelConfig, record_routing: bool = False, positions: jax.Array | None = None,
                     embeds: jax.Array | None = None):
    """One chunk [1, C] of a sequence longer than the largest prefill bucket (chunked prefill).

    k_buf/v_buf [L, T, K, E] (T = chunks x C) hold the k/v of the chunks before `start`; returns them
    with this chunk's added and the logits at position length - 1 (meaningful for the chunk holding it);
    `record_routing`: also the chunk's experts [C, L, k] int16. ``positions`` [3, 1, C] / ``embeds`` [1, C, D]: a
    vision-language chunk's (`vision_prefill`).
    """
    C = tokens.shape[1]
    if positions is None:
        positions = (start + jnp.arange(C, dtype=jnp.int32))[None]
    attend = kv_cache.chunk_prefill_attend(start, length, cfg.head_dim ** -0.5, C)
    (hidden, (k_buf, v_buf)), ids = _routed_forward(record_routing, params, cfg, tokens, positions, attend,
                                                    (k_buf, v_buf), embeds=embeds)
    last = jax.lax.dynamic_index_in_dim(hidden[0], jnp.clip(length - 1 - start, 0, C - 1), axis=0, keepdims=True)
    if record_routing:
        return k_buf, v_buf, logits_from_hidden(params, last)[0], jnp.swapaxes(ids[:, 0], 0, 1)
    return k_buf, v_buf, logits_from_hidden(params, last)[0]


def sample_first_fn(logits: jax.Array, rows, temperature, top_k, top_p, seed, sample_index, position, *,
                    truncation: bool = True, top_logprobs: int = 0):
    """First tokens of the samples of one prefill call: sample j draws from logits[rows[j]] ([N, V]) with
    its own parameters (all [n]); `truncation`: see `sampling.sample`. Returns (tokens, logprobs), and with
    `top_logprobs` = K > 0 (static) also the K largest log-probs [n, K] and their ids (`sampling.top_logprobs`)."""
    logits = jnp.take(logits, rows, axis=0)
    out = sampling.sample(logits, temperature, top_k, top_p, seed, sample_index, position, truncation=truncation)
    if top_logprobs:
        out += sampling.top_logprobs(logits, temperature, top_logprobs)
    return out


def insert_fn(arrays, k, v, dest_pages, dest_offsets, page_row, slot, ints, floats, seed, stop_row, replica, *,
              layout: paged_attention.PoolLayout, mesh: Mesh | None = None, pages_axis: str | None = None,
              kv_axis=None, slot_ints: tuple[str, ...] = SLOT_INTS):
    """Write the prompt k/v to (`dest_pages`, `dest_offsets`: local page ids of decode replica `replica`) and set
    slot `slot`'s row (ints in `slot_ints` order: SLOT_INTS, and ``rope_delta`` for a vision-language model)."""
    out = dict(arrays)
    out.update(paged_attention.write_prefix_on_replica(
        layout, {key: arrays[key] for key in layout.keys}, k, v, dest_pages, dest_offsets, replica, mesh=mesh,
        pages_axis=pages_axis, kv_axis=kv_axis))
    out["page_table"] = arrays["page_table"].at[slot].set(page_row)
    for i, name in enumerate(slot_ints):
        val = ints[i] if name != "done" else ints[i] != 0
        out[name] = arrays[name].at[slot].set(val.astype(arrays[name].dtype))
    out["temperature"] = arrays["temperature"].at[slot].set(floats[0])
    out["top_p"] = arrays["top_p"].at[slot].set(floats[1])
    out["seed"] = arrays["seed"].at[slot].set(seed)
    out["stop_ids"] = arrays["stop_ids"].at[slot].set(stop_row)
    out["live"] = arrays["live"].at[slot].set(True)
    return out


def release_fn(arrays, slot, *, null_page: int):
    out = dict(arrays)
    out["live"] = arrays["live"].at[slot].set(False)
    out["done"] = arrays["done"].at[slot].set(False)
    out["page_table"] = arrays["page_table"].at[slot].set(null_page)
    return out


def decode_step_fn(params: Params, arrays, new_pages, *, cfg: ModelConfig, page_size: int, max_seq: int,
                   null_page: int, attention: str = "blocked", block_pages: int = 8, kernel_options=None,
                   pages_axis: str | None = None, truncation: bool = True, record_routing: bool = False,
                   top_logprobs: int = 0, stacked_matmul_rows: int = 0, cpu_sampler: bool = False, rope=None):
    """One token for every slot. new_pages [S]: page to map at index pos // page_size (-1: none).

    attention: the decode attention (`paged_attention.DECODE_ATTENTION`; its pool layout names the pool
    arrays); "blocked" reads blocks of `block_pages` pages up to the longest active slot. Page ids are local
    to the slot's decode replica (`pages_axis`: the pool's pages split over it; `null_page` = pages per replica).

    Returns (arrays, (tokens, logprobs, valid, done)); see the module doc for the bookkeeping. `record_routing`
    (MoE): the step tuple has a fifth entry, the experts of the token each slot fed, [S, L, k] int16.
    `top_logprobs` = K > 0 (static): two more entries last, the K largest log-probs [S, K] of the distribution each
    slot's token was drawn from and their token ids (`sampling.top_logprobs`; zeros for inactive slots); 0: the
    program is the one without them. `stacked_matmul_rows` (static): a program of at most this many slots computes
    the layers' projections with `cpu_kernels.stacked_matmul`, reading each matrix in place from its stack
    (`transformer.stacked_layer_matmul`; the engine sets it on one CPU device, else 0), from their copies packed per
    column block where params carry them (`packed_weights.PACKED_KEY`: the engine's ``packed_weights``), and at
    NT_LOGITS_ROWS slots a tied float32 LM head with `cpu_kernels.matmul_nt`. `cpu_sampler` (static): the draws and the log-probs'
    normaliser come from `cpu_kernels.sample_rows` (`sampling.sample`'s `rows_fn`; the engine sets it on one CPU
    device with the kernels). `rope`: the step's rotary (cos, sin) [S, 1, E] of the slots' positions, computed by
    the caller (`decode_multi_fn`; None: here).
    """
    S, maxp = arrays["page_table"].shape
    null = null_page
    rows = jnp.arange(S)
    pos = arrays["pos"]
    active = arrays["live"] & ~arrays["done"]
    j = jnp.minimum(pos // page_size, maxp - 1)
    pt = arrays["page_table"]
    pt = pt.at[rows, j].set(jnp.where(new_pages >= 0, new_pages, pt[rows, j]))
    write_pages = jnp.where(active, pt[rows, j], null)
    attend = paged_attention.decode_attend(attention, pt, pos, active, write_pages, page_size, cfg.head_dim ** -0.5,
                                           block_pages=block_pages, kernel_options=kernel_options,
                                           pages_axis=pages_axis)
    keys = paged_attention.layout_for(attention).keys
    # M-RoPE models (the state has ``rope_delta``): the token at index pos sits at rotary position pos + delta
    rope_pos = pos + arrays["rope_delta"] if "rope_delta" in arrays else pos
    in_place = S <= stacked_matmul_rows
    with (stacked_layer_matmul(cpu_kernels.stacked_matmul, params.get(PACKED_KEY), cpu_kernels.stacked_matmul_packed)
          if in_place else contextlib.nullcontext()):
        (hidden, pools), ids = _routed_forward(record_routing, params, cfg, arrays["last_token"][:, None],
                                               rope_pos[:, None], attend, tuple(arrays[k] for k in keys), rope=rope)
    if in_place and S in NT_LOGITS_ROWS and "lm_head" not in params and params["embed"].dtype == jnp.float32 and (
            hidden.dtype == jnp.float32):  # the tied embedding read in place (XLA's transposed dot: ~0.7x the rate)
        logits = cpu_kernels.matmul_nt(hidden[:, 0], params["embed"])
    else:
        logits = logits_from_hidden(params, hidden[:, 0])
    tokens, logprobs, *lse = sampling.sample(logits, arrays["temperature"], arrays["top_k"], arrays["top_p"],
                                             arrays["seed"], arrays["sample_index"], pos + 1, truncation=truncation,
                                             rows_fn=cpu_kernels.sample_rows if cpu_sampler else None,
                                             with_lse=bool(top_logprobs))
    num_generated = arrays["num_generated"] + active.astype(jnp.int32)
    new_pos = jnp.where(active, pos + 1, pos)
    finished = (sampling.is_stop(tokens, arrays["stop_ids"]) | (num_generated >= arrays["max_new"])
                | (new_pos + 1 >= max_seq))
    done = arrays["done"] | (active & finished)
    out = dict(arrays, **dict(zip(keys, pools)), **dict(zip(STEP_WRITES, (
        pt, new_pos, num_generated, jnp.where(active, tokens, arrays["last_token"]), done))))
    step = (jnp.where(active, tokens, 0), jnp.where(active, logprobs, 0.0), active, active & finished)
    if record_routing:
        step += (jnp.swapaxes(ids[:, :, 0], 0, 1),)
    if top_logprobs:
        top_lp, top_ids = sampling.top_logprobs(logits, arrays["temperature"], top_logprobs, lse=lse[0])
        step += (jnp.where(active[:, None], top_lp, 0.0), jnp.where(active[:, None], top_ids, 0))
    return out, step


def decode_multi_fn(params: Params, arrays, new_pages, new_index, *, num_steps: int, **kw):
    """`num_steps` decode steps in one program (multi-step decode: one dispatch and one host copy for K tokens per
    slot). The host maps every page the K steps will start before the dispatch: `new_pages` [S] (-1: none) goes to
    page-table index `new_index` [S] (K <= page_size, so at most one per slot); then `decode_step_fn` runs K times
    under `lax.scan` with nothing to map. A slot that stops (stop token, max_new_tokens, sequence limit) at step i
    is inactive for the rest: its later rows are invalid and change nothing, exactly as K single steps would.
    The rotary cos / sin of the K steps are computed once, before the loop, each frequency once (`rope_half_cos_sin`):
    a slot active at step i is at position pos + i (positions only advance while active; an inactive row's are
    unused). In the loop XLA:CPU fused them into the q and k fusions of a one-layer model, recomputing each per
    head and twice per frequency (NOTES, session 22).
    Returns (arrays, step outputs stacked [K, S, ...])."""
    S, maxp = arrays["page_table"].shape
    rows = jnp.arange(S)
    j = jnp.clip(new_index, 0, maxp - 1)
    pt = arrays["page_table"]
    arrays = dict(arrays, page_table=pt.at[rows, j].set(jnp.where(new_pages >= 0, new_pages, pt[rows, j])))
    unmapped = jnp.full((S,), -1, jnp.int32)
    pos = arrays["pos"] + arrays["rope_delta"] if "rope_delta" in arrays else arrays["pos"]
    steps = (pos[None, :] + jnp.arange(num_steps, dtype=pos.dtype)[:, None]).reshape(num_steps * S, 1)  # 2-D: not M-RoPE's
    rope = tuple(a.reshape(num_steps, S, 1, -1) for a in rope_half_cos_sin(kw["cfg"], steps))

    def body(a, half):
        return decode_step_fn(params, a, unmapped, rope=rope_full(half), **kw)

    return jax.lax.scan(body, arrays, rope, length=num_steps)


def decode_rows_fn(params: Params, arrays, *args, pool_keys: tuple[str, ...], num_steps: int = 1, **kw):
    """`decode_step_fn` (``num_steps`` = 1; args: new_pages [S], rows [R]) or `decode_multi_fn` (``num_steps`` = K > 1;
    args: new_pages [S], new_index [S], rows [R]) on the slots `rows` only (R < S): a compacted decode batch when
    most slots are free.

    `rows` holds every live slot (so every active one), padded with free slots (repeats allowed: a free slot is
    inactive, its steps change nothing, so every copy writes back the same values). The slots' rows of the state
    and of the per-slot arguments are gathered, stepped, and scattered back; the KV pools are shared as they are
    (page ids do not move). The step outputs come back as the full program's, [S] (or [K, S]) arrays with zeros /
    False outside `rows`, and every row's token and log-prob equal the full program's (sampling is per row:
    `sampling.sample`). A K-step dispatch keeps the rows it started with: a slot that stops on the way stays in
    them, inactive, until the next dispatch chooses again."""
    *slot_args, rows = args
    sub = {k: (v if k in pool_keys else jnp.take(v, rows, axis=0)) for k, v in arrays.items()}
    sub_args = [jnp.take(a, rows) for a in slot_args]
    if num_steps == 1:
        sub_out, step = decode_step_fn(params, sub, *sub_args, **kw)
    else:
        sub_out, step = decode_multi_fn(params, sub, *sub_args, num_steps=num_steps, **kw)
    # only what a step changes is scattered back (fewer programs to compile and run)
    out = {k: (sub_out[k] if k in pool_keys else arrays[k].at[rows].set(sub_out[k]) if k in STEP_WRITES
               else arrays[k]) for k in arrays}
    S, a = slot_args[0].shape[0], int(num_steps > 1)  # the slot axis of the outputs: [S, ...] or [K, S, ...]
    return out, tuple(jnp.zeros(x.shape[:a] + (S,) + x.shape[a + 1:], x.dtype).at[(slice(None),) * a + (rows,)].set(x)
                      for x in step)
