"""Prompt datasets for RL / evaluation on grain 0.2.18.

Pipeline (eager load, lazy grain transforms):

1. :func:`read_prompt_records` reads local JSONL/Parquet files, parses each row with its format
   (:mod:`jaxrl_async.data.formats`), renders the prompt (tokenizer's own chat template, or raw), tokenizes,
   and drops prompts with ``len(prompt_ids) > max_prompt_len`` (counted in :class:`DataStats`). Malformed
   rows raise :class:`DataFormatError` naming file and line, or are skipped and counted with
   ``skip_bad_rows=True``.
2. :func:`load_prompt_dataset` wraps the records in :class:`PromptDataset`, a random-access
   ``grain.MapDataset`` carrying the stats.
3. :func:`make_train_iterator`: shard -> per-epoch shuffle -> repeat, i.e. element ``k`` of process ``p``'s
   stream is ``shard_p[perm_{seed+e}(k mod n_p)]`` with ``e = k // n_p`` (grain's ``ShuffleMapDataset`` reseeds
   per epoch), where ``shard_p = data[p::P]``. The whole iterator state is ``k`` (``next_index``), so
   ``get_state``/``set_state`` resume exactly.
4. :func:`iter_eval_batches`: the (sharded) held-out set, once, in file order.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import grain

from jaxrl_async.data.formats import FORMATS, RowError, detect_format, parse_row

logger = logging.getLogger(__name__)

JSONL_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet", ".pq")


class DataFormatError(ValueError):
    """A malformed row; ``path`` and ``line`` (1-based line in JSONL, 1-based row in Parquet) name it:
    the message reads ``PATH: row LINE: reason``."""

    def __init__(self, path: str, line: int, message: str):
        self.path, self.line, self.reason = path, line, message
        super().__init__(f"{path}: row {line}: {message}")


@dataclasses.dataclass(frozen=True)
class DatasetConfig:
    """Where and how to read a prompt dataset.

    Attributes:
      path: a file or a sequence of files (``.jsonl``/``.json`` = JSON Lines, ``.parquet``/``.pq``); read in order.
      format: one of ``gsm8k``, ``math``, ``generic``, ``code`` (see formats.py).
      fields: canonical field name -> file column, e.g. ``{"question": "problem"}``.
      max_prompt_len: prompts with more tokens (after templating) are dropped and counted; None = keep all.
      apply_chat_template: render ``[{"role": "user", "content": prompt}]`` with the tokenizer's chat template
        and the generation prompt; False = raw prompt text encoded with the tokenizer's default special tokens.
      system_prompt: optional system message (chat template only).
      prompt_suffix: appended to the problem text before templating (e.g. :data:`BOXED_INSTRUCTION`).
      skip_bad_rows: skip (and count) malformed rows instead of raising DataFormatError.
      max_rows: read at most this many valid rows (debugging); None = all.
    """

    path: str | Sequence[str]
    format: str = "generic"
    fields: Mapping[str, str] = dataclasses.field(default_factory=dict)
    max_prompt_len: int | None = None
    apply_chat_template: bool = True
    system_prompt: str | None = None
    prompt_suffix: str = ""
    skip_bad_rows: bool = False
    max_rows: int | None = None

    def __post_init__(self):
        if self.format not in FORMATS:
            raise ValueError(f"DatasetConfig.format must be one of {FORMATS}, got {self.format!r}")
        if self.max_prompt_len is not None and self.max_prompt_len <= 0:
            raise ValueError(f"DatasetConfig.max_prompt_len must be positive or None, got {self.max_prompt_len}")
        if self.max_rows is not None and self.max_rows < 0:
            raise ValueError(f"DatasetConfig.max_rows must be >= 0 or None, got {self.max_rows}")

    @property
    def paths(self) -> tuple[str, ...]:
        return (os.fspath(self.path),) if isinstance(self.path, (str, os.PathLike)) else tuple(map(os.fspath, self.path))


BOXED_INSTRUCTION = "\nPlease put your final answer within \\boxed{}."


@dataclasses.dataclass(frozen=True)
class PromptRecord:
    """One normalised prompt.

    ``prompt`` is the exact text the model sees (chat-templated unless disabled) and ``prompt_ids`` its
    tokens; ``answer`` is the gold answer (str for math formats, the normalised tests dict for code);
    ``metadata`` holds ``raw_prompt`` (problem text incl. suffix), ``source`` ("file:line") and every unused
    column of the row.
    """

    id: str
    prompt: str
    prompt_ids: list[int]
    answer: Any
    metadata: dict[str, Any]


@dataclasses.dataclass
class DataStats:
    """Counters of one load. ``rows_read`` = non-blank rows seen = kept + bad_rows + too_long."""

    rows_read: int = 0
    kept: int = 0
    bad_rows: int = 0
    too_long: int = 0
    max_prompt_tokens: int = 0
    bad_row_examples: list[str] = dataclasses.field(default_factory=list)

    def as_dict(self) -> dict[str, int]:
        return {"data/rows_read": self.rows_read, "data/kept": self.kept, "data/bad_rows": self.bad_rows,
                "data/too_long": self.too_long, "data/max_prompt_tokens": self.max_prompt_tokens}


# ----------------------------------------------------------------------------------------------------------
# File readers: yield (line_number, row) or (line_number, RowError).
# ----------------------------------------------------------------------------------------------------------
def _iter_jsonl(path: str) -> Iterator[tuple[int, Any]]:
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as e:
                yield lineno, RowError(f"invalid JSON: {e.msg} (column {e.colno})")


def _iter_parquet(path: str) -> Iterator[tuple[int, Any]]:
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(path)
    rowno = 0
    for batch in pf.iter_batches(batch_size=4096):
        for row in batch.to_pylist():
            rowno += 1
            yield rowno, row


def iter_raw_rows(path: str) -> Iterator[tuple[int, Any]]:
    """(1-based line/row number, parsed JSON value or RowError) for each non-blank row of a local file."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"dataset file not found: {path}")
    lower = path.lower()
    if lower.endswith(JSONL_SUFFIXES):
        return _iter_jsonl(path)
    if lower.endswith(PARQUET_SUFFIXES):
        return _iter_parquet(path)
    raise ValueError(f"unsupported dataset file type {path!r}; expected one of {JSONL_SUFFIXES + PARQUET_SUFFIXES}")


def sniff_format(paths: str | Sequence[str], max_rows: int = 20) -> tuple[str, str]:
    """(format, explanation) told from the columns of the first ``max_rows`` rows of ``paths``
    (:func:`formats.detect_format`); FormatDetectionError when it cannot be told or is ambiguous."""
    paths = [os.fspath(paths)] if isinstance(paths, (str, os.PathLike)) else [os.fspath(p) for p in paths]
    rows: list[tuple[str, Any]] = []
    for path in paths:
        for lineno, row in iter_raw_rows(path):
            if len(rows) >= max_rows:
                break
            if not isinstance(row, RowError):  # invalid JSON: the reader reports it
                rows.append((f"{path}: row {lineno}", row))
    return detect_format(rows)


# ----------------------------------------------------------------------------------------------------------
# Prompt rendering.
# ----------------------------------------------------------------------------------------------------------
def render_prompt(text: str, tokenizer, *, apply_chat_template: bool = True, system_prompt: str | None = None) -> str:
    """The model-input text: ``text`` as one user turn via the tokenizer's chat template with the
    generation prompt (plus optional system turn), or ``text`` itself when templating is disabled."""
    if not apply_chat_template:
        return text
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("tokenizer has no chat_template; set DatasetConfig.apply_chat_template=False for raw prompts")
    messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [{"role": "user", "content": text}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def encode_prompts(texts: Sequence[str], tokenizer, *, templated: bool) -> list[list[int]]:
    """Token ids per text. Templated text already contains its special tokens (add_special_tokens=False);
    raw text gets the tokenizer's default ones (e.g. a BOS for Llama-style tokenizers, none for Qwen)."""
    if not texts:
        return []
    return [list(ids) for ids in tokenizer(list(texts), add_special_tokens=not templated)["input_ids"]]


def read_prompt_records(cfg: DatasetConfig, tokenizer) -> tuple[list[PromptRecord], DataStats]:
    """Reads, validates, renders, tokenizes and length-filters all rows of ``cfg.paths`` (in order)."""
    stats = DataStats()
    parsed: list[tuple[str, int, Any]] = []  # (path, line, ParsedRow)
    for path in cfg.paths:
        for lineno, row in iter_raw_rows(path):
            if cfg.max_rows is not None and len(parsed) >= cfg.max_rows:
                break
            stats.rows_read += 1
            try:
                if isinstance(row, RowError):
                    raise row
                parsed.append((path, lineno, parse_row(row, cfg.format, cfg.fields)))
            except RowError as e:
                if not cfg.skip_bad_rows:
                    raise DataFormatError(path, lineno, f"[{cfg.format}] {e}") from None
                stats.bad_rows += 1
                if len(stats.bad_row_examples) < 10:
                    stats.bad_row_examples.append(f"{path}: row {lineno}: {e}")
    raw_prompts = [p.prompt + cfg.prompt_suffix for _, _, p in parsed]
    rendered = [render_prompt(t, tokenizer, apply_chat_template=cfg.apply_chat_template, system_prompt=cfg.system_prompt)
                for t in raw_prompts]
    all_ids = encode_prompts(rendered, tokenizer, templated=cfg.apply_chat_template)
    records: list[PromptRecord] = []
    for (path, lineno, p), raw, text, ids in zip(parsed, raw_prompts, rendered, all_ids):
        stats.max_prompt_tokens = max(stats.max_prompt_tokens, len(ids))
        if cfg.max_prompt_len is not None and len(ids) > cfg.max_prompt_len:
            stats.too_long += 1
            continue
        source = f"{path}:{lineno}"
        meta = dict(p.metadata, raw_prompt=raw, source=source)
        row_id = p.id if p.id is not None else f"{os.path.basename(path)}:{lineno}"
        records.append(PromptRecord(id=row_id, prompt=text, prompt_ids=ids, answer=p.answer, metadata=meta))
    stats.kept = len(records)
    log_load_stats(cfg, stats)
    return records, stats


def log_load_stats(cfg: DatasetConfig, stats: DataStats) -> None:
    logger.info("loaded %s (%s): %d rows read, %d kept, %d bad rows skipped, %d over max_prompt_len=%s",
                ",".join(cfg.paths), cfg.format, stats.rows_read, stats.kept, stats.bad_rows, stats.too_long,
                cfg.max_prompt_len)
    if stats.too_long:
        logger.warning("filtered %d prompts longer than max_prompt_len=%d tokens", stats.too_long, cfg.max_prompt_len)
    if stats.bad_rows:
        logger.warning("skipped %d malformed rows, e.g. %s", stats.bad_rows, "; ".join(stats.bad_row_examples[:3]))


# ----------------------------------------------------------------------------------------------------------
# grain datasets.
# ----------------------------------------------------------------------------------------------------------
class PromptDataset(grain.MapDataset):
    """Random-access ``grain.MapDataset[PromptRecord]`` over loaded records; ``.stats`` holds the load counters."""

    def __init__(self, records: Sequence[PromptRecord], stats: DataStats | None = None):
        super().__init__()
        self._records = list(records)
        self.stats = stats if stats is not None else DataStats(rows_read=len(self._records), kept=len(self._records))

    @property
    def records(self) -> list[PromptRecord]:
        return self._records

    def __len__(self) -> int:
        return len(self._records)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self.slice(index)
        if not self._records:
            raise IndexError("PromptDataset is empty")
        return self._records[index % len(self._records)]

    def __str__(self) -> str:
        return f"PromptDataset(n={len(self._records)})"


def load_prompt_dataset(cfg: DatasetConfig, tokenizer) -> PromptDataset:
    """Loads ``cfg`` into a :class:`PromptDataset` (a grain MapDataset; unshuffled, unsharded, file order)."""
    records, stats = read_prompt_records(cfg, tokenizer)
    return PromptDataset(records, stats)


def shard_dataset(ds: grain.MapDataset, process_index: int = 0, process_count: int = 1) -> grain.MapDataset:
    """Strided shard ``ds[process_index::process_count]``: shards are disjoint, cover ``ds`` and differ in
    length by at most one (``len = ceil((n - p) / P)``)."""
    if process_count < 1 or not 0 <= process_index < process_count:
        raise ValueError(f"need 0 <= process_index < process_count, got {process_index}, {process_count}")
    if process_count == 1:
        return ds
    return ds.slice(slice(process_index, None, process_count))


_NO_PREFETCH = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)


class PromptIterator:
    """Infinite (or ``num_epochs``-bounded) stream of PromptRecords for the RL loop, checkpointable.

    State is ``{"next_index": k, "fingerprint": {...}}`` (JSON-serialisable); restoring it into an iterator
    built with the same data/seed/shard continues at element ``k`` exactly. The fingerprint guards against
    restoring into a different dataset, seed or shard layout.
    """

    def __init__(self, ds: grain.MapDataset, *, seed: int, shuffle: bool = True, num_epochs: int | None = None,
                 process_index: int = 0, process_count: int = 1):
        shard = shard_dataset(ds, process_index, process_count)
        if len(shard) == 0:
            raise ValueError(f"shard {process_index}/{process_count} of a {len(ds)}-record dataset is empty")
        self.epoch_size = len(shard)
        pipeline = shard.shuffle(seed=seed) if shuffle else shard
        pipeline = pipeline.repeat(num_epochs)
        self._fingerprint = {"num_records": len(ds), "seed": seed if shuffle else None, "shuffle": shuffle,
                             "process_index": process_index, "process_count": process_count}
        self._it = pipeline.to_iter_dataset(_NO_PREFETCH).__iter__()

    def __iter__(self) -> PromptIterator:
        return self

    def __next__(self) -> PromptRecord:
        return next(self._it)

    def next_batch(self, n: int) -> list[PromptRecord]:
        """The next n records (fewer only at the end of a bounded stream)."""
        out = []
        for _ in range(n):
            try:
                out.append(next(self._it))
            except StopIteration:
                break
        return out

    @property
    def epoch(self) -> int:
        """0-based epoch of the next element."""
        return self._it.get_state()["next_index"] // self.epoch_size

    def get_state(self) -> dict[str, Any]:
        return {"next_index": int(self._it.get_state()["next_index"]), "fingerprint": dict(self._fingerprint)}

    def set_state(self, state: Mapping[str, Any]) -> None:
        fp = state.get("fingerprint")
        if fp is not None and dict(fp) != self._fingerprint:
            raise ValueError(f"iterator state was saved for {dict(fp)}, but this iterator is {self._fingerprint}")
        self._it.set_state({"next_index": int(state["next_index"])})


def make_train_iterator(ds: grain.MapDataset, *, seed: int, shuffle: bool = True, num_epochs: int | None = None,
                        process_index: int = 0, process_count: int = 1) -> PromptIterator:
    """RL prompt stream for one process: shard -> shuffle(seed, reseeded per epoch) -> repeat(num_epochs)."""
    return PromptIterator(ds, seed=seed, shuffle=shuffle, num_epochs=num_epochs,
                          process_index=process_index, process_count=process_count)


def iter_eval_batches(ds: grain.MapDataset, batch_size: int, *, process_index: int = 0,
                      process_count: int = 1) -> Iterator[list[PromptRecord]]:
    """This process's shard of ``ds``, once, in order, as lists of ``batch_size`` (the last may be shorter)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    shard = shard_dataset(ds, process_index, process_count)
    for start in range(0, len(shard), batch_size):
        yield [shard[i] for i in range(start, min(start + batch_size, len(shard)))]
