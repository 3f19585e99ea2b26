"""Cross-process weight push: device-to-device with ``jax.experimental.transfer``, checksummed, disk fallback.

Two JAX programs (the trainer's and a generator's, each possibly an SPMD group of its own) share no
devices and no runtime, so ``jax.device_put`` cannot move arrays between them. The trainer process
runs a transfer server (``start_transfer_server``); for each push it registers the arrays under a
fresh uuid (``await_pull``) and tells the generator (RPC) to pull them; the generator pulls them
straight onto its devices (``TransferConnection.pull``) when its handler gets to it, between decode
steps of its own schedule, and swaps them in.

What the transfer API moves is **raw shard buffers, matched by position**: pulling into a different
sharding silently returns scrambled values (measured: a ``P('fsdp', None)`` source pulled as
``P(None, 'fsdp')`` comes back wrong without an error). So this module never relies on layout
agreement: the trainer registers, per leaf, one *single-device* array per distinct shard of a
*wire layout*, and the generator pulls each of them as a single-device array onto a device of its
*landing layout* (the shard with that index), then assembles the global array with
``jax.make_array_from_single_device_arrays``. The routes mirror the single-process ones
(``weight_sync.plan_push``), decided by the same pure function on both sides:

* ``direct``: every distinct shard of the generator's target sharding is a shard of the trainer's
  layout: land in the target;
* ``via_generator`` (n_trainer | n_generator): land in the trainer's layout on the generator's
  devices (plus a replica axis), then reshard there (jitted identity, XLA collectives);
* ``via_trainer`` (n_generator | n_trainer): reshard on the trainer first into the target spec on a
  generator-shaped mesh of trainer devices (plus a replica axis), then land in the target.

A trainer that is an SPMD group of several processes (``jax.distributed``) runs one transfer server
per process: each distinct wire shard has one **owner**, the lowest process index among the devices
holding it (``WireSender.owners``, computed from the global sharding, identical on every process);
each process registers the shards it owns under the push's uuid, and the generator pulls each
shard from its owner's server (``WireReceiver.pull`` with one connection per trainer process).

Security: the transfer servers have no authentication or encryption of their own (jax's), so they
listen only on a configured interface (``check_bind_host`` refuses every-interface addresses) and
the pull id is the capability: 64 random bits per pull (``new_pull_id``), sent to the generator only
over the mutual-TLS RPC, consumed by the first pull. The checksum below catches corruption, not
forgery on the transfer network (docs/launch.md, section 5).

Every push carries a **checksum** per leaf: a position-weighted sum of the raw bits modulo 2^32
(integer arithmetic, so it is independent of the sharding and of the reduction order), computed on
device by the trainer over what it registered and by the generator over what it is about to use.
A failed pull or a mismatch falls back to **disk**: every trainer process writes the shards it
owns (``RUN/weight_push/v<version>/``: one raw file per distinct shard, then a manifest written by
the first process and the directory renamed into place; a filesystem every host sees) and the
generator assembles, loads and verifies them: HMAC-SHA256 per shard file and over the manifest
(key derived from the run's secret, ``fallback_key``), shard file names checked, files 0600 in 0700
directories (``read_weights`` raises ``FallbackRejected``). That path goes through host memory, so
it is for recovery, not for speed. Paths (issue 27): ``RUN/weight_push`` and its version
directories are created with ``mkdir`` (0700); when they exist they must be real directories (a
symlink is refused, never followed: opened with ``O_NOFOLLOW``) owned by this user, and their mode
is set through that descriptor; files are created ``O_EXCL | O_NOFOLLOW``. The manifest is parsed
only if its nesting is at most ``MAX_MANIFEST_DEPTH`` (a deeper one is ``FallbackRejected``, not a
``RecursionError``).
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import hmac
import json
import math
import os
import re
import secrets
import shutil
import stat
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding

__all__ = ["Layout", "LeafPlan", "plan_transfer", "layout_of", "tree_keys", "checksum_fn", "checksums_async", "prepare_wire",
           "host_checksums", "WireSender", "WireReceiver", "ChecksumMismatch", "write_weights", "read_weights",
           "write_shards", "start_fallback", "commit_fallback", "fallback_key", "FallbackRejected", "new_pull_id",
           "check_bind_host", "start_server"]

REPLICA_AXIS = "_push_replica"


class ChecksumMismatch(RuntimeError):
    """The weights a generator received differ from what the trainer sent."""


# =============================================================================================
# Layouts and the plan (pure; computed identically on both sides)
# =============================================================================================
@dataclasses.dataclass(frozen=True)
class Layout:
    """A NamedSharding without devices: mesh axes ``((name, size), ...)`` and the spec (one entry per
    dimension: None, an axis name or a tuple of names). Picklable, so it crosses processes."""

    axes: tuple[tuple[str, int], ...]
    spec: tuple[Any, ...]

    @property
    def num_devices(self) -> int:
        return math.prod(s for _, s in self.axes)


def layout_of(sharding: NamedSharding, ndim: int) -> Layout:
    spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
    norm = tuple(None if e is None else (tuple(e) if isinstance(e, (tuple, list)) else (e,)) for e in spec)
    return Layout(tuple((str(k), int(v)) for k, v in sharding.mesh.shape.items()), norm)


def distinct_indices(shape: Sequence[int], layout: Layout, what: str = "") -> list[tuple[tuple[int, int], ...]]:
    """The distinct shard index boxes ``((start, stop) per dim)`` of ``layout`` for ``shape``, sorted."""
    sizes = dict(layout.axes)
    per_dim = []
    for d, (n, entry) in enumerate(zip(shape, layout.spec)):
        k = 1 if entry is None else math.prod(sizes[a] for a in entry)
        if n % k:
            raise ValueError(f"weight push: {what} dimension {d} of size {n} is not divisible by its {k} shards "
                             f"({entry}); uneven shards cannot be transferred")
        step = n // k
        per_dim.append([(i * step, (i + 1) * step) for i in range(k)])
    boxes = [()]
    for opts in per_dim:
        boxes = [b + (o,) for b in boxes for o in opts]
    return sorted(boxes)


@dataclasses.dataclass(frozen=True)
class LeafPlan:
    key: str
    shape: tuple[int, ...]
    dtype: str
    route: str  # direct | via_generator | via_trainer
    wire: Layout  # the trainer-side layout it registers shards of
    landing: Layout  # the generator-side layout it pulls into
    indices: tuple[tuple[tuple[int, int], ...], ...]  # distinct shard boxes pulled, in wire order


def plan_transfer(keys: Sequence[str], shapes: Sequence[Sequence[int]], dtype: str, src: Sequence[Layout],
                  dst: Sequence[Layout]) -> list[LeafPlan]:
    """Per leaf: route, wire and landing layouts (see the module docstring). ValueError names the leaf."""
    out = []
    for key, shape, s, d in zip(keys, shapes, src, dst):
        shape = tuple(int(x) for x in shape)
        n_s, n_d = s.num_devices, d.num_devices
        if set(distinct_indices(shape, d, key)) <= set(distinct_indices(shape, s, key)):
            route, wire, landing = "direct", s, d
        elif n_d % n_s == 0:
            route, wire = "via_generator", s
            landing = Layout(s.axes + ((REPLICA_AXIS, n_d // n_s),), s.spec)
        elif n_s % n_d == 0:
            route, landing = "via_trainer", d
            wire = Layout(d.axes + ((REPLICA_AXIS, n_s // n_d),), d.spec)
        else:
            raise ValueError(f"weight push: no route for {key} from {n_s} trainer devices to {n_d} generator devices "
                             "(one count must divide the other)")
        out.append(LeafPlan(key, shape, str(dtype), route, wire, landing,
                            tuple(distinct_indices(shape, landing, key))))
    return out


def tree_keys(tree: Any) -> list[str]:
    return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _sharding_on(devices: Sequence[Any], layout: Layout) -> NamedSharding:
    """``layout`` realised on ``devices`` (in order; their count must match)."""
    sizes = tuple(s for _, s in layout.axes)
    devs = np.asarray(list(devices), dtype=object).reshape(sizes)
    mesh = Mesh(devs, tuple(n for n, _ in layout.axes), axis_types=(jax.sharding.AxisType.Auto,) * len(sizes))
    spec = jax.sharding.PartitionSpec(*[e if e is None or len(e) > 1 else e[0] for e in layout.spec])
    return NamedSharding(mesh, spec)


def _box(index: tuple, shape: Sequence[int]) -> tuple[tuple[int, int], ...]:
    return tuple((0 if sl.start is None else int(sl.start), int(n) if sl.stop is None else int(sl.stop))
                 for sl, n in zip(index, shape))


def box_owners(sharding: Any, shape: Sequence[int]) -> dict[tuple[tuple[int, int], ...], int]:
    """Distinct shard box -> the process that serves it: the lowest process index among the devices
    holding it. Computed from the global sharding, so every process of a trainer group agrees."""
    out: dict = {}
    for dev, idx in sharding.devices_indices_map(tuple(shape)).items():
        b = _box(idx, shape)
        out[b] = min(out.get(b, dev.process_index), dev.process_index)
    return out


# =============================================================================================
# Checksum
# =============================================================================================
_GOLDEN = np.uint32(2654435761)  # Knuth's multiplicative hash constant


def _leaf_checksum(x: jax.Array) -> jax.Array:
    itemsize = jnp.dtype(x.dtype).itemsize
    if itemsize == 4:
        bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    elif itemsize == 2:
        bits = jax.lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32)
    elif itemsize == 1:
        bits = jax.lax.bitcast_convert_type(x, jnp.uint8).astype(jnp.uint32)
    else:
        raise TypeError(f"weight push checksum: unsupported dtype {x.dtype} (1, 2 or 4 bytes per element)")
    pos = jnp.zeros(x.shape, jnp.uint32)
    stride = 1
    for d in reversed(range(x.ndim)):
        pos = pos + jax.lax.broadcasted_iota(jnp.uint32, x.shape, d) * jnp.uint32(stride % 2**32)
        stride *= x.shape[d]
    weight = pos * _GOLDEN + jnp.uint32(1)
    return jnp.sum(bits * weight, dtype=jnp.uint32)


_CHECKSUM = jax.jit(lambda leaves: jnp.stack([_leaf_checksum(x) for x in leaves]) if leaves else jnp.zeros((0,), jnp.uint32))


def checksums_async(leaves: Sequence[jax.Array]) -> jax.Array:
    """The per-leaf checksums as a (replicated) device array, dispatched without waiting. On a
    trainer group this is a collective: every process must call it at the same point of its
    program order (the trainer thread), so the push thread only reads the result."""
    return _CHECKSUM(list(leaves))


def host_checksums(sums: jax.Array) -> list[int]:
    """``checksums_async``'s result as host ints (4 bytes per leaf; allowed under the push guard)."""
    with jax.transfer_guard("allow"):
        return [int(v) for v in np.asarray(jax.device_get(sums))]


def checksum_fn(leaves: Sequence[jax.Array]) -> list[int]:
    """Per-leaf checksums (host ints). Leaves must share one device set (one jitted reduction)."""
    return host_checksums(checksums_async(leaves))


# =============================================================================================
# Transfer servers: where they listen, pull ids
# =============================================================================================
def new_pull_id() -> int:
    """A fresh pull id (uuid of ``await_pull``): 64 random bits (never sequential), so that nothing
    but the generator it is sent to (over the authenticated, encrypted RPC) can claim the pull."""
    return secrets.randbits(64) or 1


def check_bind_host(host: str, what: str = "transfer server") -> str:
    """``host`` for a listener that has no authentication of its own (the transfer servers, the
    ``jax.distributed`` coordinator): a configured interface, never every interface by accident."""
    h = str(host).strip("[]")
    if h in ("", "0.0.0.0", "::", "0:0:0:0:0:0:0:0", "*"):
        raise ValueError(f"{what}: refusing to listen on {host!r} (every interface): it serves weights to anyone "
                         "who connects with a pull id; give the address of the cluster-internal interface (e.g. "
                         "--transfer-host 10.0.0.7, see docs/launch.md)")
    return h


def start_server(host: str) -> Any:
    """A transfer server listening on ``host`` (port chosen by the system) on this process's devices."""
    from jax.experimental import transfer as jtransfer

    h = check_bind_host(host)
    addr = f"[{h}]:0" if ":" in h else f"{h}:0"
    return jtransfer.start_transfer_server(jax.local_devices()[0].client, addr, [addr])


# =============================================================================================
# Trainer side
# =============================================================================================
class WireSender:
    """Trainer side of the plan: cast/copy + (via_trainer) reshard on the trainer devices, then the
    single-device shard arrays to register with ``TransferServer.await_pull``."""

    def __init__(self, plans: Sequence[LeafPlan], src_shardings: Sequence[NamedSharding]):
        self.plans = list(plans)
        self._wire = []
        for p, s in zip(self.plans, src_shardings):
            if p.route == "via_trainer":
                devs = list(np.asarray(s.mesh.devices).reshape(-1))
                self._wire.append(_sharding_on(devs, p.wire))
            else:
                self._wire.append(None)
        vt = [i for i, p in enumerate(self.plans) if p.route == "via_trainer"]
        self._vt = vt
        self._reshard = (jax.jit(lambda xs: [x + jnp.zeros((), x.dtype) for x in xs],
                                 out_shardings=[self._wire[i] for i in vt]) if vt else None)
        # per flat shard (pull order): the trainer process that registers it
        self.owners: list[int] = []
        for p, s, w in zip(self.plans, src_shardings, self._wire):
            own = box_owners(w if w is not None else s, p.shape)
            self.owners.extend(own[box] for box in p.indices)

    def prepare(self, leaves: Sequence[jax.Array]) -> list[jax.Array]:
        """Wire arrays (fresh buffers: the caller's may be donated right after). Dispatch only."""
        leaves = list(leaves)
        if self._vt:
            for i, y in zip(self._vt, self._reshard([leaves[i] for i in self._vt])):
                leaves[i] = y
        return leaves

    def shards(self, wire: Sequence[jax.Array], process_index: int | None = None) -> list[jax.Array]:
        """The single-device shard arrays this process registers (those it owns), in pull order."""
        me = jax.process_index() if process_index is None else process_index
        out = []
        k = 0
        for p, x in zip(self.plans, wire):
            by_box: dict = {}
            for sh in x.addressable_shards:
                by_box.setdefault(_box(sh.index, x.shape), sh.data)
            for box in p.indices:
                if self.owners[k] == me:
                    if box not in by_box:
                        raise RuntimeError(f"weight push: {p.key}: owned shard {box} is not on this process "
                                           "(plan bug)")
                    out.append(by_box[box])
                k += 1
        return out


# =============================================================================================
# Generator side
# =============================================================================================
class WireReceiver:
    """Generator side: pull the shards onto the landing layout, assemble, reshard, verify."""

    def __init__(self, plans: Sequence[LeafPlan], dst_shardings: Sequence[NamedSharding]):
        self.plans = list(plans)
        self.dst = list(dst_shardings)
        self.landing: list[NamedSharding] = []
        self.specs: list[jax.ShapeDtypeStruct] = []
        self._placement: list[list[tuple[Any, int]]] = []  # per leaf: (device, index into the flat pull)
        flat = 0
        for p, d in zip(self.plans, self.dst):
            if p.route == "via_generator":
                devs = list(np.asarray(d.mesh.devices).reshape(-1))
                land = _sharding_on(devs, p.landing)
            else:
                land = d
            self.landing.append(land)
            first: dict = {}
            placement = []
            pos = {box: k for k, box in enumerate(p.indices)}
            dmap = land.devices_indices_map(p.shape)
            for dev, idx in dmap.items():
                box = _box(idx, p.shape)
                if box not in pos:
                    raise RuntimeError(f"weight push: {p.key}: landing shard {box} is not on the wire (plan bug)")
                if box not in first:
                    first[box] = dev
                placement.append((dev, flat + pos[box]))
            for box in p.indices:
                shard_shape = tuple(b - a for a, b in box)
                self.specs.append(jax.ShapeDtypeStruct(shard_shape, jnp.dtype(p.dtype),
                                                       sharding=SingleDeviceSharding(first[box])))
            self._placement.append(placement)
            flat += len(p.indices)
        vg = [i for i, p in enumerate(self.plans) if p.route == "via_generator"]
        self._vg = vg
        self._reshard = (jax.jit(lambda xs: [x + jnp.zeros((), x.dtype) for x in xs],
                                 out_shardings=[self.dst[i] for i in vg]) if vg else None)

    @property
    def nbytes(self) -> int:
        """Bytes one pull moves (every distinct shard once): the push size as the transfer counts it."""
        return int(sum(math.prod(s.shape) * jnp.dtype(s.dtype).itemsize for s in self.specs))

    def pull(self, conns: Any, uuid: int, timeout_s: float, owners: Sequence[int] | None = None) -> list[jax.Array]:
        """Pull every shard of push ``uuid``: ``conns`` is one connection, or one per trainer process
        with ``owners`` (``WireSender.owners``) saying which process serves each shard."""
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=float(timeout_s))
        if not isinstance(conns, (list, tuple)):
            conns, owners = [conns], None
        if owners is None:
            owners = [0] * len(self.specs)
        if len(owners) != len(self.specs):
            raise ValueError(f"weight push: {len(owners)} shard owners for {len(self.specs)} shards")
        pulled: list[Any] = [None] * len(self.specs)
        for proc, conn in enumerate(conns):
            mine = [k for k, o in enumerate(owners) if o == proc]
            if not mine:
                continue
            got = conn.pull(int(uuid), [self.specs[k] for k in mine], timeout=deadline)
            for k, a in zip(mine, got):
                pulled[k] = a
        if any(a is None for a in pulled):
            missing = sorted({owners[k] for k, a in enumerate(pulled) if a is None})
            raise RuntimeError(f"weight push: shards owned by trainer processes {missing} have no connection")
        wait_ready(pulled, float(timeout_s), f"pull of uuid {uuid}")
        return self.assemble(pulled)

    def assemble(self, pulled: Sequence[jax.Array]) -> list[jax.Array]:
        leaves = []
        for p, land, placement in zip(self.plans, self.landing, self._placement):
            arrays = []
            for dev, k in placement:
                a = pulled[k]
                arrays.append(a if a.devices() == {dev} else jax.device_put(a, dev, may_alias=False))
            leaves.append(jax.make_array_from_single_device_arrays(p.shape, land, arrays))
        if self._vg:
            for i, y in zip(self._vg, self._reshard([leaves[i] for i in self._vg])):
                leaves[i] = y
        return leaves


def wait_ready(leaves: Sequence[jax.Array], timeout_s: float, what: str) -> None:
    """Poll ``is_ready`` (a pull completes asynchronously) with a timeout instead of blocking forever."""
    deadline = time.monotonic() + timeout_s
    for x in leaves:
        while not x.is_ready():
            if time.monotonic() > deadline:
                raise TimeoutError(f"weight push: {what} not complete after {timeout_s:.0f} s")
            time.sleep(0.001)


def verify(leaves: Sequence[jax.Array], expected: Sequence[int], keys: Sequence[str], version: int) -> list[int]:
    got = checksum_fn(leaves)
    bad = [k for k, a, b in zip(keys, got, expected) if a != b]
    if bad:
        raise ChecksumMismatch(f"weight push of version {version}: checksum mismatch on {len(bad)} of {len(keys)} "
                               f"leaves (first: {bad[0]})")
    return got


# =============================================================================================
# Disk fallback
# =============================================================================================
class FallbackRejected(RuntimeError):
    """A disk-fallback directory failed verification (MAC, file names, sizes, version): not used."""


_SHARD_NAME = re.compile(r"\A[0-9]{5}\.[0-9]{4}\.p[0-9]{1,6}\.bin\Z")
_MANIFEST = "manifest.json"
MAX_MANIFEST_DEPTH = 16  # nesting of a manifest (a real one has 7: manifest, leaves, leaf, shards, shard, box, pair)
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')


def fallback_key(authkey: bytes) -> bytes:
    """The MAC key of the disk fallback, derived from the run's secret (``$JAXRL_RPC_AUTHKEY``)."""
    from jaxrl_async.distributed.tls import derive_key

    return derive_key(authkey, "weight push disk fallback MAC v1")


def _mac(key: bytes, data: Any) -> str:
    return hmac.new(key, data, hashlib.sha256).hexdigest()


def _manifest_mac(key: bytes, manifest: dict) -> str:
    body = {k: v for k, v in manifest.items() if k != "mac"}
    return _mac(key, json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


def _check_dir(path: str, chmod: bool = False, owner: bool = True) -> None:
    """``path`` must be a real directory (a symlink is refused, not followed) owned by this user
    (``owner``); ``chmod``: set it to 0700 through the descriptor that was checked."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as e:
        what = "a symlink" if os.path.islink(path) else e.strerror
        raise FallbackRejected(f"weight push fallback: {path} is not a directory of this run ({what}); refusing to "
                               "use it") from None
    try:
        st = os.fstat(fd)
        if owner and st.st_uid != os.geteuid():
            raise FallbackRejected(f"weight push fallback: {path} belongs to uid {st.st_uid}, not to this process "
                                   f"(uid {os.geteuid()}); refusing to use it")
        if chmod:
            os.fchmod(fd, 0o700)  # whatever the umask or an older run left
    finally:
        os.close(fd)


def _private_dir(path: str) -> None:
    """``path`` as a private directory: made (0700) when absent, else checked (``_check_dir``)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    _check_dir(path, chmod=True)


def _remove(path: str) -> None:
    """Remove ``path`` whatever it is (a symlink itself, never its target)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def _write_private(path: str, data: Any) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def start_fallback(directory: str, version: int) -> str:
    """A fresh temporary directory (0700) for the disk fallback of ``version`` (every trainer process
    writes its shards into it; ``commit_fallback`` renames it into place)."""
    _private_dir(directory)
    tmp = os.path.join(directory, f"v{version:08d}.tmp")
    _remove(tmp)
    os.mkdir(tmp, 0o700)
    _check_dir(tmp, chmod=True)
    return tmp


def write_shards(tmp: str, leaves: Sequence[jax.Array], process_index: int | None = None, *, key: bytes) -> list[dict]:
    """Write the distinct shards of ``leaves`` that this process owns (``box_owners``) as raw files
    (0600) into ``tmp``; returns their manifest entries ``{leaf, file, box, mac}`` (``mac``:
    HMAC-SHA256 of the file's bytes under ``key``, see ``fallback_key``)."""
    me = jax.process_index() if process_index is None else process_index
    _check_dir(os.path.dirname(os.path.abspath(tmp)))  # RUN/weight_push and its temporary directory: ours, no symlinks
    _check_dir(tmp)
    entries = []
    with jax.transfer_guard("allow"):
        for i, x in enumerate(leaves):
            owners = box_owners(x.sharding, x.shape)
            done = set()
            for sh in x.addressable_shards:
                box = _box(sh.index, x.shape)
                if owners[box] != me or box in done:
                    continue
                done.add(box)
                name = f"{i:05d}.{len(done) - 1:04d}.p{me}.bin"
                data = np.ascontiguousarray(jax.device_get(sh.data)).tobytes()
                _write_private(os.path.join(tmp, name), data)
                entries.append({"leaf": i, "file": name, "box": [list(b) for b in box], "mac": _mac(key, data)})
    return entries


def commit_fallback(tmp: str, version: int, keys: Sequence[str], leaves: Sequence[jax.Array],
                    checksums: Sequence[int], entries: Sequence[dict], *, key: bytes) -> str:
    """Write the manifest (every process's ``write_shards`` entries; HMAC over all of it) and rename
    ``tmp`` into place."""
    final = tmp[: -len(".tmp")]
    by_leaf: dict[int, list] = {}
    for e in entries:
        by_leaf.setdefault(int(e["leaf"]), []).append({"file": e["file"], "box": e["box"], "mac": e["mac"]})
    manifest: dict[str, Any] = {"version": int(version), "leaves": []}
    for i, (k, x) in enumerate(zip(keys, leaves)):
        shards = sorted(by_leaf.get(i, []), key=lambda e: e["box"])
        covered = sum(math.prod(b - a for a, b in e["box"]) for e in shards)
        if covered != math.prod(x.shape):
            raise RuntimeError(f"weight push fallback: {k}: the written shards cover {covered} of "
                               f"{math.prod(x.shape)} elements")
        manifest["leaves"].append({"key": k, "shape": list(x.shape), "dtype": str(jnp.dtype(x.dtype)),
                                   "checksum": int(checksums[i]), "shards": shards})
    manifest["mac"] = _manifest_mac(key, manifest)
    _check_dir(tmp)
    _write_private(os.path.join(tmp, _MANIFEST), json.dumps(manifest).encode())
    _remove(final)
    os.replace(tmp, final)
    return final


def write_weights(directory: str, version: int, keys: Sequence[str], leaves: Sequence[jax.Array],
                  checksums: Sequence[int], *, key: bytes) -> str:
    """One process's disk fallback: every shard of ``leaves`` under ``directory/v<version>``;
    atomic (rename). A trainer group uses ``start_fallback`` / ``write_shards`` on every process and
    ``commit_fallback`` on the first."""
    tmp = start_fallback(directory, version)
    return commit_fallback(tmp, version, keys, leaves, checksums, write_shards(tmp, leaves, key=key), key=key)


def _read_private(directory: str, name: str, what: str) -> bytes:
    """The bytes of ``directory/name``: a plain file name (no separator, no ``..``), not a symlink."""
    if name != os.path.basename(name) or name in ("", ".", "..") or "\0" in name:
        raise FallbackRejected(f"weight push fallback {directory}: {what} names the path {name!r} (not a file of the "
                               "directory)")
    try:
        fd = os.open(os.path.join(directory, name), os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        raise FallbackRejected(f"weight push fallback {directory}: {what} {name!r}: {e.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        return f.read()


def _json_depth(raw: bytes) -> int:
    """The deepest nesting of arrays/objects in the JSON text ``raw`` (strings skipped), without parsing it."""
    brackets = np.frombuffer(_JSON_STRING.sub(b"", raw), np.uint8)
    steps = (np.isin(brackets, (ord("["), ord("{"))).astype(np.int64)
             - np.isin(brackets, (ord("]"), ord("}"))).astype(np.int64))
    return int(np.cumsum(steps).max(initial=0))


def read_weights(path: str, keys: Sequence[str], shardings: Sequence[NamedSharding], *, key: bytes,
                 version: int | None = None) -> tuple[list[jax.Array], list[int]]:
    """Read a ``write_weights`` directory onto ``shardings``; returns (leaves, manifest checksums).

    Verified before use (``FallbackRejected`` otherwise): the manifest's HMAC, its ``version`` (when
    given), every shard file name (``LLLLL.SSSS.pP.bin``: no path outside the directory), every
    box inside its leaf and every shard file's size and HMAC; ``path`` and its parent are not
    symlinks, the manifest nests at most ``MAX_MANIFEST_DEPTH`` deep."""
    mpath = os.path.join(path, _MANIFEST)
    if not os.path.isfile(mpath):
        raise FileNotFoundError(f"weight push fallback: {mpath} does not exist (is {os.path.dirname(path)} on a "
                                "filesystem both processes see?)")
    for d in (os.path.dirname(os.path.abspath(path)), path):
        _check_dir(d, owner=False)
    raw = _read_private(path, _MANIFEST, "the manifest")
    depth = _json_depth(raw)
    if depth > MAX_MANIFEST_DEPTH:
        raise FallbackRejected(f"weight push fallback: {mpath} is not a manifest (nested {depth} deep, at most "
                               f"{MAX_MANIFEST_DEPTH})")
    try:
        manifest = json.loads(raw)
        mac = manifest["mac"]
    except (ValueError, KeyError, TypeError, RecursionError):
        raise FallbackRejected(f"weight push fallback: {mpath} is not a manifest") from None
    if type(mac) is not str or not hmac.compare_digest(mac, _manifest_mac(key, manifest)):
        raise FallbackRejected(f"weight push fallback: {mpath}: MAC mismatch (changed after the trainer wrote it, or "
                               "written with another run's key)")
    if version is not None and manifest.get("version") != int(version):
        raise FallbackRejected(f"weight push fallback: {mpath} holds version {manifest.get('version')}, not {version}")
    entries = manifest["leaves"]
    if [e["key"] for e in entries] != list(keys):
        raise ValueError(f"weight push fallback: {mpath} holds different parameters than this generator expects")
    leaves = []
    with jax.transfer_guard("allow"):
        for e, s in zip(entries, shardings):
            dtype = jnp.dtype(e["dtype"])
            shape = tuple(int(n) for n in e["shape"])
            arr = np.empty(shape, dtype)
            covered = 0
            for sh in e["shards"]:
                name = sh["file"]
                if type(name) is not str or not _SHARD_NAME.match(name):
                    raise FallbackRejected(f"weight push fallback {path}: {e['key']}: shard file name {name!r} is not "
                                           "LLLLL.SSSS.pP.bin")
                b = [(int(lo), int(hi)) for lo, hi in sh["box"]]
                if len(b) != len(shape) or any(not 0 <= lo < hi <= n for (lo, hi), n in zip(b, shape)):
                    raise FallbackRejected(f"weight push fallback {path}: {e['key']}: box {b} outside {shape}")
                bshape = tuple(hi - lo for lo, hi in b)
                data = _read_private(path, name, f"{e['key']}: shard")
                if len(data) != math.prod(bshape) * dtype.itemsize:
                    raise FallbackRejected(f"weight push fallback {path}: {name}: {len(data)} bytes, expected "
                                           f"{math.prod(bshape) * dtype.itemsize}")
                if not hmac.compare_digest(str(sh["mac"]), _mac(key, data)):
                    raise FallbackRejected(f"weight push fallback {path}: {name}: MAC mismatch (the file was changed)")
                arr[tuple(slice(lo, hi) for lo, hi in b)] = np.frombuffer(data, dtype=dtype).reshape(bshape)
                covered += math.prod(bshape)
            if covered != math.prod(shape):
                raise FallbackRejected(f"weight push fallback {path}: {e['key']}: shards cover {covered} of "
                                       f"{math.prod(shape)} elements")
            leaves.append(jax.device_put(arr, s))
    return leaves, [int(e["checksum"]) for e in entries]


def now() -> float:
    return time.perf_counter()


# -- the trainer side of one push (every process of a trainer group runs it) ---------------------------
def _cast_impl():
    return jax.jit(lambda leaves, dtype: [x.astype(dtype) + jax.numpy.zeros((), dtype) for x in leaves],
                   static_argnums=1)


class _LazyCast:
    """Jitted cast to the generator dtype that always returns fresh buffers (``+ 0`` defeats input
    forwarding when the dtypes agree), so the trainer may donate its parameters right after."""

    fn = None

    def __call__(self, leaves, dtype):
        if self.fn is None:
            self.fn = _cast_impl()
        return self.fn(leaves, dtype)


_CAST = _LazyCast()


def prepare_wire(sender: Any, params: Any, dtype: Any) -> tuple[list, Any]:
    """One push's trainer-side programs, dispatched in this order: cast to the generator dtype, the
    ``via_trainer`` reshard (``WireSender.prepare``), the per-leaf checksums. Returns (wire arrays,
    checksums on device). Every process of a trainer group runs exactly this (the leader's pusher and
    ``trainer_group.TrainerFollower``): the same collectives in the same order."""
    wire = sender.prepare(_CAST(jax.tree.leaves(params), dtype))
    return wire, checksums_async(wire)
