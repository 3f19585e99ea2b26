"""The RPC's message encoding: msgpack with a closed set of typed extensions, never pickle.

Decoding a message can construct only: None, bool, int, float, str, bytes, list, dict (msgpack's own
types), tuple, set, frozenset, numpy arrays and scalars of plain numeric dtypes (their bytes travel
as raw buffers after the msgpack body, no copy into it), and the dataclasses named in
``WIRE_TYPES`` (built field by field, like pickle, without running ``__init__``; a name outside the
list is a ``DecodeError``). So a message, even a hostile one, cannot run code on decode: the worst
it can do is fail to decode, and the RPC then closes that peer (``rpc.ProtocolError``).

Frame (what one ``encode`` returns, what ``decode`` takes back): ``u32 body length, u32 buffer
count, u64 length per buffer, msgpack body, buffers``; big-endian. A typed value is packed inline
as a list whose first element is an extension marker (no nested packing, so encoding stays one C
call): a tuple ``[ext(TUPLE), items...]``, a dataclass ``[ext(DATACLASS, name), {field: value}]``,
an array ``[ext(ARRAY), dtype, shape, buffer index]``, a numpy scalar ``[ext(SCALAR), dtype, bytes]``.
"""

from __future__ import annotations

import dataclasses
import importlib
import struct
from typing import Any

import msgpack
import numpy as np

__all__ = ["WIRE_TYPES", "EncodeError", "DecodeError", "encode", "decode", "frame_sizes", "HEADER", "MAX_BUFFERS"]

# Every dataclass that crosses the RPC (controller <-> generators, leader <-> trainer followers).
# Sending any other type fails on the sending side with an EncodeError naming it; add it here.
WIRE_TYPES = (
    "jaxrl_async.distributed.transfer:Layout",
    "jaxrl_async.distributed.transfer:LeafPlan",
    "jaxrl_async.models.config:ModelConfig",
    "jaxrl_async.models.lora:LoraSpec",
    "jaxrl_async.generator.factory:EngineConfig",
    "jaxrl_async.generator.engine_api:SamplingParams",
    "jaxrl_async.data.images:ImageInputs",  # a request's images: encoded bytes + grids, never pixels
    "jaxrl_async.data.images:ImageProcessorConfig",
    "jaxrl_async.generator.requests:RequestOutput",
    "jaxrl_async.generator.requests:SampleOutput",
    "jaxrl_async.generator.requests:GeneratorStats",
    "jaxrl_async.trainer.sft:SFTExample",
    "jaxrl_async.trainer.packing:TrainSequence",
    "jaxrl_async.checkpoint.manager:TrainMeta",
)

EXT_TUPLE, EXT_ARRAY, EXT_SCALAR, EXT_DATACLASS, EXT_SET, EXT_FROZENSET = 1, 2, 3, 4, 5, 6
HEADER = struct.Struct(">II")  # body length, number of buffers
BUFLEN = struct.Struct(">Q")
MAX_BUFFERS = 1 << 16
_KINDS = frozenset("biufc")  # bool, int, uint, float, complex: plain bytes, no objects


class EncodeError(TypeError):
    """A value that the RPC does not send (names the type and where to register it)."""


class DecodeError(ValueError):
    """A frame that is not a well-formed message (the RPC closes the peer that sent it)."""


_by_name: dict[str, type] = {}


def _name(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _resolve(name: str) -> type:
    cls = _by_name.get(name)
    if cls is None:
        if name not in WIRE_TYPES:
            raise DecodeError(f"type {name!r} is not one the RPC decodes")
        mod, _, qual = name.partition(":")
        cls = importlib.import_module(mod)
        for part in qual.split("."):
            cls = getattr(cls, part)
        _by_name[name] = cls
    return cls


def _dtype_ok(dt: np.dtype) -> bool:
    return dt.kind in _KINDS and not dt.hasobject and dt.fields is None and dt.subdtype is None


_TUPLE, _SET, _FROZENSET, _ARRAY, _SCALAR = (msgpack.ExtType(c, b"") for c in (
    EXT_TUPLE, EXT_SET, EXT_FROZENSET, EXT_ARRAY, EXT_SCALAR))


def encode(obj: Any) -> list:
    """``obj`` as one frame: a list of byte chunks to send in order (header, body, array buffers)."""
    buffers: list[memoryview] = []

    def default(x: Any) -> Any:
        t = type(x)
        if t is tuple:
            return [_TUPLE, *x]
        if t is np.ndarray:
            if not _dtype_ok(x.dtype):
                raise EncodeError(f"rpc: cannot send a numpy array of dtype {x.dtype} (plain numeric dtypes only)")
            a = np.ascontiguousarray(x)
            buffers.append(memoryview(a).cast("B") if a.size else memoryview(b""))
            return [_ARRAY, a.dtype.str, list(a.shape), len(buffers) - 1]
        if isinstance(x, np.generic):
            if not _dtype_ok(x.dtype):
                raise EncodeError(f"rpc: cannot send a numpy scalar of dtype {x.dtype}")
            return [_SCALAR, x.dtype.str, x.tobytes()]
        if isinstance(x, dict):  # OrderedDict, defaultdict, Counter: as a plain dict
            return dict(x)
        if isinstance(x, list):
            return list(x)
        if t is set or t is frozenset:
            return [_SET if t is set else _FROZENSET, *x]
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            name = _name(t)
            if name not in WIRE_TYPES:
                raise EncodeError(f"rpc: cannot send a {name} (not in distributed.codec.WIRE_TYPES)")
            _by_name.setdefault(name, t)
            return [msgpack.ExtType(EXT_DATACLASS, name.encode()), {f.name: getattr(x, f.name)
                                                                   for f in dataclasses.fields(x)}]
        raise EncodeError(f"rpc: cannot send a {t.__module__}.{t.__qualname__} (msgpack types, tuple, set, numpy "
                          "arrays of plain dtypes and the dataclasses of distributed.codec.WIRE_TYPES)")

    try:
        body = msgpack.packb(obj, default=default, strict_types=True, use_bin_type=True)
    except EncodeError:
        raise
    except Exception as e:  # noqa: BLE001 - msgpack's own limits (an int beyond 64 bits, nesting depth, ...)
        raise EncodeError(f"rpc: cannot encode the message: {type(e).__name__}: {e}") from None
    if len(buffers) > MAX_BUFFERS:
        raise EncodeError(f"rpc: a message with {len(buffers)} arrays (at most {MAX_BUFFERS})")
    head = HEADER.pack(len(body), len(buffers)) + b"".join(BUFLEN.pack(b.nbytes) for b in buffers)
    return [head, body, *buffers]


def frame_sizes(header: bytes) -> tuple[int, int]:
    """``(body length, buffer count)`` from the first ``HEADER.size`` bytes of a frame."""
    return HEADER.unpack(header)


class _Marker:
    __slots__ = ("code", "name")

    def __init__(self, code: int, name: str = ""):
        self.code, self.name = code, name


_MARKERS = {c: _Marker(c) for c in (EXT_TUPLE, EXT_SET, EXT_FROZENSET, EXT_ARRAY, EXT_SCALAR)}


def _ext_hook(code: int, data: bytes) -> Any:
    if code == EXT_DATACLASS:
        try:
            return _Marker(code, data.decode())
        except UnicodeDecodeError:
            raise DecodeError("bad dataclass name") from None
    m = _MARKERS.get(code)
    if m is None or data:
        raise DecodeError(f"unknown extension type {code}")
    return m


def _dataclass(name: str, fields: Any) -> Any:
    if type(fields) is not dict:
        raise DecodeError(f"{name}: fields are not a map")
    cls = _resolve(name)
    known = {f.name: f for f in dataclasses.fields(cls)}
    extra = set(fields) - set(known)
    if extra:
        raise DecodeError(f"{name}: unknown fields {sorted(map(str, extra))}")
    obj = object.__new__(cls)
    for fname, f in known.items():
        if fname in fields:
            v = fields[fname]
        elif f.default is not dataclasses.MISSING:
            v = f.default
        elif f.default_factory is not dataclasses.MISSING:
            v = f.default_factory()
        else:
            raise DecodeError(f"{name}: field {fname!r} missing")
        object.__setattr__(obj, fname, v)
    return obj


def decode(body: Any, buffers: list) -> Any:
    """The message of one frame (``body`` and its ``buffers``, bytes-like); ``DecodeError`` if malformed."""
    used = set()

    def list_hook(x: list) -> Any:
        if not x or type(x[0]) is not _Marker:
            return x
        code = x[0].code
        if code == EXT_TUPLE:
            return tuple(x[1:])
        if code == EXT_SET:
            return set(x[1:])
        if code == EXT_FROZENSET:
            return frozenset(x[1:])
        if code == EXT_DATACLASS:
            if len(x) != 2:
                raise DecodeError("bad dataclass value")
            return _dataclass(x[0].name, x[1])
        if code == EXT_ARRAY:
            if len(x) != 4:
                raise DecodeError("bad array header")
            _, dtype, shape, idx = x
            dt = np.dtype(str(dtype))
            if not _dtype_ok(dt) or type(shape) is not list or not all(type(n) is int and n >= 0 for n in shape):
                raise DecodeError(f"bad array header ({dtype!r}, {shape!r})")
            if type(idx) is not int or not 0 <= idx < len(buffers) or idx in used:
                raise DecodeError(f"bad array buffer index {idx!r}")
            used.add(idx)
            buf = buffers[idx]
            n = 1
            for d in shape:
                n *= d
            if n * dt.itemsize != len(buf):
                raise DecodeError(f"array of {shape} x {dt} in a buffer of {len(buf)} bytes")
            return np.frombuffer(buf, dtype=dt).reshape(shape)
        if code == EXT_SCALAR:
            if len(x) != 3:
                raise DecodeError("bad numpy scalar")
            _, dtype, raw = x
            dt = np.dtype(str(dtype))
            if not _dtype_ok(dt) or type(raw) is not bytes or len(raw) != dt.itemsize:
                raise DecodeError(f"bad numpy scalar ({dtype!r})")
            return np.frombuffer(raw, dtype=dt)[0]
        raise DecodeError(f"unknown extension type {code}")

    try:
        out = msgpack.unpackb(body, ext_hook=_ext_hook, list_hook=list_hook, raw=False, strict_map_key=False,
                              use_list=True)
    except DecodeError:
        raise
    except Exception as e:  # noqa: BLE001 - msgpack's own errors, a TypeError from an unhashable key, ...
        raise DecodeError(f"{type(e).__name__}: {e}") from None
    if type(out) is _Marker:
        raise DecodeError("a bare extension marker")
    return out
