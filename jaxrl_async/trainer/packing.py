"""Sequence packing: variable-length trajectories -> fixed-shape, token-budget micro-batches.

A `TrainSequence` is one sampled sequence (prompt + completion) with per-token arrays that are
*aligned with the tokens*: `x[t]` belongs to token `t` (the log-prob of token t given tokens
< t, its advantage, whether it is trained on). This is the convention of
`transformer.sequence_logprobs` (so no AReaL-style left roll is needed); token 0 of a
sequence is never predicted, hence `loss_mask[0]` must be 0.

Layout of a packed minibatch (all arrays `[n_micro, rows_per_micro, row_len]`):

* `row_len` is the smallest entry of `PackingConfig.row_len_buckets` that holds the longest
  sequence of the minibatch; `rows_per_micro = tokens_per_micro // row_len` (rounded down to a
  multiple of `row_multiple`, the data-parallel size, at least `row_multiple`), so every
  micro-batch has the same token budget whatever the bucket.
* Sequences go into rows by first-fit-decreasing (capacity `row_len` tokens and at most
  `max_seqs_per_row` sequences per row). Each sequence gets its own segment id (1, 2, ... within
  its row; 0 = padding) and positions 0..n-1, so attention never crosses sequences.
* Rows fill micro-batches in order; the number of micro-batches is rounded up to the next entry
  of `n_micro_buckets` with empty micro-batches (all padding). Padding has loss_mask 0,
  segment id 0 and log-probs/advantages 0, so it contributes exactly nothing to the loss.

Hence a minibatch's shapes come from |row_len_buckets| x |n_micro_buckets| possibilities and
the jitted train step compiles at most that many times, never per batch content.

`seq_ids[m, r, t] = r * max_seqs_per_row + slot` is the *micro-batch-local* sequence index
(slot = order in the row), padding gets `num_seqs - 1` (a reserved, always empty id), with
`num_seqs = rows_per_micro * max_seqs_per_row + 1` a static size for segment reductions
(sequence-level losses: GSPO ratio, sequence-mean aggregation). Every sequence lies in a single
row, so per-micro-batch segment reductions are exact. `seq_index` (host only) is the global
trajectory index, -1 on padding (for unpacking results back to trajectories).

The global counts needed to normalise the loss across micro-batches (and data-parallel
shards), `n_loss_tokens = sum of loss_mask` and `n_seqs`, are computed on the host.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

__all__ = [
    "TrainSequence", "PackingConfig", "PackedBatch", "PackedMinibatch", "PackingError",
    "validate_trajectory", "pack", "split_minibatches", "unpack",
]


class PackingError(ValueError):
    """A trajectory or batch cannot be packed (bad shapes, non-finite values, too long, empty)."""


@dataclasses.dataclass
class TrainSequence:
    """One sequence on the host, all per-token arrays of length n = len(tokens).

    tokens: prompt + completion token ids.
    loss_mask: 1 on trained (completion) tokens, 0 elsewhere; loss_mask[0] must be 0.
    behaviour_logprobs: log pi_behav(token t | < t) from the generator (0 where loss_mask is 0).
    advantages: per-token advantage (used where loss_mask is 1).
    versions: policy version that generated token t (-1 on prompt tokens); default all -1.
    proximal_logprobs: optional log pi_prox; normally filled by the trainer (recompute) or
        approximated in the loss (loglinear).
    routing: optional int [n, L, k], the experts the generator routed token t to in each MoE layer (-1: not
        recorded); packed into `PackedBatch.routing` for rollout routing replay and the router metrics.
    """

    tokens: np.ndarray
    loss_mask: np.ndarray
    behaviour_logprobs: np.ndarray
    advantages: np.ndarray
    versions: np.ndarray | None = None
    proximal_logprobs: np.ndarray | None = None
    routing: np.ndarray | None = None

    def __len__(self) -> int:
        return int(np.asarray(self.tokens).shape[0])


@dataclasses.dataclass(frozen=True)
class PackingConfig:
    """Shapes of packed micro-batches.

    tokens_per_micro: token budget of one micro-batch (rows_per_micro * row_len).
    row_len_buckets: allowed row lengths (ascending); the longest sequence picks the bucket.
    n_micro_buckets: allowed numbers of micro-batches per minibatch (ascending); None = powers of 2.
        Beyond the largest bucket, the count is rounded up to a multiple of it.
    max_seqs_per_row: at most this many sequences share a row (bounds the segment tables).
    row_multiple: rows_per_micro is a multiple of this (set it to the data-parallel size).
    check_finite: reject non-finite advantages / behaviour (/ proximal) log-probs on loss tokens on
        the host with an error naming the trajectory and field (the jitted step additionally
        skips any update whose loss or gradient is not finite).
    """

    tokens_per_micro: int = 8192
    row_len_buckets: tuple[int, ...] = (128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
    n_micro_buckets: tuple[int, ...] | None = None
    max_seqs_per_row: int = 16
    row_multiple: int = 1
    check_finite: bool = True

    def __post_init__(self):
        def bad(field, msg):
            raise ValueError(f"PackingConfig.{field}: {msg}")

        if self.tokens_per_micro <= 0:
            bad("tokens_per_micro", f"must be positive, got {self.tokens_per_micro}")
        b = tuple(self.row_len_buckets)
        if not b or any(x < 2 for x in b) or list(b) != sorted(set(b)):
            bad("row_len_buckets", f"must be strictly ascending ints >= 2, got {b}")
        if self.n_micro_buckets is not None:
            m = tuple(self.n_micro_buckets)
            if not m or any(x < 1 for x in m) or list(m) != sorted(set(m)):
                bad("n_micro_buckets", f"must be strictly ascending positive ints, got {m}")
        if self.max_seqs_per_row < 1:
            bad("max_seqs_per_row", f"must be >= 1, got {self.max_seqs_per_row}")
        if self.row_multiple < 1:
            bad("row_multiple", f"must be >= 1, got {self.row_multiple}")

    def row_len_for(self, max_len: int) -> int:
        for b in self.row_len_buckets:
            if b >= max_len:
                return b
        raise PackingError(
            f"a sequence of {max_len} tokens is longer than the largest row_len bucket "
            f"{self.row_len_buckets[-1]} (PackingConfig.row_len_buckets)")

    def rows_per_micro(self, row_len: int) -> int:
        k = self.row_multiple
        return max(k, (self.tokens_per_micro // row_len) // k * k)

    def n_micro_for(self, n_needed: int) -> int:
        n_needed = max(1, n_needed)
        if self.n_micro_buckets is None:
            return 1 << (n_needed - 1).bit_length()
        for b in self.n_micro_buckets:
            if b >= n_needed:
                return b
        top = self.n_micro_buckets[-1]
        return -(-n_needed // top) * top

    def num_seqs(self, row_len: int) -> int:
        """Static size of the micro-batch-local sequence-id space (last id = padding)."""
        return self.rows_per_micro(row_len) * self.max_seqs_per_row + 1


# Arrays of a packed minibatch that go to the device, in this order.
DEVICE_FIELDS = ("tokens", "segment_ids", "positions", "loss_mask", "behaviour_logprobs", "proximal_logprobs",
                 "advantages", "versions", "seq_ids")


@dataclasses.dataclass
class PackedBatch:
    """Device-side arrays, each [n_micro, rows_per_micro, row_len] (a pytree; see register below)."""

    tokens: np.ndarray  # int32
    segment_ids: np.ndarray  # int32, 0 = padding
    positions: np.ndarray  # int32, position within the sequence
    loss_mask: np.ndarray  # float32 0/1
    behaviour_logprobs: np.ndarray  # float32
    proximal_logprobs: np.ndarray  # float32 (placeholder = behaviour until recomputed)
    advantages: np.ndarray  # float32
    versions: np.ndarray  # int32, -1 on prompt / padding
    seq_ids: np.ndarray  # int32, micro-batch-local sequence id (num_seqs - 1 = padding)
    # int16 [n_micro, rows, row_len, L, k] recorded experts (-1: none, padding), or None when no trajectory of the
    # minibatch carries routing (then nothing of it is traced)
    routing: np.ndarray | None = None

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(self.tokens.shape)  # type: ignore[return-value]

    def replace(self, **kw) -> "PackedBatch":
        return dataclasses.replace(self, **kw)


def _register():
    import jax

    jax.tree_util.register_dataclass(PackedBatch, data_fields=list(DEVICE_FIELDS) + ["routing"], meta_fields=[])


_register()


@dataclasses.dataclass
class PackedMinibatch:
    """A packed minibatch: device arrays plus host-side counts and placement.

    n_loss_tokens: sum of loss_mask over the minibatch (global token-mean normaliser).
    n_seqs: number of trajectories in the minibatch.
    n_loss_seqs: trajectories with at least one loss token (sequence-mean normaliser).
    num_seqs: static local sequence-id space size (see module doc).
    n_real_micro: micro-batches that hold at least one sequence (the rest are bucket padding).
    placement: per trajectory (in `indices` order) its (micro, row, start, length).
    indices: global indices (into the list given to `pack`) of the trajectories, in order.
    """

    batch: PackedBatch
    n_loss_tokens: int
    n_seqs: int
    n_loss_seqs: int
    num_seqs: int
    n_real_micro: int
    n_tokens: int
    placement: list[tuple[int, int, int, int]]
    indices: list[int]
    has_proximal: bool

    @property
    def row_len(self) -> int:
        return self.batch.shape[2]

    @property
    def rows_per_micro(self) -> int:
        return self.batch.shape[1]

    @property
    def n_micro(self) -> int:
        return self.batch.shape[0]

    @property
    def seq_index(self) -> np.ndarray:
        """[n_micro, rows, row_len] global trajectory index, -1 on padding."""
        out = np.full(self.batch.shape, -1, np.int64)
        for idx, (m, r, s, n) in zip(self.indices, self.placement):
            out[m, r, s:s + n] = idx
        return out


def validate_trajectory(traj: TrainSequence, i: int, check_finite: bool = True) -> None:
    """Raise PackingError naming trajectory `i` and the field for any malformed array."""
    tokens = np.asarray(traj.tokens)
    if tokens.ndim != 1 or tokens.shape[0] < 2:
        raise PackingError(f"trajectory {i}: tokens must be 1-D with >= 2 tokens, got shape {tokens.shape}")
    if not np.issubdtype(tokens.dtype, np.integer):
        raise PackingError(f"trajectory {i}: tokens must be integers, got dtype {tokens.dtype}")
    n = tokens.shape[0]
    fields = {"loss_mask": traj.loss_mask, "behaviour_logprobs": traj.behaviour_logprobs,
              "advantages": traj.advantages, "versions": traj.versions, "proximal_logprobs": traj.proximal_logprobs}
    for name, arr in fields.items():
        if arr is None:
            if name in ("loss_mask", "behaviour_logprobs", "advantages"):
                raise PackingError(f"trajectory {i}: field {name} is missing")
            continue
        a = np.asarray(arr)
        if a.shape != (n,):
            raise PackingError(f"trajectory {i}: field {name} has shape {a.shape}, expected ({n},) like tokens")
    if traj.routing is not None and (np.ndim(traj.routing) != 3 or np.shape(traj.routing)[0] != n):
        raise PackingError(f"trajectory {i}: field routing has shape {np.shape(traj.routing)}, expected ({n}, L, k)")
    mask = np.asarray(traj.loss_mask)
    if not np.all((mask == 0) | (mask == 1)):
        raise PackingError(f"trajectory {i}: field loss_mask must be 0/1")
    if mask[0] != 0:
        raise PackingError(f"trajectory {i}: loss_mask[0] must be 0 (the first token of a sequence is never predicted)")
    if check_finite:
        on = mask.astype(bool)
        for name in ("advantages", "behaviour_logprobs", "proximal_logprobs"):
            arr = fields[name]
            if arr is None:
                continue
            a = np.asarray(arr, np.float64)[on]
            if not np.all(np.isfinite(a)):
                t = int(np.flatnonzero(on)[~np.isfinite(a)][0])
                raise PackingError(f"trajectory {i}: field {name} is not finite at token {t} ({a[~np.isfinite(a)][0]})")


def ffd_rows(lengths: Sequence[int], row_len: int, max_seqs: int) -> list[list[int]]:
    """First-fit-decreasing bin packing of sequence indices into rows of capacity row_len."""
    order = sorted(range(len(lengths)), key=lambda j: (-lengths[j], j))
    rows: list[list[int]] = []
    free: list[int] = []
    for j in order:
        n = lengths[j]
        for r, f in enumerate(free):
            if f >= n and len(rows[r]) < max_seqs:
                rows[r].append(j)
                free[r] -= n
                break
        else:
            rows.append([j])
            free.append(row_len - n)
    return rows


def pack(trajectories: Sequence[TrainSequence], cfg: PackingConfig, indices: Sequence[int] | None = None) -> PackedMinibatch:
    """Pack trajectories into micro-batches (see module doc). `indices` label them in errors/placement."""
    if len(trajectories) == 0:
        raise PackingError("cannot pack an empty minibatch (no trajectories)")
    indices = list(range(len(trajectories))) if indices is None else list(indices)
    for traj, i in zip(trajectories, indices):
        validate_trajectory(traj, i, cfg.check_finite)
    lengths = [len(t) for t in trajectories]
    longest = int(np.argmax(lengths))
    if lengths[longest] > cfg.row_len_buckets[-1]:
        raise PackingError(
            f"trajectory {indices[longest]} has {lengths[longest]} tokens, longer than the largest row_len "
            f"bucket {cfg.row_len_buckets[-1]} (PackingConfig.row_len_buckets)")
    per_seq_loss = [int(np.asarray(t.loss_mask).sum()) for t in trajectories]
    n_loss = int(sum(per_seq_loss))
    if n_loss == 0:
        raise PackingError(f"minibatch of trajectories {indices[:8]}{'...' if len(indices) > 8 else ''} has an "
                           f"empty loss_mask (no token to train on)")
    row_len = cfg.row_len_for(max(lengths))
    R = cfg.rows_per_micro(row_len)
    S = cfg.max_seqs_per_row
    rows = ffd_rows(lengths, row_len, S)
    n_real = math.ceil(len(rows) / R)
    M = cfg.n_micro_for(n_real)
    num_seqs = R * S + 1
    shape = (M, R, row_len)
    tokens = np.zeros(shape, np.int32)
    seg = np.zeros(shape, np.int32)
    pos = np.zeros(shape, np.int32)
    mask = np.zeros(shape, np.float32)
    blp = np.zeros(shape, np.float32)
    plp = np.zeros(shape, np.float32)
    adv = np.zeros(shape, np.float32)
    ver = np.full(shape, -1, np.int32)
    sid = np.full(shape, num_seqs - 1, np.int32)
    placement: list[tuple[int, int, int, int] | None] = [None] * len(trajectories)
    has_prox = all(t.proximal_logprobs is not None for t in trajectories)
    routed = [t.routing for t in trajectories if t.routing is not None]
    route = None
    if routed:  # trajectories without a recording route freely (-1), like padding
        if len({np.shape(r)[1:] for r in routed}) > 1:
            raise PackingError(f"trajectories of minibatch {indices[:8]} carry routing of different [L, k] shapes")
        route = np.full(shape + np.shape(routed[0])[1:], -1, np.int16)
    for k, row in enumerate(rows):
        m, r = divmod(k, R)
        start = 0
        for slot, j in enumerate(row):
            t = trajectories[j]
            n = lengths[j]
            sl = np.s_[m, r, start:start + n]
            lm = np.asarray(t.loss_mask, np.float32)
            on = lm > 0
            tokens[sl] = np.asarray(t.tokens)
            seg[sl] = slot + 1
            pos[sl] = np.arange(n)
            mask[sl] = lm
            # Values off the loss mask are zeroed: they can never leak into the loss (e.g. NaN * 0).
            blp[sl] = np.where(on, np.asarray(t.behaviour_logprobs, np.float32), 0.0)
            adv[sl] = np.where(on, np.asarray(t.advantages, np.float32), 0.0)
            plp[sl] = np.where(on, np.asarray(t.proximal_logprobs, np.float32), 0.0) if has_prox else blp[sl]
            if t.versions is not None:
                ver[sl] = np.asarray(t.versions, np.int32)
            if route is not None and t.routing is not None:
                route[sl] = np.asarray(t.routing, np.int16)
            sid[sl] = r * S + slot
            placement[j] = (m, r, start, n)
            start += n
    batch = PackedBatch(tokens=tokens, segment_ids=seg, positions=pos, loss_mask=mask, behaviour_logprobs=blp,
                        proximal_logprobs=plp, advantages=adv, versions=ver, seq_ids=sid, routing=route)
    return PackedMinibatch(batch=batch, n_loss_tokens=n_loss, n_seqs=len(trajectories),
                           n_loss_seqs=sum(c > 0 for c in per_seq_loss), num_seqs=num_seqs,
                           n_real_micro=n_real, n_tokens=int(sum(lengths)), placement=placement,  # type: ignore[arg-type]
                           indices=indices, has_proximal=has_prox)


def split_minibatches(trajectories: Sequence[TrainSequence], n_minibatches: int) -> list[list[int]]:
    """Split trajectory indices into `n_minibatches` groups of balanced token counts.

    Longest-processing-time greedy (longest trajectory first, into the group with the fewest
    tokens so far); each group is returned in ascending index order. Like AReaL's ppo_update,
    which splits the batch into `ppo_n_minibatches` token-balanced minibatches.
    """
    n = len(trajectories)
    if n_minibatches < 1:
        raise ValueError(f"ppo_n_minibatches must be >= 1, got {n_minibatches}")
    if n < n_minibatches:
        raise PackingError(f"cannot split {n} trajectories into ppo_n_minibatches={n_minibatches} minibatches")
    if n_minibatches == 1:
        return [list(range(n))]
    lengths = [len(t) for t in trajectories]
    groups: list[list[int]] = [[] for _ in range(n_minibatches)]
    load = [0] * n_minibatches
    for j in sorted(range(n), key=lambda j: (-lengths[j], j)):
        g = min(range(n_minibatches), key=lambda g: (load[g], len(groups[g]), g))
        groups[g].append(j)
        load[g] += lengths[j]
    return [sorted(g) for g in groups]


def unpack(values: np.ndarray, packed: PackedMinibatch) -> list[np.ndarray]:
    """Per-token values [n_micro, rows, row_len] -> one array per trajectory (in `packed.indices` order)."""
    values = np.asarray(values)
    if values.shape[:3] != packed.batch.shape:
        raise ValueError(f"unpack: values shape {values.shape} does not match the packed shape {packed.batch.shape}")
    return [values[m, r, s:s + n] for (m, r, s, n) in packed.placement]
