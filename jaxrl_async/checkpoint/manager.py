"""Orbax checkpoints of an RL run: arrays on any mesh, loop state as JSON, buffered trajectories.

Layout of a run directory::

    RUN/checkpoints/<step>/            one committed checkpoint (Orbax step directory)
        <name>/                        one Orbax item per array tree given to `save` (params, opt_state, ...)
        meta/                          JSON: step, policy version, RNG, data-iterator and staleness state,
                                       run config, model config (HF config.json + numerical policy),
                                       trajectory skeleton (see codec.py)
        buffer/                        numeric pools of the buffered trajectories (absent when none)
        jaxrl_manifest.json            size of every file above, written inside the save's temporary
                                       directory, so it is committed atomically with the data
        _CHECKPOINT_METADATA, commit_success.txt   (Orbax)
    RUN/checkpoints/<step>.orbax-checkpoint-tmp-*  an unfinished save (ignored, removed on the next start)
    RUN/tokenizer/                     copy of the tokenizer files (made once, atomically)
    RUN/quarantine/<step>-<time>/      checkpoints skipped by `restore(fallback=True)` (moved, never deleted)

Commit protocol (Orbax AtomicRename on POSIX file systems): every byte of a save is written into
`<step>.orbax-checkpoint-tmp-*`, then `commit_success.txt` is written and the directory is renamed to
`<step>` (atomic). Killing the process at any point leaves either the complete new step or only
the temporary directory, so the previous committed step stays the latest. Old steps beyond
`keep_last` are deleted only after the new one is committed.

Save cost: `save()` blocks only while device arrays are copied to host (Orbax async save); the
write, commit and deletion of old steps run on a background thread. `SaveStats.blocking_s` and
`.total_s` (save call -> data finalized) measure both.

Restore validates before touching devices, and raises `CheckpointCorruptError` (missing/truncated
file per the manifest, unreadable metadata, tensorstore read failure) or
`CheckpointIncompatibleError` (tree structure, shape or dtype differs from the requested target);
both name the step directory and the offending file or leaf. `fallback=True` tries older committed
steps in turn and moves the skipped ones to RUN/quarantine, so a later save of the same step number
cannot collide with them.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import logging
import math
import os
import re
import shutil
import threading
import time
from typing import Any, Mapping, Sequence

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.sharding import SingleDeviceSharding

from jaxrl_async.checkpoint.codec import from_jsonable, pack_records, to_jsonable, unpack_records
from jaxrl_async.models.config import ModelConfig
from jaxrl_async.models.hf_io import TOKENIZER_FILES

log = logging.getLogger(__name__)

FORMAT = "jaxrl_async.checkpoint"
FORMAT_VERSION = 1
META_ITEM = "meta"
BUFFER_ITEM = "buffer"
MANIFEST_NAME = "jaxrl_manifest.json"
CHECKPOINTS_DIR = "checkpoints"
TOKENIZER_DIR = "tokenizer"
QUARANTINE_DIR = "quarantine"
HOST = "host"  # restore target: numpy-backed arrays on the host CPU device, no mesh needed
_ORBAX_FILES = ("_CHECKPOINT_METADATA", "commit_success.txt")  # rewritten by Orbax during commit
_ITEM_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_POLICY_FIELDS = ("dtype", "param_dtype", "remat", "scan_layers")


# ---------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------
class CheckpointError(RuntimeError):
    """Base class of checkpoint errors."""


class CheckpointNotFoundError(CheckpointError):
    """No committed checkpoint (at the requested step) exists."""


class CheckpointCorruptError(CheckpointError):
    """A committed checkpoint cannot be read: missing/truncated file, garbled metadata."""


class CheckpointIncompatibleError(CheckpointError):
    """The checkpoint is readable but does not match what the caller asked for (tree, shape, dtype)."""


# ---------------------------------------------------------------------------------------
# Configuration and records
# ---------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """When to save and what to keep.

    every_steps: save when step % every_steps == 0 (None: never by step count).
    every_seconds: save when >= every_seconds elapsed since the last save (or since start).
    keep_last: committed checkpoints kept (older ones deleted after each commit).
    async_save: write in the background (`save` returns after the device->host copy);
        False waits for the commit inside `save`.
    save_timeout_s: how long a background write may take before Orbax reports an error.
    """

    every_steps: int | None = None
    every_seconds: float | None = None
    keep_last: int = 3
    async_save: bool = True
    save_timeout_s: int = 1800

    def __post_init__(self):
        if self.every_steps is not None and (not isinstance(self.every_steps, int) or self.every_steps <= 0):
            raise ValueError(f"CheckpointConfig.every_steps: must be a positive int or None, got {self.every_steps!r}")
        if self.every_seconds is not None and not (self.every_seconds > 0 and math.isfinite(self.every_seconds)):
            raise ValueError(f"CheckpointConfig.every_seconds: must be > 0 or None, got {self.every_seconds!r}")
        if not isinstance(self.keep_last, int) or self.keep_last < 1:
            raise ValueError(f"CheckpointConfig.keep_last: must be an int >= 1, got {self.keep_last!r}")
        if self.save_timeout_s <= 0:
            raise ValueError(f"CheckpointConfig.save_timeout_s: must be > 0, got {self.save_timeout_s!r}")


@dataclasses.dataclass
class TrainMeta:
    """The loop state saved next to the arrays. Every field but step/policy_version is opaque JSON
    (encoded by `codec.to_jsonable`: dicts, lists, numbers, str, bytes, numpy arrays, dataclasses).

    rng: e.g. {"train": rng_to_json(key)}; data_state: the data iterator's get_state();
    staleness: the staleness manager's counters; config: the run config; extra: anything else
    (consumed-sample counters, non-finite tracker state, wall time...).
    """

    step: int
    policy_version: int
    rng: Any = None
    data_state: Any = None
    staleness: Any = None
    config: Any = None
    extra: Any = None


@dataclasses.dataclass
class SaveStats:
    step: int
    blocking_s: float  # time save() blocked the caller for this step: device->host copy, launch of the write
    wait_s: float = 0.0  # time save() first waited for the previous step's write to finish
    total_s: float | None = None  # start of this save -> data finalized (None while the write runs)
    bytes: int = 0  # array bytes (sum of leaf sizes) in this checkpoint


@dataclasses.dataclass
class Restored:
    step: int
    arrays: dict[str, Any]  # item name -> restored tree (on the requested shardings)
    meta: TrainMeta
    trajectories: Any  # as given to save (tuples/dataclasses come back as lists/dicts), or None
    model_config: ModelConfig | None
    tokenizer_dir: str | None  # RUN/tokenizer when the run recorded one
    skipped: tuple[tuple[int, str], ...] = ()  # (step, reason) of newer checkpoints skipped by fallback


# ---------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------
def abstract_like(tree: Any, shardings: Any = None) -> Any:
    """Tree of jax.ShapeDtypeStruct(shape, dtype, sharding) for arrays/ShapeDtypeStructs in `tree`.

    shardings: a matching tree of Shardings (e.g. `sharding.model_shardings(cfg, mesh, "trainer")`),
    one Sharding for every leaf, or None to keep each leaf's own `.sharding`.
    """
    from jax.sharding import Sharding

    if shardings is None:
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
                            tree)
    if isinstance(shardings, Sharding):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shardings), tree)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def _host_device() -> jax.Device:
    return jax.local_devices(backend="cpu")[0]


def _key_str(k: Any) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def _leaf_table(tree: Any) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """{"a.b.0": (shape, dtype)} for every array-like leaf; names follow Orbax's param names."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    out = {}
    for path, leaf in flat:
        if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
            out[".".join(_key_str(k) for k in path)] = (tuple(leaf.shape), np.dtype(leaf.dtype))
    return out


def _first_line(e: BaseException, limit: int = 400) -> str:
    msg = f"{type(e).__name__}: {e}".strip().splitlines()[0]
    return msg if len(msg) <= limit else msg[:limit] + " ..."


def _tree_bytes(tree: Any) -> int:
    return sum(int(np.prod(x.shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize
               for x in jax.tree.leaves(tree) if hasattr(x, "shape") and hasattr(x, "dtype"))


def _file_sizes(root: str) -> dict[str, int]:
    sizes = {}
    for dirpath, _, files in os.walk(root):
        for f in files:
            p = os.path.join(dirpath, f)
            rel = os.path.relpath(p, root)
            if rel in _ORBAX_FILES or rel == MANIFEST_NAME:
                continue
            sizes[rel] = os.path.getsize(p)
    return sizes


def model_config_to_json(cfg: ModelConfig) -> dict[str, Any]:
    """{"hf_config": cfg.to_hf(), "policy": {dtype, param_dtype, remat, scan_layers}}, + "lora" (the
    LoraSpec's fields) for a LoRA run: its params hold the base and the adapters."""
    out = {"hf_config": cfg.to_hf(), "policy": {f: getattr(cfg, f) for f in _POLICY_FIELDS}}
    if cfg.lora is not None:
        out["lora"] = cfg.lora.to_json()
    return out


def model_config_from_json(d: Mapping[str, Any]) -> ModelConfig:
    from jaxrl_async.models import qwen2_5_vl

    make = qwen2_5_vl.VLConfig.from_hf if d["hf_config"].get("model_type") == qwen2_5_vl.MODEL_TYPE else ModelConfig.from_hf
    cfg = make(d["hf_config"], **d.get("policy", {}))
    return cfg.replace(lora=dict(d["lora"])) if d.get("lora") else cfg


def copy_tokenizer_once(src_dir: str, run_dir: str) -> str:
    """Copy the tokenizer files of src_dir to RUN/tokenizer (atomically, once); returns that path.

    On resume the existing copy is kept if every file in src_dir equals it; a differing file is
    an error (a run must keep its tokenizer).
    """
    dst = os.path.join(run_dir, TOKENIZER_DIR)
    present = [f for f in TOKENIZER_FILES if os.path.isfile(os.path.join(src_dir, f))]
    if not present:
        raise FileNotFoundError(f"{src_dir}: no tokenizer files ({', '.join(TOKENIZER_FILES[:3])}, ...)")
    if os.path.isdir(dst):
        for f in present:
            mine = os.path.join(dst, f)
            with open(os.path.join(src_dir, f), "rb") as a:
                new = a.read()
            if not os.path.isfile(mine):
                raise ValueError(f"{dst}: the run's tokenizer has no {f}, but {src_dir} does; "
                                 "a run must keep the tokenizer it started with")
            with open(mine, "rb") as b:
                if b.read() != new:
                    raise ValueError(f"{src_dir}/{f} differs from the run's copy {mine}; "
                                     "a run must keep the tokenizer it started with")
        return dst
    tmp = f"{dst}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    for f in present:
        shutil.copy2(os.path.join(src_dir, f), os.path.join(tmp, f))
    os.replace(tmp, dst)
    return dst


# ---------------------------------------------------------------------------------------
# Checkpointer
# ---------------------------------------------------------------------------------------
class Checkpointer:
    """Saves and restores RL-run checkpoints under `run_dir` (see module doc).

    Typical loop use::

        ckpt = Checkpointer(run_dir, CheckpointConfig(every_steps=50, every_seconds=1800, keep_last=3),
                            model_config=cfg, tokenizer_dir=tok_dir)
        if ckpt.latest_committed_step() is not None:
            r = ckpt.restore(targets={"params": abstract_like(params), "opt_state": abstract_like(opt)},
                             fallback=True)
        ...
        if ckpt.should_save(step):
            ckpt.save({"params": params, "opt_state": opt_state}, TrainMeta(step, version, ...),
                      trajectories=buffered)
        ...
        ckpt.close()   # waits for the last write

    Not thread-safe: call it from the loop thread. Multi-host: every process must call save/restore
    with the same arguments (and the same `now` in should_save).
    """

    def __init__(self, run_dir: str | os.PathLike, config: CheckpointConfig = CheckpointConfig(), *,
                 model_config: ModelConfig | None = None, tokenizer_dir: str | None = None,
                 read_only: bool = False):
        self.run_dir = os.path.abspath(os.fspath(run_dir))
        self.config = config
        self.model_config = model_config
        self.read_only = read_only
        self.directory = os.path.join(self.run_dir, CHECKPOINTS_DIR)
        self._primary = jax.process_index() == 0
        if read_only:
            if not os.path.isdir(self.directory):
                raise CheckpointNotFoundError(f"{self.run_dir}: no {CHECKPOINTS_DIR}/ directory (not a run directory?)")
        else:
            os.makedirs(self.directory, exist_ok=True)
        self._tokenizer_rel: str | None = None
        if tokenizer_dir is not None:
            if read_only:
                raise ValueError("Checkpointer: tokenizer_dir cannot be given with read_only=True")
            if self._primary:
                copy_tokenizer_once(tokenizer_dir, self.run_dir)
            self._tokenizer_rel = TOKENIZER_DIR
        elif os.path.isdir(os.path.join(self.run_dir, TOKENIZER_DIR)):
            self._tokenizer_rel = TOKENIZER_DIR
        self._pending: SaveStats | None = None
        self._pending_t0 = 0.0
        self._lock = threading.Lock()
        self.last_save: SaveStats | None = None
        if not read_only and self._primary:
            self._remove_unfinished_saves()
        self._mngr = self._make_manager()
        latest = self.latest_committed_step()
        self._last_saved_step = latest if latest is not None else -1
        self._last_save_time = time.monotonic()

    def _make_manager(self) -> ocp.CheckpointManager:
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None if self.read_only else self.config.keep_last,
            read_only=self.read_only,
            create=not self.read_only,
            cleanup_tmp_directories=False,  # done synchronously by _remove_unfinished_saves
            enable_async_checkpointing=True,
            async_options=ocp.AsyncOptions(timeout_secs=int(self.config.save_timeout_s),
                                           post_finalization_callback=self._on_finalized),
            save_interval_steps=0 if self.read_only else 1,
        )
        return ocp.CheckpointManager(self.directory, options=options)

    def _remove_unfinished_saves(self) -> None:
        """Delete `<step>.orbax-checkpoint-tmp*` directories left by a killed writer (one writer per run),
        and the remains of old steps whose deletion (keep_last) a kill interrupted: step directories
        older than the newest committed one that lack `commit_success.txt` (a commit is an atomic
        rename of a complete directory, so only a deletion leaves one; Orbax warns on every listing)."""
        for p in glob.glob(os.path.join(self.directory, "*.orbax-checkpoint-tmp*")):
            log.warning("removing unfinished checkpoint save %s", p)
            shutil.rmtree(p, ignore_errors=True)
        steps = [int(n) for n in os.listdir(self.directory) if n.isdigit()]
        committed = [s for s in steps if os.path.isfile(os.path.join(self.step_dir(s), "commit_success.txt"))]
        for s in steps:
            if committed and s < max(committed) and s not in committed:
                log.info("removing the remains of deleted checkpoint %s", self.step_dir(s))
                shutil.rmtree(self.step_dir(s), ignore_errors=True)

    # -- context manager ---------------------------------------------------------------
    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Wait for the running write (if any) and release Orbax resources."""
        self._mngr.close()

    def wait(self) -> None:
        """Block until the last save is committed; a failed background write raises CheckpointError."""
        try:
            self._mngr.wait_until_finished()
            self._mngr.check_for_errors()
        except Exception as e:
            step = self.last_save.step if self.last_save is not None else None
            raise CheckpointError(f"{self.directory}: background write of step {step} failed: {_first_line(e)}") from e

    # -- listing -------------------------------------------------------------------------
    def step_dir(self, step: int) -> str:
        return os.path.join(self.directory, str(step))

    def all_steps(self) -> list[int]:
        """Committed steps, ascending (re-read from disk)."""
        self._mngr.reload()
        return sorted(s for s in self._mngr.all_steps()
                      if os.path.isfile(os.path.join(self.step_dir(s), "commit_success.txt")))

    def latest_committed_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    latest_step = latest_committed_step

    @property
    def last_saved_step(self) -> int:
        """The newest step saved (committed, or still being written) by this process or found
        committed at start; -1 if none. A second save of that step would be refused."""
        return self._last_saved_step

    @property
    def tokenizer_dir(self) -> str | None:
        return os.path.join(self.run_dir, self._tokenizer_rel) if self._tokenizer_rel else None

    # -- saving --------------------------------------------------------------------------
    def should_save(self, step: int, now: float | None = None) -> bool:
        """True when `step` is new and (step % every_steps == 0 or every_seconds elapsed since the
        last save). `now` is time.monotonic() seconds (default: read the clock)."""
        if self.read_only or step <= self._last_saved_step:
            return False
        c = self.config
        if c.every_steps is not None and step % c.every_steps == 0:
            return True
        now = time.monotonic() if now is None else now
        return c.every_seconds is not None and now - self._last_save_time >= c.every_seconds

    def save(self, arrays: Mapping[str, Any], meta: TrainMeta, *, trajectories: Any = None,
             now: float | None = None) -> SaveStats:
        """Start saving checkpoint `meta.step`: array trees (any sharding), meta, trajectories.

        Returns once the arrays are copied off the device (or committed, with async_save=False);
        the caller may then donate or overwrite them. The previous write, if still running, is
        waited for first (`SaveStats.wait_s`).
        """
        if self.read_only:
            raise CheckpointError(f"{self.directory}: Checkpointer is read-only")
        step = int(meta.step)
        for name in arrays:
            if not _ITEM_NAME.match(name) or name in (META_ITEM, BUFFER_ITEM):
                raise ValueError(f"Checkpointer.save: invalid array item name {name!r} "
                                 f"(identifier, not {META_ITEM!r}/{BUFFER_ITEM!r})")
        if "params" not in arrays:
            log.warning("Checkpointer.save: no 'params' item; this checkpoint cannot be exported")
        t_wait = time.perf_counter()
        self.wait()
        wait_s = time.perf_counter() - t_wait
        t0 = time.perf_counter()
        latest = self.latest_committed_step()
        if latest is not None and step <= latest:
            raise CheckpointError(f"{self.directory}: cannot save step {step}: committed step {latest} "
                                  "is not older (steps must increase)")
        meta_json: dict[str, Any] = {
            "format": FORMAT, "format_version": FORMAT_VERSION, "step": step,
            "policy_version": int(meta.policy_version), "saved_at": time.time(),
            "rng": to_jsonable(meta.rng, "meta.rng"),
            "data_state": to_jsonable(meta.data_state, "meta.data_state"),
            "staleness": to_jsonable(meta.staleness, "meta.staleness"),
            "config": to_jsonable(meta.config, "meta.config"),
            "extra": to_jsonable(meta.extra, "meta.extra"),
            "model": model_config_to_json(self.model_config) if self.model_config is not None else None,
            "tokenizer": self._tokenizer_rel,
            "arrays": {name: {"leaves": len(jax.tree.leaves(tree)), "bytes": _tree_bytes(tree)}
                       for name, tree in arrays.items()},
            "trajectories": None,
        }
        items: dict[str, Any] = {name: ocp.args.StandardSave(tree) for name, tree in arrays.items()}
        if trajectories is not None:
            skeleton, pools = pack_records(trajectories)
            meta_json["trajectories"] = {"skeleton": skeleton, "pools": {k: int(v.shape[0]) for k, v in pools.items()}}
            if pools:
                items[BUFFER_ITEM] = ocp.args.StandardSave(pools)
        items[META_ITEM] = ocp.args.JsonSave(meta_json)
        stats = SaveStats(step=step, blocking_s=0.0, wait_s=wait_s, bytes=sum(v["bytes"] for v in meta_json["arrays"].values()))
        with self._lock:
            self._pending, self._pending_t0 = stats, t0
        try:
            self._mngr.save(step, args=ocp.args.Composite(**items), force=True)
        except Exception as e:
            with self._lock:
                self._pending = None
            raise CheckpointError(f"{self.step_dir(step)}: save failed: {_first_line(e)}") from e
        stats.blocking_s = time.perf_counter() - t0
        self._last_saved_step = step
        self._last_save_time = time.monotonic() if now is None else now
        self.last_save = stats
        if not self.config.async_save:
            self.wait()
        return stats

    def _on_finalized(self) -> None:
        """Orbax post-finalization callback: runs on the write thread after every item is finalized
        and before the temporary directory is renamed, so the manifest is committed with the data."""
        with self._lock:
            stats, t0 = self._pending, self._pending_t0
            self._pending = None
        if stats is None:
            return
        if self._primary:
            tmp = sorted(glob.glob(os.path.join(self.directory, f"{stats.step}.orbax-checkpoint-tmp*")))
            target = tmp[-1] if tmp else self.step_dir(stats.step)
            if os.path.isdir(target):
                manifest = {"format": FORMAT, "step": stats.step, "files": _file_sizes(target)}
                with open(os.path.join(target, MANIFEST_NAME), "w") as fh:
                    json.dump(manifest, fh)
        stats.total_s = time.perf_counter() - t0

    # -- restoring -------------------------------------------------------------------------
    def read_meta(self, step: int) -> dict[str, Any]:
        """The raw JSON metadata of a committed step (validated)."""
        self._check_committed(step)
        self._check_manifest(step)
        return self._load_meta(step)

    def restore(self, step: int | None = None, targets: Mapping[str, Any] | None = None, *,
                items: Sequence[str] | None = None, fallback: bool = False,
                restore_trajectories: bool = True) -> Restored:
        """Restore a committed checkpoint (default: the latest).

        targets: item name -> abstract tree (jax.ShapeDtypeStruct with `sharding`, or arrays whose
            shardings are used: see `abstract_like`), or `HOST` for arrays on the host CPU device
            (device- and mesh-independent; containers come back as saved: dicts/lists). Items
            without a target use HOST.
        items: array items to restore (default: every item the step holds).
        fallback: on a corrupt or incompatible step, try the next older committed step; skipped
            steps are moved to RUN/quarantine (unless read-only) and listed in `Restored.skipped`.
        """
        targets = dict(targets or {})
        steps = self.all_steps()
        if not steps:
            raise CheckpointNotFoundError(f"{self.directory}: no committed checkpoint")
        if step is None:
            candidates = steps[::-1]
        else:
            if step not in steps:
                raise CheckpointNotFoundError(f"{self.step_dir(step)}: no committed checkpoint at step {step} "
                                              f"(committed: {steps})")
            candidates = [s for s in steps[::-1] if s <= step]
        if not fallback:
            candidates = candidates[:1]
        skipped: list[tuple[int, str]] = []
        for s in candidates:
            try:
                restored = self._restore_step(s, targets, items, restore_trajectories)
            except (CheckpointCorruptError, CheckpointIncompatibleError) as e:
                if not fallback:
                    raise
                log.warning("checkpoint step %d unusable, trying an older one: %s", s, e)
                skipped.append((s, str(e)))
                continue
            if skipped:
                log.warning("restored step %d after skipping %s", s, [k for k, _ in skipped])
                if not self.read_only and self._primary:
                    self._quarantine([k for k, _ in skipped])
            restored.skipped = tuple(skipped)
            return restored
        raise CheckpointCorruptError(
            f"{self.directory}: no usable checkpoint among steps {candidates}: "
            + " | ".join(f"step {k}: {r}" for k, r in skipped))

    def _quarantine(self, steps: Sequence[int]) -> None:
        qdir = os.path.join(self.run_dir, QUARANTINE_DIR)
        os.makedirs(qdir, exist_ok=True)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        for s in steps:
            dst = os.path.join(qdir, f"{s}-{stamp}")
            os.replace(self.step_dir(s), dst)
            log.warning("moved unusable checkpoint %s to %s", self.step_dir(s), dst)
        self._mngr.reload()
        if self._last_saved_step in steps:  # that step number is free again: save it anew
            latest = self.latest_committed_step()
            self._last_saved_step = latest if latest is not None else -1

    def _check_committed(self, step: int) -> None:
        d = self.step_dir(step)
        if not os.path.isdir(d):
            raise CheckpointNotFoundError(f"{d}: no such checkpoint")
        if not os.path.isfile(os.path.join(d, "commit_success.txt")):
            raise CheckpointCorruptError(f"{d}: not committed (commit_success.txt missing)")

    def _check_manifest(self, step: int) -> None:
        d = self.step_dir(step)
        path = os.path.join(d, MANIFEST_NAME)
        if not os.path.isfile(path):
            log.warning("%s: no %s; file sizes not verified", d, MANIFEST_NAME)
            return
        try:
            with open(path) as fh:
                files = json.load(fh)["files"]
        except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:  # a hostile file nests deep
            raise CheckpointCorruptError(f"{path}: unreadable manifest ({_first_line(e)})") from None
        problems = []
        for rel, size in sorted(files.items()):
            p = os.path.join(d, rel)
            if not os.path.isfile(p):
                problems.append(f"{rel}: missing")
            elif os.path.getsize(p) != size:
                problems.append(f"{rel}: {os.path.getsize(p)} bytes, expected {size} (truncated or overwritten)")
        if problems:
            raise CheckpointCorruptError(f"{d}: checkpoint step {step} is corrupt: " + "; ".join(problems[:10])
                                         + (f" (+{len(problems) - 10} more)" if len(problems) > 10 else ""))

    def _load_meta(self, step: int) -> dict[str, Any]:
        path = os.path.join(self.step_dir(step), META_ITEM)
        try:
            meta = self._mngr.restore(step, args=ocp.args.Composite(**{META_ITEM: ocp.args.JsonRestore()}))[META_ITEM]
        except Exception as e:
            raise CheckpointCorruptError(f"{path}: checkpoint step {step} has unreadable metadata "
                                         f"({_first_line(e)})") from None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
            raise CheckpointCorruptError(f"{path}: not {FORMAT} metadata (format={found!r})")
        if meta.get("format_version") != FORMAT_VERSION:
            raise CheckpointIncompatibleError(f"{path}: format_version {meta.get('format_version')!r}, "
                                              f"this code reads {FORMAT_VERSION}")
        missing = [k for k in ("step", "policy_version", "arrays", "trajectories", "model", "tokenizer") if k not in meta]
        if missing:
            raise CheckpointCorruptError(f"{path}: metadata lacks {missing}")
        if meta["step"] != step:
            raise CheckpointCorruptError(f"{path}: metadata says step {meta['step']}, directory is step {step}")
        return meta

    def _item_metadata(self, step: int, name: str) -> Any:
        path = os.path.join(self.step_dir(step), name)
        if not os.path.isdir(path):
            raise CheckpointCorruptError(f"{path}: array item {name!r} is missing from checkpoint step {step}")
        try:
            return ocp.StandardCheckpointHandler().metadata(epath.Path(path)).tree
        except Exception as e:
            raise CheckpointCorruptError(f"{path}: unreadable array metadata ({_first_line(e)})") from None

    def _resolve_target(self, step: int, name: str, target: Any) -> Any:
        saved_md = self._item_metadata(step, name)
        saved = _leaf_table(saved_md)
        path = os.path.join(self.step_dir(step), name)
        if isinstance(target, str):
            if target != HOST:
                raise ValueError(f"restore: target for item {name!r} must be a tree or {HOST!r}, got {target!r}")
            sharding = SingleDeviceSharding(_host_device())
            return jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=sharding), saved_md)
        target = abstract_like(target)
        want = _leaf_table(target)
        missing = sorted(set(want) - set(saved))
        unexpected = sorted(set(saved) - set(want))
        wrong = [f"{k}: saved {saved[k][0]} {saved[k][1]}, requested {want[k][0]} {want[k][1]}"
                 for k in sorted(set(want) & set(saved)) if saved[k] != want[k]]
        problems = []
        if missing:
            problems.append(f"not in checkpoint ({len(missing)}): {', '.join(missing[:10])}")
        if unexpected:
            problems.append(f"in checkpoint but not requested ({len(unexpected)}): {', '.join(unexpected[:10])}")
        if wrong:
            problems.append(f"shape/dtype differs ({len(wrong)}): {'; '.join(wrong[:10])}")
        if problems:
            raise CheckpointIncompatibleError(f"{path}: item {name!r} of step {step} does not match the "
                                              "requested tree: " + " | ".join(problems))
        return target

    def _restore_step(self, step: int, targets: Mapping[str, Any], items: Sequence[str] | None,
                      restore_trajectories: bool) -> Restored:
        self._check_committed(step)
        self._check_manifest(step)
        meta = self._load_meta(step)
        saved_items = list(meta["arrays"])
        wanted = list(items) if items is not None else saved_items
        unknown = [n for n in wanted if n not in saved_items]
        if unknown:
            raise CheckpointIncompatibleError(f"{self.step_dir(step)}: no array item(s) {unknown} "
                                              f"(saved: {saved_items})")
        extra_targets = [n for n in targets if n not in wanted]
        if extra_targets:
            raise CheckpointIncompatibleError(f"{self.step_dir(step)}: targets given for {extra_targets}, "
                                              f"which are not restored (items: {wanted}, saved: {saved_items})")
        args: dict[str, Any] = {n: ocp.args.StandardRestore(self._resolve_target(step, n, targets.get(n, HOST)))
                                for n in wanted}
        traj_meta = meta["trajectories"]
        if restore_trajectories and traj_meta is not None and traj_meta["pools"]:
            args[BUFFER_ITEM] = ocp.args.StandardRestore()
        try:
            out = self._mngr.restore(step, args=ocp.args.Composite(**args)) if args else {}
        except Exception as e:
            raise CheckpointCorruptError(f"{self.step_dir(step)}: reading arrays of step {step} failed "
                                         f"({_first_line(e)})") from None
        trajectories = None
        if restore_trajectories and traj_meta is not None:
            pools = dict(out[BUFFER_ITEM]) if traj_meta["pools"] else {}
            for k, n in traj_meta["pools"].items():
                if k not in pools or np.asarray(pools[k]).shape != (n,):
                    raise CheckpointCorruptError(f"{os.path.join(self.step_dir(step), BUFFER_ITEM)}: pool {k!r} "
                                                 f"should have {n} elements")
            try:
                trajectories = unpack_records(traj_meta["skeleton"], pools)
            except (ValueError, KeyError, TypeError) as e:
                raise CheckpointCorruptError(f"{os.path.join(self.step_dir(step), META_ITEM)}: trajectory "
                                             f"skeleton is inconsistent ({_first_line(e)})") from None
        try:
            train_meta = TrainMeta(
                step=int(meta["step"]), policy_version=int(meta["policy_version"]),
                rng=from_jsonable(meta.get("rng"), "meta.rng"),
                data_state=from_jsonable(meta.get("data_state"), "meta.data_state"),
                staleness=from_jsonable(meta.get("staleness"), "meta.staleness"),
                config=from_jsonable(meta.get("config"), "meta.config"),
                extra=from_jsonable(meta.get("extra"), "meta.extra"),
            )
            model_cfg = model_config_from_json(meta["model"]) if meta["model"] is not None else None
        except Exception as e:
            raise CheckpointCorruptError(f"{os.path.join(self.step_dir(step), META_ITEM)}: invalid metadata "
                                         f"({_first_line(e)})") from None
        tok = os.path.join(self.run_dir, meta["tokenizer"]) if meta["tokenizer"] else None
        return Restored(step=step, arrays={n: out[n] for n in wanted}, meta=train_meta, trajectories=trajectories,
                        model_config=model_cfg, tokenizer_dir=tok)
