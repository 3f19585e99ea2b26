"""The data ledger: every drawn prompt is consumed, rejected with a reason, or outstanding.

``DataLedger`` wraps the training data iterator of the RL loop (``loop``); its state goes into every
checkpoint, so a resumed run replays the outstanding items first with their original draw indices and
seeds (nothing admitted is lost or duplicated). ``read_data_ledger`` rebuilds a run's surviving event
history from ``RUN/data_ledger.jsonl``.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import threading
from typing import Any, Mapping, Sequence

log = logging.getLogger("jaxrl_async")

__all__ = ["LEDGER_LOG", "DataLedger", "LedgerHistory", "read_data_ledger", "repair_jsonl_tail",
           "record_to_json", "record_from_json"]

LEDGER_LOG = "data_ledger.jsonl"


class DataLedger:
    """Iterator over data items that remembers every draw until it is consumed or rejected.

    ``next()`` (dispatcher thread) → ``(draw index, item)`` is recorded as *pending* until
    ``on_draw(ticket)`` binds it to the ticket. ``consumed(ticket ids)`` / ``rejected(ticket, reason)``
    settle it. ``state()`` (any thread) is the source iterator state plus every outstanding item, so
    a resumed run replays them first, in draw order, with their original draw indices (and seeds).
    ``restore(ticket, draw)`` binds an outstanding item whose finished group came back from the
    checkpoint (it is not replayed); ``drop_restored(draw, reason)`` leaves it to be replayed.

    The event log (``RUN/data_ledger.jsonl``, when ``log_path`` is given) is the audit trail of the
    data: one JSON line per ``consume`` (step, consuming version, draw indices, item ids, per-group
    lag, whether each group came from a checkpoint), ``reject`` (draw, reason), ``abort`` (a group
    failed while the loop shut down: the item stays outstanding), ``restore`` / ``drop`` (a
    checkpointed group reused / discarded with its reason) and ``resume``. ``state()`` records how
    many non-``resume`` lines the run had written at that moment (``log_records``); a resumed run
    writes ``{"event": "resume", "keep": n}``, which says that the lines after the first n of the
    surviving history were written after the checkpoint it went back to (work redone after a crash).
    ``read_data_ledger`` rebuilds the surviving history from that rule. Writes happen under the
    ledger's lock, so ``state()`` and the log always agree.
    """

    def __init__(self, source: Any, replay: Sequence[tuple[int, Any]] = (), next_draw: int = 0, *,
                 log_path: str | None = None, log_records: int = 0):
        self.source = source
        self._replay = collections.deque(sorted(replay, key=lambda x: x[0]))
        self._next_draw = int(next_draw)
        self._lock = threading.Lock()
        self._pending: tuple[int, Any] | None = None
        self._outstanding: dict[int, tuple[int, Any]] = {}  # ticket id -> (draw index, item)
        self._restored_tickets: set[int] = set()
        self._frozen = False
        self.n_drawn = 0
        self.n_consumed = 0
        self.n_rejected: collections.Counter[str] = collections.Counter()
        self.n_replayed = 0
        self.n_restored = 0
        self.n_dropped: collections.Counter[str] = collections.Counter()
        self.n_aborted = 0
        self._log_records = int(log_records)
        self._log = None
        if log_path is not None:
            repair_jsonl_tail(log_path)
            self._log = open(log_path, "a", encoding="utf-8")

    def __iter__(self) -> "DataLedger":
        return self

    def __next__(self) -> Any:
        with self._lock:
            if self._replay:
                idx, item = self._replay.popleft()
                self.n_replayed += 1
            else:
                item = next(self.source)  # StopIteration propagates (data exhausted)
                idx = self._next_draw
                self._next_draw += 1
            self._pending = (idx, item)
            self.n_drawn += 1
            return item

    # -- event log ---------------------------------------------------------------------------
    def _write(self, event: str, counted: bool = True, **fields: Any) -> None:
        """Append one event (caller holds the lock)."""
        if self._log is None:
            return
        self._log.write(json.dumps({"event": event, **fields}) + "\n")
        self._log.flush()
        if counted:
            self._log_records += 1

    def log_resume(self, step: int, version: int, keep: int | None, **info: Any) -> None:
        """Mark a resume from the checkpoint of ``step`` (``keep``: its ``log_records``; None = unknown)."""
        with self._lock:
            self._write("resume", counted=False, step=int(step), version=int(version), keep=keep, **info)

    def close(self) -> None:
        with self._lock:
            if self._log is not None:
                self._log.close()
                self._log = None

    # -- settling ----------------------------------------------------------------------------
    def on_draw(self, ticket: Any, item: Any) -> None:
        with self._lock:
            if self._pending is None or self._pending[1] is not item:
                raise RuntimeError("DataLedger.on_draw: no pending draw for this item")
            self._outstanding[ticket.id] = self._pending
            self._pending = None

    def draw_index(self, ticket: Any) -> int:
        with self._lock:
            return self._outstanding[ticket.id][0]

    def restore(self, ticket: Any, draw: int, **info: Any) -> Any:
        """Bind the outstanding (to-be-replayed) item of ``draw`` to a group restored from the
        checkpoint under ``ticket``; returns the item. KeyError if ``draw`` is not outstanding."""
        with self._lock:
            for k, (idx, item) in enumerate(self._replay):  # noqa: B007 (item: used after the break)
                if idx == draw:
                    del self._replay[k]
                    break
            else:
                raise KeyError(f"DataLedger.restore: draw {draw} is not among the outstanding items")
            self._outstanding[ticket.id] = (idx, item)
            self._restored_tickets.add(ticket.id)
            self.n_restored += 1
            self._write("restore", draw=int(draw), id=_item_id(item), **info)
            return item

    def replay_item(self, draw: int) -> Any | None:
        """The outstanding item of ``draw`` waiting to be replayed (None if there is none)."""
        with self._lock:
            return next((it for idx, it in self._replay if idx == draw), None)

    def drop_restored(self, draw: int, reason: str, **info: Any) -> None:
        """A checkpointed group of ``draw`` is not reused (``reason``); its item stays to be replayed."""
        with self._lock:
            self.n_dropped[reason] += 1
            self._write("drop", draw=int(draw), reason=reason, **info)

    def freeze(self) -> None:
        """From now on (the loop is shutting down) a rejected group keeps its item outstanding, to be
        replayed after a resume: groups aborted by the shutdown are not data lost."""
        with self._lock:
            self._frozen = True

    def on_reject(self, ticket: Any, item: Any, reason: str) -> None:
        with self._lock:
            entry = self._outstanding.get(ticket.id)
            if self._frozen:
                self.n_aborted += 1
                if entry is not None:
                    self._write("abort", draw=entry[0], reason=reason)
                return
            self._outstanding.pop(ticket.id, None)
            self._restored_tickets.discard(ticket.id)
            self.n_rejected[reason] += 1
            if entry is not None:
                self._write("reject", draw=entry[0], id=_item_id(entry[1]), reason=reason)

    def consumed(self, ticket_ids: Sequence[int], *, step: int | None = None, version: int | None = None,
                 lags: Sequence[int] | None = None) -> list[int]:
        """Settle consumed groups (trained by ``step``, 1-based, at ``version``); returns their draw indices."""
        with self._lock:
            entries = [self._outstanding.pop(t) for t in ticket_ids]
            restored = [t in self._restored_tickets for t in ticket_ids]
            self._restored_tickets.difference_update(ticket_ids)
            self.n_consumed += len(entries)
            self._write("consume", step=step, version=version, draws=[i for i, _ in entries],
                        ids=[_item_id(it) for _, it in entries], lags=None if lags is None else [int(x) for x in lags],
                        restored=restored)
            return [i for i, _ in entries]

    @property
    def outstanding(self) -> int:
        with self._lock:
            return len(self._outstanding) + (self._pending is not None) + len(self._replay)

    def state(self) -> dict[str, Any]:
        with self._lock:
            items = list(self._outstanding.values()) + ([self._pending] if self._pending else []) + list(self._replay)
            return {"source": self.source.get_state() if hasattr(self.source, "get_state") else None,
                    "next_draw": self._next_draw, "log_records": self._log_records,
                    "outstanding": [{"draw": i, "item": record_to_json(it)} for i, it in sorted(items, key=lambda x: x[0])]}


def _item_id(item: Any) -> Any:
    v = item.get("id") if isinstance(item, Mapping) else getattr(item, "id", None)
    return v if v is None or isinstance(v, (str, int)) else str(v)


def repair_jsonl_tail(path: str) -> None:
    """Drop a partial last line (a process killed mid-write) so appended lines stay valid JSONL."""
    if not os.path.isfile(path) or os.path.getsize(path) == 0:
        return
    with open(path, "rb+") as f:
        f.seek(-1, os.SEEK_END)
        if f.read(1) == b"\n":
            return
        f.seek(0)
        data = f.read()
        keep = data.rfind(b"\n") + 1
        f.truncate(keep)
    log.warning("%s: dropped a partial last line (%d bytes) left by an interrupted write", path, len(data) - keep)


@dataclasses.dataclass
class LedgerHistory:
    """``RUN/data_ledger.jsonl`` resolved: ``effective`` = the events of the run's surviving history
    (what the final state was built from), ``discarded`` = events written after a checkpoint that a
    later resume went back to (work redone), ``resumes`` = the resume markers, in order."""

    effective: list[dict[str, Any]]
    discarded: list[dict[str, Any]]
    resumes: list[dict[str, Any]]

    def events(self, kind: str, effective: bool = True) -> list[dict[str, Any]]:
        return [e for e in (self.effective if effective else self.discarded) if e["event"] == kind]


def read_data_ledger(run_dir: str) -> LedgerHistory:
    """Parse ``RUN/data_ledger.jsonl`` and apply its resume markers (see ``DataLedger``)."""
    path = os.path.join(run_dir, LEDGER_LOG)
    effective: list[dict[str, Any]] = []
    discarded: list[dict[str, Any]] = []
    resumes: list[dict[str, Any]] = []
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            ev = json.loads(line)
        except json.JSONDecodeError as e:
            if n == len(lines):  # a partial last line of a killed writer
                continue
            raise ValueError(f"{path}:{n}: invalid JSON ({e})") from None
        if ev.get("event") == "resume":
            keep = ev.get("keep")
            if keep is not None:
                if keep > len(effective):
                    raise ValueError(f"{path}:{n}: resume keeps {keep} events but only {len(effective)} precede it "
                                     "(the log lost lines)")
                discarded.extend(effective[keep:])
                del effective[keep:]
            resumes.append(ev)
        else:
            effective.append(ev)
    return LedgerHistory(effective, discarded, resumes)


def record_to_json(item: Any) -> Any:
    if dataclasses.is_dataclass(item):
        return {"__record__": type(item).__name__, **dataclasses.asdict(item)}
    return item


def record_from_json(obj: Any) -> Any:
    """Inverse of `record_to_json` after a checkpoint's JSON round trip (`checkpoint.codec`: bytes and arrays come
    back as such, tuples as lists): a ``PromptRecord``, or a ``VLPromptRecord`` with its encoded images, grids and
    image processor settings (so a replayed prompt is submitted with its images)."""
    kind = obj.get("__record__") if isinstance(obj, dict) else None
    if kind == "PromptRecord":
        from jaxrl_async.data.datasets import PromptRecord

        d = {k: v for k, v in obj.items() if k != "__record__"}
        return PromptRecord(**d)
    if kind == "VLPromptRecord":
        import numpy as np

        from jaxrl_async.data.images import ImageProcessorConfig, VLPromptRecord

        d = {k: v for k, v in obj.items() if k != "__record__"}
        ip = {k: tuple(v) if isinstance(v, list) else v for k, v in dict(d.pop("image_processor")).items()}
        images = tuple(bytes(b) for b in d.pop("images"))
        grids = np.asarray(d.pop("image_grid_thw"), np.int64).reshape(-1, 3)
        return VLPromptRecord(**d, images=images, image_grid_thw=grids, image_processor=ImageProcessorConfig(**ip))
    return obj
