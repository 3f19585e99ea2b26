"""JSON encoding of checkpoint metadata, numeric pooling of buffered trajectories, RNG state.

Metadata (`to_jsonable` / `from_jsonable`)
------------------------------------------
Opaque loop state (data-iterator state, staleness counters, run config, RNG state) is stored as
JSON. Encoding rules, applied recursively:

* None, bool, int, float, str -> themselves; dict keys must be str (error names the path).
* list and tuple -> list (tuples come back as lists).
* dataclass instance -> dict of its fields; numpy scalar -> Python scalar.
* bytes -> {"__bytes_b64__": base64}; np.ndarray / jax.Array -> {"__ndarray__": dtype, "shape", "data"}.
  Both decode back to bytes / np.ndarray.
* Anything else is a TypeError naming the path (e.g. `meta.data_state["it"][2]`).

Trajectories (`pack_records` / `unpack_records`)
------------------------------------------------
Finished-but-unconsumed trajectories can hold millions of token ids and log-probs, far too much
for JSON. `pack_records` encodes any JSON-like structure (lists of dicts or dataclasses, as above)
but *spills* every non-empty numeric sequence into a per-dtype pool:

* a list/tuple whose elements are all `int` (bool excluded, |v| < 2**63) -> pool "int64";
  all `float` -> pool "float64"; all one numpy scalar type -> that dtype's pool;
* an np.ndarray (numeric/bool dtype, size > 0) -> its dtype's pool (flattened, shape recorded).

The skeleton keeps a reference {"__pool__": dtype, "start": s, "stop": e, "kind": k[, "shape"]}
in place of the sequence; pools are concatenated 1-D numpy arrays saved as an Orbax item.
Decoding slices the pools: kind "list" -> `arr.tolist()` (Python ints/floats, bit-exact since
int64/float64 hold them exactly), "nplist" -> list of numpy scalars, "ndarray" -> reshaped copy.
Mixed int/float lists, strings and other scalars stay inline in the JSON skeleton.
"""

from __future__ import annotations

import base64
import dataclasses
import random
from typing import Any, Mapping

import numpy as np

BYTES_KEY = "__bytes_b64__"
NDARRAY_KEY = "__ndarray__"
POOL_KEY = "__pool__"
RNG_KEY = "__rng__"
_RESERVED = (BYTES_KEY, NDARRAY_KEY, POOL_KEY)
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


class _Pools:
    """Accumulates 1-D arrays per dtype; `take` returns a reference into the pool."""

    def __init__(self):
        self.parts: dict[str, list[np.ndarray]] = {}
        self.sizes: dict[str, int] = {}

    def take(self, arr: np.ndarray, kind: str, shape: tuple[int, ...] | None = None) -> dict[str, Any]:
        key = arr.dtype.name
        start = self.sizes.get(key, 0)
        self.parts.setdefault(key, []).append(arr.reshape(-1))
        self.sizes[key] = start + arr.size
        ref: dict[str, Any] = {POOL_KEY: key, "start": start, "stop": start + arr.size, "kind": kind}
        if shape is not None:
            ref["shape"] = list(shape)
        return ref

    def arrays(self) -> dict[str, np.ndarray]:
        return {k: np.concatenate(v) for k, v in self.parts.items()}


def _numeric_list(seq: list | tuple) -> tuple[np.ndarray, str] | None:
    """(array, kind) when `seq` is a non-empty homogeneous numeric sequence, else None."""
    if not seq:
        return None
    types = set(map(type, seq))
    if len(types) != 1:
        return None
    (t,) = types
    if t is int:
        if min(seq) < _INT64_MIN or max(seq) > _INT64_MAX:
            return None
        return np.asarray(seq, dtype=np.int64), "list"
    if t is float:
        return np.asarray(seq, dtype=np.float64), "list"
    if issubclass(t, (np.number, np.bool_)):
        return np.asarray(seq, dtype=t), "nplist"
    return None


def _path_str(path: str, key: Any) -> str:
    return f"{path}[{key!r}]"


def _encode(obj: Any, path: str, pools: _Pools | None) -> Any:
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, (int, float)) and not isinstance(obj, np.generic):
        return obj
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return {BYTES_KEY: base64.b64encode(bytes(obj)).decode("ascii")}
    if isinstance(obj, Mapping):
        out = {}
        for k, v in obj.items():
            if not isinstance(k, str):
                raise TypeError(f"{path}: dict keys must be str for JSON, got key {k!r} ({type(k).__name__})")
            if k in _RESERVED:
                raise ValueError(f"{path}: key {k!r} is reserved by the checkpoint encoding")
            out[k] = _encode(v, _path_str(path, k), pools)
        return out
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _encode(getattr(obj, f.name), f"{path}.{f.name}", pools) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        if pools is not None:
            spilled = _numeric_list(obj)
            if spilled is not None:
                return pools.take(spilled[0], spilled[1])
        return [_encode(v, _path_str(path, i), pools) for i, v in enumerate(obj)]
    if hasattr(obj, "__array__") and hasattr(obj, "dtype") and hasattr(obj, "shape"):
        if "key<" in str(obj.dtype):
            raise TypeError(f"{path}: typed PRNG key arrays are not JSON; store rng_to_json(key) instead")
        arr = np.asarray(obj)
        if arr.dtype.kind not in "biufc":
            raise TypeError(f"{path}: array of dtype {arr.dtype} cannot be checkpointed (numeric/bool only)")
        if pools is not None and arr.size > 0:
            return pools.take(np.ascontiguousarray(arr), "ndarray", arr.shape)
        return {NDARRAY_KEY: arr.dtype.name, "shape": list(arr.shape), "data": arr.reshape(-1).tolist()}
    raise TypeError(f"{path}: cannot encode {type(obj).__name__} as JSON "
                    "(use dicts, lists, str, numbers, bytes, numpy arrays or dataclasses)")


def _decode(obj: Any, pools: Mapping[str, np.ndarray] | None, path: str) -> Any:
    if isinstance(obj, list):
        return [_decode(v, pools, _path_str(path, i)) for i, v in enumerate(obj)]
    if not isinstance(obj, dict):
        return obj
    if BYTES_KEY in obj:
        return base64.b64decode(obj[BYTES_KEY])
    if NDARRAY_KEY in obj:
        return np.asarray(obj["data"], dtype=np.dtype(obj[NDARRAY_KEY])).reshape(obj["shape"])
    if POOL_KEY in obj:
        name = obj[POOL_KEY]
        if pools is None or name not in pools:
            raise ValueError(f"{path}: references pool {name!r}, which the checkpoint does not contain")
        pool = pools[name]
        start, stop = int(obj["start"]), int(obj["stop"])
        if not 0 <= start <= stop <= pool.shape[0]:
            raise ValueError(f"{path}: slice [{start}:{stop}] is outside pool {name!r} of length {pool.shape[0]}")
        part = pool[start:stop]
        if obj["kind"] == "list":
            return part.tolist()
        if obj["kind"] == "nplist":
            return list(part)
        return part.reshape(obj["shape"]).copy()
    return {k: _decode(v, pools, _path_str(path, k)) for k, v in obj.items()}


def to_jsonable(obj: Any, path: str = "value") -> Any:
    """Encode `obj` as JSON-compatible data (module doc); errors name `path`."""
    return _encode(obj, path, None)


def from_jsonable(obj: Any, path: str = "value") -> Any:
    """Inverse of `to_jsonable` (bytes and arrays restored; tuples and dataclasses come back as lists/dicts)."""
    return _decode(obj, None, path)


def pack_records(records: Any, path: str = "trajectories") -> tuple[Any, dict[str, np.ndarray]]:
    """(JSON skeleton, {dtype name: 1-D pool}) for a JSON-like structure with numeric sequences spilled."""
    pools = _Pools()
    skeleton = _encode(records, path, pools)
    return skeleton, pools.arrays()


def unpack_records(skeleton: Any, pools: Mapping[str, np.ndarray], path: str = "trajectories") -> Any:
    """Inverse of `pack_records`."""
    return _decode(skeleton, {k: np.asarray(v) for k, v in pools.items()}, path)


# ---------------------------------------------------------------------------------------
# RNG state
# ---------------------------------------------------------------------------------------
def rng_to_json(rng: Any) -> dict[str, Any]:
    """JSON state of a jax PRNG key (typed or raw uint32), np.random.Generator or random.Random."""
    if isinstance(rng, np.random.Generator):
        return {RNG_KEY: "numpy", "bit_generator": type(rng.bit_generator).__name__,
                "state": rng.bit_generator.state}
    if isinstance(rng, random.Random):
        version, internal, gauss = rng.getstate()
        return {RNG_KEY: "python", "version": version, "internal": list(internal), "gauss_next": gauss}
    import jax

    if isinstance(rng, jax.Array):
        if jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key):
            return {RNG_KEY: "jax", "typed": True, "impl": str(jax.random.key_impl(rng)),
                    "data": np.asarray(jax.random.key_data(rng)).tolist()}
        return {RNG_KEY: "jax", "typed": False, "dtype": str(rng.dtype), "data": np.asarray(rng).tolist()}
    raise TypeError(f"rng_to_json: unsupported RNG type {type(rng).__name__} "
                    "(jax key, np.random.Generator, random.Random)")


def rng_from_json(state: Mapping[str, Any]) -> Any:
    """Rebuild the RNG saved by `rng_to_json` (a new object in exactly the saved state)."""
    kind = state.get(RNG_KEY) if isinstance(state, Mapping) else None
    if kind == "numpy":
        bit_gen = getattr(np.random, state["bit_generator"])()
        bit_gen.state = dict(state["state"])
        return np.random.Generator(bit_gen)
    if kind == "python":
        r = random.Random()
        r.setstate((state["version"], tuple(state["internal"]), state["gauss_next"]))
        return r
    if kind == "jax":
        import jax
        import jax.numpy as jnp

        if state["typed"]:
            return jax.random.wrap_key_data(jnp.asarray(state["data"], jnp.uint32), impl=state["impl"])
        return jnp.asarray(state["data"], dtype=state["dtype"])
    raise ValueError(f"rng_from_json: not an RNG state written by rng_to_json: {str(state)[:200]}")
