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

Images (Qwen2.5-VL, `vl_batch.py`): when a sequence of the minibatch carries `images`, the batch also
holds the M-RoPE positions of every token, the feature row of every image placeholder and, per
micro-batch, the pixel patches of its distinct images padded to a bucketed patch count
(`PackingConfig.patch_buckets`) with their vision layout. Text-only minibatches carry none of it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from jaxrl_async.trainer.vl_batch import VisionBatch

if TYPE_CHECKING:
    from jaxrl_async.data.images import ImageInputs

__all__ = [
    "TrainSequence", "PackingConfig", "PackedBatch", "PackedMinibatch", "PackingError",
    "validate_trajectory", "pack", "split_minibatches", "unpack", "check_image_tokens", "pack_images",
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
    images: the images of the sequence's prompt (`data.images.ImageInputs`: encoded bytes + grids, shared by the
        samples of a prompt), or None; their placeholder tokens must be in `tokens` (a VL model's trainer packs
        them, `vl_batch.py`).
    """

    tokens: np.ndarray
    loss_mask: np.ndarray
    behaviour_logprobs: np.ndarray
    advantages: np.ndarray
    versions: np.ndarray | None = None
    proximal_logprobs: np.ndarray | None = None
    routing: np.ndarray | None = None
    images: "ImageInputs | None" = None

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
    patch_buckets: (minibatches with images) allowed pixel-patch counts per micro-batch (ascending); the micro-batch
        with the most patches of its distinct images picks the bucket. None = powers of two (at least 64).
        Beyond the largest bucket, the count is rounded up to a multiple of it. Each must be a multiple of the
        vision tower's merge unit (m^2 = 4 for Qwen2.5-VL), checked when packing.
    check_finite: reject non-finite advantages / behaviour (/ proximal) log-probs on loss tokens on
        the host with an error naming the trajectory and field (the jitted step additionally
        skips any update whose loss or gradient is not finite).
    """

    tokens_per_micro: int = 8192
    row_len_buckets: tuple[int, ...] = (128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
    n_micro_buckets: tuple[int, ...] | None = None
    max_seqs_per_row: int = 16
    row_multiple: int = 1
    patch_buckets: tuple[int, ...] | None = None
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
        if self.patch_buckets is not None:
            pb = tuple(self.patch_buckets)
            if not pb or any(x < 1 for x in pb) or list(pb) != sorted(set(pb)):
                bad("patch_buckets", f"must be strictly ascending positive ints, got {pb}")

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

    def patches_for(self, n_needed: int) -> int:
        """The bucketed pixel-patch count of a micro-batch (minibatches with images)."""
        n_needed = max(1, n_needed)
        if self.patch_buckets is None:
            return max(64, 1 << (n_needed - 1).bit_length())
        for b in self.patch_buckets:
            if b >= n_needed:
                return b
        top = self.patch_buckets[-1]
        return -(-n_needed // top) * top

    def num_seqs(self, row_len: int) -> int:
        """Static size of the micro-batch-local sequence-id space (last id = padding)."""
        return self.rows_per_micro(row_len) * self.max_seqs_per_row + 1


# Arrays of a packed minibatch that go to the device, in this order.
DEVICE_FIELDS = ("tokens", "segment_ids", "positions", "loss_mask", "behaviour_logprobs", "proximal_logprobs",
                 "advantages", "versions", "seq_ids")
# ... and those present only for some minibatches (None otherwise: nothing of them is traced).
OPTIONAL_FIELDS = ("routing", "mrope_positions", "image_index", "vision")


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
    # Minibatches with images (`vl_batch.py`), else None: int32 [n_micro, rows, row_len, 3] M-RoPE positions
    # (temporal, height, width) of every token; int32 [n_micro, rows, row_len] the row of the micro-batch's image
    # features each image placeholder takes (-1 elsewhere); the micro-batches' pixels and vision layout.
    mrope_positions: np.ndarray | None = None
    image_index: np.ndarray | None = None
    vision: VisionBatch | None = None

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(self.tokens.shape)  # type: ignore[return-value]

    def replace(self, **kw) -> "PackedBatch":
        return dataclasses.replace(self, **kw)


def _register():
    import jax

    jax.tree_util.register_dataclass(PackedBatch, data_fields=list(DEVICE_FIELDS) + list(OPTIONAL_FIELDS),
                                     meta_fields=[])


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
    image_stats: (minibatches with images) host counts of the images moved: ``images`` / ``image_sets``
        (distinct images / `ImageInputs` contents of the minibatch), ``encoded_bytes`` (what the trajectories
        carried: those objects' encoded files + grids, once per object), ``decoded_bytes`` (their float32 patches,
        decoded once per object), ``device_bytes`` (the vision inputs `put_batch` sends: pixels with bucket
        padding, layout, M-RoPE positions, feature indices), ``pixel_bytes`` (of which pixels: one temporal
        copy per patch), ``patches`` (the patch bucket). None otherwise (`train_step.image_metrics`).
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
    image_stats: dict[str, int] | None = None

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


def pack(trajectories: Sequence[TrainSequence], cfg: PackingConfig, indices: Sequence[int] | None = None,
         model_cfg: Any = None) -> PackedMinibatch:
    """Pack trajectories into micro-batches (see module doc). `indices` label them in errors/placement.
    `model_cfg`: the model's config; a `qwen2_5_vl.VLConfig` is required when a trajectory carries images."""
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
    image_stats = None
    if any(t.images is not None for t in trajectories):
        vl, image_stats = pack_images(trajectories, placement, indices, shape, cfg, model_cfg)  # type: ignore[arg-type]
        batch = batch.replace(**vl)
    elif _is_vl(model_cfg):  # a VL model: no stray placeholders in text rows
        for t, i in zip(trajectories, indices):
            check_image_tokens(t, i, model_cfg)
    return PackedMinibatch(batch=batch, n_loss_tokens=n_loss, n_seqs=len(trajectories),
                           n_loss_seqs=sum(c > 0 for c in per_seq_loss), num_seqs=num_seqs,
                           n_real_micro=n_real, n_tokens=int(sum(lengths)), placement=placement,  # type: ignore[arg-type]
                           indices=indices, has_proximal=has_prox, image_stats=image_stats)


# ---------------------------------------------------------------------------------------------
# Minibatches with images (Qwen2.5-VL; the fields and the device side: vl_batch.py)
# ---------------------------------------------------------------------------------------------
def _is_vl(model_cfg: Any) -> bool:
    from jaxrl_async.models.qwen2_5_vl import is_vl

    return is_vl(model_cfg)


def check_image_tokens(traj: Any, i: int, vl_cfg: Any, what: str = "trajectory") -> None:
    """PackingError naming trajectory `i` when its image placeholders do not match its images' grids, or when its
    images were processed for another vision tower. `traj`: anything with ``images`` and ``tokens`` (or
    ``prompt_ids``: an SFT example, named `what`)."""
    if hasattr(traj, "tokens"):  # the prompt part: the tokens before the first trained one (the generated tokens
        # after it may hold the placeholder id: text there, as in the generator, `qwen2_5_vl.sequence_layout`)
        trained = np.flatnonzero(np.asarray(traj.loss_mask) > 0)
        tokens = np.asarray(traj.tokens)[: trained[0] if trained.size else None]
    else:
        tokens = traj.prompt_ids
    n_tokens = int((np.asarray(tokens) == vl_cfg.image_token_id).sum())
    images = traj.images
    if images is None:
        if n_tokens:
            raise PackingError(f"{what} {i}: {n_tokens} image placeholder tokens (id {vl_cfg.image_token_id}) but "
                               f"no images (field images is None)")
        return
    v = vl_cfg.vision
    grids = np.asarray(images.grid_thw).reshape(-1, 3)
    n_feats = int(np.prod(grids, axis=1).sum()) // v.merge_unit
    if n_tokens != n_feats:
        raise PackingError(f"{what} {i}: {n_tokens} image placeholder tokens but field images (grids "
                           f"{grids.tolist()}) gives {n_feats} image features")
    proc = images.processor
    if (proc.patch_size, proc.temporal_patch_size, proc.merge_size) != (v.patch_size, v.temporal_patch_size,
                                                                        v.spatial_merge_size):
        raise PackingError(f"{what} {i}: field images was processed with patch {proc.patch_size}, temporal patch "
                           f"{proc.temporal_patch_size}, merge {proc.merge_size}; the vision tower needs "
                           f"{v.patch_size}, {v.temporal_patch_size}, {v.spatial_merge_size}")


def pack_images(trajectories: Sequence[Any], placement: Sequence[tuple[int, int, int, int]], indices: Sequence[int],
                shape: tuple[int, int, int], cfg: Any, model_cfg: Any) -> tuple[dict[str, Any], dict[str, int]]:
    """The `PackedBatch` fields of a minibatch with images (``mrope_positions``, ``image_index``, ``vision``; see
    `vl_batch`'s module doc) and its image statistics (`PackedMinibatch.image_stats`). `placement[j]` = (micro, row,
    start, length) of trajectory j, `shape` = (n_micro, rows, row_len)."""
    from jaxrl_async.models.qwen2_5_vl import sequence_layout
    from jaxrl_async.models.vision import vision_layout

    first = next(indices[j] for j, t in enumerate(trajectories) if t.images is not None)
    if not _is_vl(model_cfg):
        raise PackingError(f"trajectory {first} carries images but the model is not a vision-language model "
                           f"(model config {type(model_cfg).__name__}, expected a qwen2_5_vl.VLConfig)")
    for t, i in zip(trajectories, indices):
        check_image_tokens(t, i, model_cfg)
    v = model_cfg.vision
    mu = v.merge_unit
    M, R, T = shape
    mrope = np.zeros(shape + (3,), np.int32)
    index = np.full(shape, -1, np.int32)
    # per micro-batch: its distinct image sets (by content) in order of first use, and their first feature row
    sets: list[dict[str, tuple[Any, int]]] = [{} for _ in range(M)]
    units = [0] * M
    canonical: dict[str, Any] = {}  # content digest -> the first object with it (decoded once)
    digests: dict[int, str] = {}  # id(object) -> its digest (hashed once per object)
    for j in sorted(range(len(trajectories)), key=lambda j: placement[j][:3]):  # row-major token order
        t = trajectories[j]
        m, r, s, n = placement[j]
        assert s + n <= T, f"trajectory {indices[j]} crosses the end of its row"  # never split: images stay whole
        tokens = np.asarray(t.tokens)
        grids = [] if t.images is None else [tuple(int(x) for x in g) for g in np.asarray(t.images.grid_thw)]
        try:
            pos, _, feat = sequence_layout(model_cfg, tokens, grids or None)
        except ValueError as e:
            raise PackingError(f"trajectory {indices[j]}: field images: {e}") from None
        mrope[m, r, s:s + n] = pos.T
        if t.images is None:
            continue
        key = digests.get(id(t.images))
        if key is None:
            key = digests[id(t.images)] = t.images.digest
        obj = canonical.setdefault(key, t.images)
        if key not in sets[m]:
            sets[m][key] = (obj, units[m])
            units[m] += obj.num_patches // mu
        offset = sets[m][key][1]
        where = np.flatnonzero(feat >= 0)
        index[m, r, s + where] = offset + feat[where]
    need = max(units) * mu
    P = cfg.patches_for(need)
    if P % mu:
        raise PackingError(f"PackingConfig.patch_buckets: bucket {P} (for {need} patches) is not a multiple of the "
                           f"vision tower's merge unit {mu}")
    dim, frame = v.patch_dim, v.in_channels * v.patch_size ** 2
    pixels = np.zeros((M, P, frame), np.float32)  # one temporal copy per patch (images repeat their frame Tp times)
    order = np.broadcast_to(np.arange(P, dtype=np.int32), (M, P)).copy()
    unorder = np.broadcast_to(np.arange(P // mu, dtype=np.int32), (M, P // mu)).copy()
    hw = np.zeros((M, P, 2), np.int32)
    frames = np.full((M, P), -1, np.int32)  # padding patches: their own frame and window (real ids are >= 0)
    windows = np.full((M, P), -1, np.int32)
    for m in range(M):
        objs = [obj for obj, _ in sets[m].values()]
        if not objs:
            continue
        px = []
        for obj_key, obj in zip(sets[m], objs):
            p = obj.pixel_values()  # decoded once per object (cached on it)
            copies = p.reshape(p.shape[0], v.in_channels, -1, v.patch_size ** 2) if p.shape[1] == dim else None
            if copies is None or not all(np.array_equal(copies[:, :, 0], copies[:, :, k])
                                         for k in range(1, v.temporal_patch_size)):
                bad = next(indices[j] for j, t in enumerate(trajectories) if digests.get(id(t.images)) == obj_key)
                why = (f"has {p.shape[1]} values per patch, the vision tower takes {dim}" if copies is None else
                       "holds frames that differ within a temporal patch (videos are not supported)")
                raise PackingError(f"trajectory {bad}: field images {why}")
            px.append(copies[:, :, 0].reshape(p.shape[0], frame))
        N = sum(p.shape[0] for p in px)
        np.concatenate(px, out=pixels[m, :N])
        lay = vision_layout(v, np.concatenate([np.asarray(obj.grid_thw) for obj in objs]))
        order[m, :N], unorder[m, :N // mu], hw[m, :N] = lay.order, lay.unorder, lay.hw
        frames[m, :N], windows[m, :N] = lay.frame_ids, lay.window_ids
    vision = VisionBatch(pixel_values=pixels, order=order, unorder=unorder, hw=hw, frame_ids=frames, window_ids=windows)
    stats = {"images": sum(len(o) for o in canonical.values()), "image_sets": len(canonical),
             "encoded_bytes": sum(o.nbytes for o in canonical.values()),
             "decoded_bytes": sum(o.pixel_values().nbytes for o in canonical.values()),
             "device_bytes": vision.nbytes + mrope.nbytes + index.nbytes, "pixel_bytes": pixels.nbytes, "patches": P}
    return {"mrope_positions": mrope, "image_index": index, "vision": vision}, stats


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
