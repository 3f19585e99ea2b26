"""Minimal memory-mapped safetensors reader/writer with bfloat16 support.

The `safetensors` numpy backend cannot represent bfloat16; this reader parses the header
(8-byte little-endian length + JSON) and exposes every tensor as a read-only `np.memmap`
view (bfloat16 via ml_dtypes), so importing a model never copies a whole file to host RAM.
Sharded checkpoints (`model.safetensors.index.json`) are resolved through their weight map.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Iterable, Mapping

import ml_dtypes
import numpy as np

_DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}
_NAMES = {v: k for k, v in _DTYPES.items()}

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


class SafetensorsError(ValueError):
    pass


def _read_header(path: str) -> tuple[dict, int]:
    with open(path, "rb") as fh:
        raw = fh.read(8)
        if len(raw) != 8:
            raise SafetensorsError(f"{path}: truncated safetensors file (no header)")
        (n,) = struct.unpack("<Q", raw)
        if n > 100 * 2**20:
            raise SafetensorsError(f"{path}: corrupt safetensors header length {n}")
        try:
            header = json.loads(fh.read(n))
        except json.JSONDecodeError as e:
            raise SafetensorsError(f"{path}: corrupt safetensors header ({e})") from None
    return header, 8 + n


class SafetensorsReader:
    """Name -> memory-mapped numpy array over one file or a sharded checkpoint directory."""

    def __init__(self, files: Iterable[str]):
        self._entries: dict[str, tuple[str, np.dtype, tuple[int, ...], int]] = {}
        self._maps: dict[str, np.memmap] = {}
        for path in files:
            header, base = _read_header(path)
            size = os.path.getsize(path)
            for name, meta in header.items():
                if name == "__metadata__":
                    continue
                if meta["dtype"] not in _DTYPES:
                    raise SafetensorsError(f"{path}: tensor {name!r} has unsupported dtype {meta['dtype']}")
                start, end = meta["data_offsets"]
                if base + end > size:
                    raise SafetensorsError(f"{path}: tensor {name!r} extends past the end of the file (truncated?)")
                self._entries[name] = (path, _DTYPES[meta["dtype"]], tuple(meta["shape"]), base + start)

    @classmethod
    def from_dir(cls, model_dir: str) -> "SafetensorsReader":
        index = os.path.join(model_dir, INDEX_NAME)
        if os.path.exists(index):
            with open(index) as fh:
                try:
                    weight_map = json.load(fh)["weight_map"]
                except (json.JSONDecodeError, KeyError) as e:
                    raise SafetensorsError(f"{index}: invalid index file ({e!r})") from None
            files = sorted({os.path.join(model_dir, f) for f in weight_map.values()})
            missing = [f for f in files if not os.path.exists(f)]
            if missing:
                raise SafetensorsError(f"{index}: shard files missing: {missing}")
            return cls(files)
        single = os.path.join(model_dir, SINGLE_NAME)
        if os.path.exists(single):
            return cls([single])
        files = sorted(os.path.join(model_dir, f) for f in os.listdir(model_dir) if f.endswith(".safetensors"))
        if not files:
            raise FileNotFoundError(f"{model_dir}: no *.safetensors weights found")
        return cls(files)

    def keys(self) -> list[str]:
        return list(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entries[name][2]

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def get(self, name: str) -> np.ndarray:
        path, dtype, shape, offset = self._entries[name]
        if path not in self._maps:
            self._maps[path] = np.memmap(path, dtype=np.uint8, mode="r")
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        return self._maps[path][offset:offset + nbytes].view(dtype).reshape(shape)


def write_safetensors(path: str, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None):
    """Write tensors (any dtype in the table above, bfloat16 included) to one safetensors file."""
    header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    arrays = []
    for name, arr in tensors.items():
        arr = np.ascontiguousarray(arr)
        if arr.dtype not in _NAMES:
            raise SafetensorsError(f"cannot write tensor {name!r} of dtype {arr.dtype}")
        header[name] = {"dtype": _NAMES[arr.dtype], "shape": list(arr.shape),
                        "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
        arrays.append(arr)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as fh:
        fh.write(struct.pack("<Q", len(blob)))
        fh.write(blob)
        for arr in arrays:
            fh.write(arr.tobytes(order="C"))
    os.replace(tmp, path)
