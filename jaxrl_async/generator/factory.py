"""How every engine is sized and built: the RL run, ``generate``, ``evaluate``, the SFT warm start, the tests and
the benchmarks all describe their engine as an :class:`EngineConfig` (the run's ``rollout.engine`` config section
is this class) and call :func:`build_engine`.

* A run sizes its engine from the config section (slots, sequence length, KV pages or the free memory).
* A one-shot job whose prompts are known (``generate``, ``evaluate``, the in-run and SFT evaluations) takes
  :func:`for_prompts`: the sequence length is the longest prompt plus the new tokens (at most the model's
  positions), the slots never more than the work needs, and short prompts share ONE packed prefill bucket
  (several prompts per row: one compilation, and a CPU runs a [256, D] row at about twice the rate of a
  [63, D] one).
  ``reusable=True`` (the ``generate`` CLI): the engine's shapes follow the job's settings and its prompts' length
  bucket only (slots = ``max_concurrent``, the longest prompt rounded up to a power of two, a fixed packed row), not
  the number of prompts or their exact lengths, so the programs one job compiles serve the next job of the same
  model and flags from the persistent compilation cache (``cli/compile_cache.py``), as a serving engine's fixed
  geometry does.
* Sizing failures are the user's to fix, so they are one line naming the caller's own flags or config fields
  (``--num-pages`` for a CLI, ``rollout.engine.num_pages`` for the run) with the largest values that fit
  (:class:`EngineSizingError`, exit 2 in every CLI and in ``main``).

Importing this module starts no JAX backend (the config package imports :class:`EngineConfig`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    from jax.sharding import Mesh

    from jaxrl_async.generator.engine import PagedEngine
    from jaxrl_async.models.config import ModelConfig

__all__ = ["EngineConfig", "EngineFields", "EngineSizingError", "build_engine", "for_prompts", "run_engine",
           "generator_model_config", "CONFIG_FIELDS", "CLI_FLAGS"]

SINGLE_BUCKET_MAX = 512  # longest prompt for which a one-shot job uses one prefill bucket
PACK_ROW_TOKENS = 256  # prefill rows hold at least this many tokens when the prompts add up to it (several packed)
PACK_PROMPTS = 16  # most prompts packed into one prefill row


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """The paged generation engine (``generator.engine.PagedEngine``): the ``rollout.engine`` config section.

    * ``max_concurrent_decodes``: decode slots (the static decode batch).
    * ``max_sequence_length``: longest prompt + generation of one slot.
    * ``max_prefill_length``: longest prompt (None: ``max_sequence_length - 1``).
    * ``prefill_buckets``: padded prompt lengths (None: powers of two from 16, then ``max_prefill_length``).
    * ``max_prefill_pack``: most prompts packed into one prefill row.
    * ``page_size`` / ``num_pages``: tokens per KV page and the pool's pages (None: sized from the free device
      memory, on a CPU from the host's available RAM).
    * ``cache_memory_fraction``: share of the free memory the pool may take when sized automatically.
    * ``max_prefills_per_step``: prefills admitted between two decode steps (None: as many as fit).
    * ``compact_decode``: decode batches of S/2 and S/4 rows when the live slots fit (``engine.py``: "Compacted
      decode"); off: a row's tokens never depend on the rest of the batch (bitwise), which the eta = 0
      exact-resume guarantee relies on.
    * ``decode_steps``: multi-step decode: at most this many decode steps per dispatch (one jitted program, one
      device-to-host copy for all of them; ``engine_steps.decode_multi_fn``), taken while nothing waits on the
      decode thread (``orchestrator.Generator._dispatch_steps``); tokens and log-probs are those of single steps,
      bitwise. At most ``page_size``.
    * ``max_top_logprobs``: K > 0: every prefill and decode step also returns the K most likely tokens of the
      distribution each token was sampled from, with their log-probs (a request asks for up to K:
      ``SamplingParams.top_logprobs``; the server's ``top_logprobs``). 0 (an RL run): nothing extra is compiled.
    """

    max_concurrent_decodes: int = 32
    max_sequence_length: int = 512
    max_prefill_length: int | None = None
    prefill_buckets: tuple[int, ...] | None = None
    max_prefill_pack: int = 8
    page_size: int = 16
    num_pages: int | None = None
    cache_memory_fraction: float = 0.9
    max_prefills_per_step: int | None = None
    compact_decode: bool = False
    decode_steps: int = 1
    max_top_logprobs: int = 0


@dataclasses.dataclass(frozen=True)
class EngineFields:
    """What the caller calls the sizing settings, for its one-line errors."""

    num_pages: str
    max_concurrent: str
    max_sequence_length: str


CONFIG_FIELDS = EngineFields("rollout.engine.num_pages", "rollout.engine.max_concurrent_decodes",
                             "rollout.engine.max_sequence_length")
CLI_FLAGS = EngineFields("--num-pages", "--max-concurrent", "--max-new-tokens")


class EngineSizingError(MemoryError):
    """The engine's KV pool does not fit the memory the device (or, on a CPU, the host) can give: one line naming
    the caller's fields with the largest values that fit. A user error (exit 2, no traceback)."""


def generator_model_config(model_cfg: "ModelConfig") -> "ModelConfig":
    """The generator holds its weights in the compute dtype (the trainer pushes them cast). LoRA with
    ``decode="merged"``: the engine's model has no adapters (it decodes merged weights)."""
    gen = model_cfg.replace(param_dtype=model_cfg.dtype)
    if getattr(gen, "lora", None) is not None and gen.lora.decode == "merged":  # (VLConfig: no adapters)
        gen = gen.replace(lora=None)
    return gen


def build_engine(e: EngineConfig, model_cfg: "ModelConfig", mesh: "Mesh | None" = None, *,
                 reserve_weight_push: bool = False, record_routing: bool = False,
                 fields: EngineFields = CONFIG_FIELDS, check_fit: bool = True, **engine_kw: Any) -> "PagedEngine":
    """The ``PagedEngine`` of ``e`` for ``model_cfg`` on ``mesh`` (None: the first device).

    reserve_weight_push: keep room for a second copy of the weights when sizing (an RL run's pushes arrive while
    the old weights still serve). ``check_fit``: an explicit ``num_pages`` is checked against the free memory too
    (off for the planner, which compiles for other devices). ``engine_kw``: the engine's implementation options
    (``attention``, ``kernel_options``, ``decode_block_pages``, compaction levels, ...). A pool that does not fit
    raises :class:`EngineSizingError` naming ``fields``.
    """
    from jaxrl_async.generator import kv_cache
    from jaxrl_async.generator.engine import PagedEngine

    try:
        return PagedEngine(model_cfg, mesh, max_concurrent_decodes=e.max_concurrent_decodes,
                           max_sequence_length=e.max_sequence_length, max_prefill_length=e.max_prefill_length,
                           prefill_buckets=e.prefill_buckets, max_prefill_pack=e.max_prefill_pack,
                           page_size=e.page_size, num_pages=e.num_pages,
                           cache_memory_fraction=e.cache_memory_fraction, reserve_weight_push=reserve_weight_push,
                           record_routing=record_routing, compact_decode=e.compact_decode,
                           check_fit=check_fit, max_top_logprobs=e.max_top_logprobs,
                           **{"max_decode_steps": e.decode_steps, **engine_kw})
    except kv_cache.KVSizingError as err:
        raise EngineSizingError(sizing_message(err, e, fields)) from None


def sizing_message(err: Any, e: EngineConfig, fields: EngineFields) -> str:
    """One line: what does not fit, and the largest values of the caller's fields that do."""
    fit_pages, per_seq = err.fit_pages, err.pages_per_sequence
    head = f"the KV cache does not fit: {err.detail}"
    if fit_pages >= per_seq:  # an explicit num_pages too large
        slots = max(1, min(e.max_concurrent_decodes, fit_pages // per_seq))
        return (f"{head}; set {fields.num_pages} <= {fit_pages}"
                + (" (or leave it unset)" if e.num_pages is not None else "")
                + (f" and {fields.max_concurrent} <= {slots} to keep every slot at full length"
                   if slots < e.max_concurrent_decodes else ""))
    if err.weights_do_not_fit:
        return f"{head}; use a smaller model or dtype (--dtype / model.dtype), or a machine with more memory"
    tokens = fit_pages * e.page_size
    bound = f"at most {tokens} tokens" if tokens >= 2 else "fewer tokens"
    return (f"{head}; one sequence of {e.max_sequence_length} tokens needs {per_seq} pages and {fit_pages} fit: lower "
            f"{fields.max_sequence_length} so that a sequence has {bound}, or use a smaller dtype")


def prefill_row_tokens(prompt_lengths: Sequence[int], max_prompt: int, max_seq: int) -> int:
    """Tokens of a one-shot job's single prefill bucket (prompts up to SINGLE_BUCKET_MAX): rows hold several
    prompts, so a row of PACK_ROW_TOKENS runs its matmuls on that many tokens at once instead of one short prompt's
    (a CPU runs [63, D] x [D, F] at about half the rate of [256, D] x [D, F]); never longer than the prompts add
    up to (rounded to a power of two), never shorter than the longest prompt, and shorter than the sequence."""
    total = 1 << max(sum(prompt_lengths) - 1, 0).bit_length()
    return max(max_prompt, min(PACK_ROW_TOKENS, total, max_seq - 1))


def for_prompts(prompt_lengths: Sequence[int], max_new_tokens: int, model_cfg: "ModelConfig", *,
                max_concurrent: int, samples_per_prompt: int = 1, page_size: int = 16,
                num_pages: int | None = None, compact_decode: bool = False,
                max_prompt: int | None = None, decode_steps: int = 1, reusable: bool = False) -> EngineConfig:
    """The engine of a one-shot job over prompts of ``prompt_lengths`` tokens, each generating up to
    ``max_new_tokens`` (``samples_per_prompt`` samples each): sequence = longest prompt + new tokens (at most the
    model's ``max_position_embeddings``), slots = ``max_concurrent`` but never more than the job can use (and at
    least one request's samples), one packed prefill bucket for prompts up to SINGLE_BUCKET_MAX tokens.
    ``max_prompt``: the longest prompt the engine must take (default: the longest of ``prompt_lengths``).
    ``reusable``: shapes from the settings, not the job (module docstring): slots = ``max_concurrent`` (at least
    one request's samples), the longest prompt rounded up to a power of two (>= 16; not past the model's positions)
    unless ``max_prompt`` is given, and the packed row PACK_ROW_TOKENS whatever the prompts add up to."""
    if not prompt_lengths:
        raise ValueError("for_prompts: no prompts")
    max_pos = getattr(model_cfg, "text", model_cfg).max_position_embeddings  # (a VLConfig: its text model's)
    longest = max(prompt_lengths)
    if reusable and max_prompt is None:
        bucket = max(16, 1 << (longest - 1).bit_length())
        max_prompt = bucket if bucket < max_pos else longest
    max_prompt = max(longest, max_prompt or 0)
    max_seq = min(max_prompt + max_new_tokens, max_pos)
    if max_prompt >= max_seq:
        raise ValueError(f"for_prompts: a prompt of {max_prompt} tokens leaves no room to generate within the "
                         f"model's {max_pos} positions")
    n = max(1, samples_per_prompt)
    slots = max(n, max_concurrent if reusable else min(max_concurrent, len(prompt_lengths) * n))
    if max_prompt <= SINGLE_BUCKET_MAX:
        row = (max(max_prompt, min(PACK_ROW_TOKENS, max_seq - 1)) if reusable
               else prefill_row_tokens(prompt_lengths, max_prompt, max_seq))
        return EngineConfig(max_concurrent_decodes=slots, max_sequence_length=max_seq, max_prefill_length=row,
                            prefill_buckets=(row,), max_prefill_pack=PACK_PROMPTS, page_size=page_size,
                            num_pages=num_pages, compact_decode=compact_decode, decode_steps=decode_steps)
    return EngineConfig(max_concurrent_decodes=slots, max_sequence_length=max_seq, max_prefill_length=max_prompt,
                        max_prefill_pack=PACK_PROMPTS, page_size=page_size, num_pages=num_pages,
                        compact_decode=compact_decode, decode_steps=decode_steps)


def run_engine(run_cfg: Any, model_cfg: "ModelConfig", mesh: "Mesh", *, num_pages: int | None = None,
               check_fit: bool = True) -> "PagedEngine":
    """The RL run's engine (``run_cfg`` a ``RunConfig``): its ``rollout.engine`` section on the generator mesh,
    for ``generator_model_config(model_cfg)``, with room for a weight push (pushes arrive while the old weights
    serve). ``num_pages``: the planner passes the full reservation and ``check_fit=False`` (it compiles for
    other devices). The run, its generator processes and the planner all build it here."""
    e = run_cfg.rollout.engine if num_pages is None else dataclasses.replace(run_cfg.rollout.engine,
                                                                             num_pages=num_pages)
    return build_engine(e, generator_model_config(model_cfg), mesh, reserve_weight_push=True,
                        record_routing=run_cfg.rollout.record_routing, check_fit=check_fit)
