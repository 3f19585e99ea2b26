"""Prompt rows with images for Qwen2.5-VL: the image processor and chat-template rendering of transformers'
``Qwen2_5_VLProcessor`` (with the PIL ``Qwen2VLImageProcessorPil``), reproduced exactly (tests/data/test_vl_data.py).

Row format (JSONL / Parquet, any of the text formats of formats.py, e.g. ``generic``): the usual columns plus an
``images`` column (``DatasetConfig.fields["images"]`` renames it) holding a list of images (or one image), each

* a string: a file path, relative to the directory of the data file (or absolute), or a ``data:image/...;base64,``
  URI;
* bytes (Parquet ``binary``): the encoded file (PNG, JPEG, ...);
* an object ``{"bytes": ..., "path": ...}`` (the Parquet struct of Hugging Face ``datasets``' ``Image`` feature,
  as in veRL's geo3k files): ``bytes`` (binary in Parquet, base64 text in JSONL) if set, else ``path``.

The prompt text marks where the images go with ``<image>`` (veRL's convention): one marker per image, in order;
a prompt with no marker gets all its images before the text (Qwen's examples). The text is split at the markers
into the content parts of one user turn, ``[{"type": "image"}, {"type": "text", "text": ...}, ...]`` (empty text
parts dropped), which the tokenizer's (Qwen2.5-VL) chat template renders as
``<|vision_start|><|image_pad|><|vision_end|>``; each ``<|image_pad|>`` is then expanded to
``grid_t * grid_h * grid_w / merge**2`` copies and the text tokenized, as the HF processor does. With
``apply_chat_template=False`` each marker becomes ``<|vision_start|><|image_pad|><|vision_end|>`` in the raw text.
``prompt_suffix`` is appended to the text (after the last marker).

Image processing (:class:`ImageProcessorConfig`, = ``Qwen2VLImageProcessorPil``): open with PIL, apply the EXIF
orientation (``ImageOps.exif_transpose``, as HF ``load_image``), convert to RGB (alpha composited onto white:
RGBA, LA, palette images with transparency; greyscale and palette images converted), resize with PIL bicubic to
``smart_resize(h, w, factor=patch*merge, min_pixels, max_pixels)``, rescale (float64 * 1/255 -> float32),
normalise with mean/std (float32), and flatten into patches ``[grid_h*grid_w, C*Tp*P*P]`` in HF's order (merge
blocks of ``merge x merge`` patches row-major; inside a patch: channel, temporal copy, row, column; the single
frame repeated ``Tp`` times); ``grid_thw = (1, h/P, w/P)``.

Bad images name their row with the usual one-line :class:`DataFormatError` (``PATH: row N: image K (...): reason``:
missing file, undecodable bytes, more than ``max_image_pixels`` before resizing, an aspect ratio over 200, or more
image tokens than ``max_prompt_len``), or are skipped and counted in ``DataStats.bad_rows`` with
``skip_bad_rows``. A prompt whose text + image tokens exceed ``max_prompt_len`` is dropped and counted in
``too_long`` like a text prompt.

Records (:class:`VLPromptRecord`, a :class:`PromptRecord`) hold the encoded image bytes and the grids, not the
pixels: ``pixel_values()`` decodes and processes on demand (deterministic), so a dataset costs the size of its
files in memory, not ~5 KB per patch. See NOTES.md (Issue 29, data) for how images are meant to travel with
trajectories.
"""
from __future__ import annotations

import base64
import binascii
import dataclasses
import io
import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jaxrl_async.data.datasets import (
    DataFormatError,
    DatasetConfig,
    DataStats,
    PromptDataset,
    PromptRecord,
    iter_raw_rows,
    log_load_stats,
)
from jaxrl_async.data.formats import RowError, parse_row

__all__ = [
    "IMAGE_MARKER", "ImageError", "ImageInputs", "ImageProcessorConfig", "OPENAI_CLIP_MEAN", "OPENAI_CLIP_STD",
    "VLPromptRecord", "VLTokens", "batch_vision_inputs", "decode_image", "image_processor_for", "load_vl_prompt_dataset",
    "process_image", "read_vl_prompt_records", "smart_resize", "to_rgb", "user_content", "vl_token_ids", "vl_tokens_of",
]

IMAGE_MARKER = "<image>"
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


class ImageError(ValueError):
    """An image cannot be used (the reader adds file, row and image number)."""


@dataclasses.dataclass(frozen=True)
class ImageProcessorConfig:
    """``Qwen2VLImageProcessor``'s settings (defaults = Qwen2.5-VL's preprocessor_config.json) and a guard.

    Attributes:
      min_pixels / max_pixels: the resized image's pixel count bounds (HF ``size.shortest_edge`` / ``longest_edge``).
      patch_size, temporal_patch_size, merge_size: the vision tower's (Qwen2.5-VL: 14, 2, 2).
      image_mean / image_std: per-channel normalisation of the [0, 1] pixels.
      max_image_pixels: images with more pixels than this *before* resizing are rejected (checked from the file
        header, before decoding); None = PIL's own decompression-bomb limit only.
    """

    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple[float, ...] = OPENAI_CLIP_MEAN
    image_std: tuple[float, ...] = OPENAI_CLIP_STD
    max_image_pixels: int | None = 8192 * 8192

    def __post_init__(self):
        if not 0 < self.min_pixels <= self.max_pixels:
            raise ValueError(f"need 0 < min_pixels <= max_pixels, got {self.min_pixels}, {self.max_pixels}")
        if min(self.patch_size, self.temporal_patch_size, self.merge_size) < 1:
            raise ValueError("patch_size, temporal_patch_size and merge_size must be >= 1")
        if len(self.image_mean) != 3 or len(self.image_std) != 3:
            raise ValueError("image_mean and image_std need 3 values (RGB)")

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @property
    def patch_dim(self) -> int:
        return 3 * self.temporal_patch_size * self.patch_size ** 2

    @classmethod
    def from_hf(cls, src: Mapping[str, Any] | str | os.PathLike, **overrides) -> ImageProcessorConfig:
        """From a ``preprocessor_config.json`` (dict, file or model directory): ``size.shortest_edge`` /
        ``longest_edge`` or the older ``min_pixels`` / ``max_pixels``, patch sizes, mean/std."""
        if not isinstance(src, Mapping):
            path = os.fspath(src)
            if os.path.isdir(path):
                path = os.path.join(path, "preprocessor_config.json")
            with open(path, encoding="utf-8") as f:
                src = json.load(f)
        size = src.get("size") or {}
        kw: dict[str, Any] = {}
        lo = size.get("shortest_edge", src.get("min_pixels"))
        hi = size.get("longest_edge", src.get("max_pixels"))
        if lo is not None:
            kw["min_pixels"] = int(lo)
        if hi is not None:
            kw["max_pixels"] = int(hi)
        for k in ("patch_size", "temporal_patch_size", "merge_size"):
            if src.get(k) is not None:
                kw[k] = int(src[k])
        for k in ("image_mean", "image_std"):
            if src.get(k) is not None:
                kw[k] = tuple(float(x) for x in src[k])
        kw.update(overrides)
        return cls(**kw)

    def to_hf(self) -> dict[str, Any]:
        """The ``preprocessor_config.json`` of these settings (transformers' ``Qwen2VLImageProcessor``; `from_hf`
        reads it back equal)."""
        return {"image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor",
                "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
                "do_convert_rgb": True, "resample": 3, "size": {"shortest_edge": self.min_pixels,
                                                                "longest_edge": self.max_pixels},
                "min_pixels": self.min_pixels, "max_pixels": self.max_pixels, "patch_size": self.patch_size,
                "temporal_patch_size": self.temporal_patch_size, "merge_size": self.merge_size,
                "image_mean": list(self.image_mean), "image_std": list(self.image_std)}

    def grid(self, height: int, width: int) -> tuple[int, int, int]:
        """(grid_t, grid_h, grid_w) of an image of ``height`` x ``width`` pixels."""
        h, w = smart_resize(height, width, self.factor, self.min_pixels, self.max_pixels)
        return 1, h // self.patch_size, w // self.patch_size

    def num_tokens(self, grid_thw) -> int:
        """The image's placeholder tokens: ``t * h * w / merge**2``."""
        t, h, w = (int(x) for x in grid_thw)
        return t * h * w // self.merge_size ** 2


def image_processor_for(vision: Any, model_dir: str | None = None, **overrides: Any) -> ImageProcessorConfig:
    """A model's image processor: ``model_dir``'s ``preprocessor_config.json`` when it has one, else Qwen2.5-VL's
    defaults scaled to the tower's patch (``vision``: a ``VisionConfig``; min 4 and max 1280 merge units, i.e.
    56x56 and 28x28x1280 pixels at patch 14); ``overrides`` (min_pixels / max_pixels ...) win."""
    pre = None if model_dir is None else os.path.join(model_dir, "preprocessor_config.json")
    if pre is not None and os.path.isfile(pre):
        return ImageProcessorConfig.from_hf(pre, **overrides)
    f = vision.patch_size * vision.spatial_merge_size
    kw = {"min_pixels": 4 * f * f, "max_pixels": 1280 * f * f, **overrides}
    return ImageProcessorConfig(patch_size=vision.patch_size, temporal_patch_size=vision.temporal_patch_size,
                                merge_size=vision.spatial_merge_size, **kw)


def smart_resize(height: int, width: int, factor: int = 28, min_pixels: int = 56 * 56,
                 max_pixels: int = 14 * 14 * 4 * 1280) -> tuple[int, int]:
    """(h, w) divisible by ``factor`` with ``min_pixels <= h*w <= max_pixels`` and about the aspect ratio
    (transformers' ``qwen2_vl.smart_resize``, the same arithmetic)."""
    if max(height, width) / min(height, width) > 200:
        raise ImageError(f"absolute aspect ratio must be smaller than 200, got {max(height, width) / min(height, width)}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def to_rgb(image):
    """An RGB PIL image; transparency (an alpha band or a ``transparency`` entry) composited onto white
    (transformers' ``convert_to_rgb``)."""
    from PIL import Image

    if "A" in image.getbands() or image.info.get("transparency") is not None:
        image = image.convert("RGBA")
        background = Image.new("RGBA", image.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, image).convert("RGB")
    return image.convert("RGB")


def decode_image(data: bytes, max_image_pixels: int | None = None):
    """The upright RGB PIL image of encoded ``data``; ImageError when it cannot be decoded or is too large."""
    import warnings

    from PIL import Image, ImageOps

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            w, h = image.size
            if max_image_pixels is not None and w * h > max_image_pixels:
                raise ImageError(f"too large: {w}x{h} = {w * h} pixels > max_image_pixels={max_image_pixels}")
            image.load()
            image = ImageOps.exif_transpose(image)
    except ImageError:
        raise
    except Exception as e:  # PIL raises many kinds (UnidentifiedImageError, OSError, SyntaxError, ...)
        msg = str(e).splitlines()[0] if str(e) else ""
        raise ImageError(f"cannot decode the image ({type(e).__name__}: {msg})") from None
    return to_rgb(image)


def process_image(image, cfg: ImageProcessorConfig) -> tuple[np.ndarray, tuple[int, int, int]]:
    """(pixel patches [grid_h*grid_w, 3*Tp*P*P] float32, (1, grid_h, grid_w)) of an RGB PIL image, equal to
    ``Qwen2VLImageProcessorPil``'s."""
    from PIL import Image

    width, height = image.size
    rh, rw = smart_resize(height, width, cfg.factor, cfg.min_pixels, cfg.max_pixels)
    resized = np.asarray(image.resize((rw, rh), resample=Image.Resampling.BICUBIC))  # [H, W, 3] uint8
    x = (resized.astype(np.float64) * (1 / 255)).astype(np.float32)
    x = (x - np.asarray(cfg.image_mean, np.float32)) / np.asarray(cfg.image_std, np.float32)
    x = np.moveaxis(x, -1, 0)  # [C, H, W]
    p, m, tp = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    gh, gw = rh // p, rw // p
    x = x.reshape(3, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)  # (gh/m, gw/m, m, m, C, P, P)
    x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], tp, p, p))
    return np.ascontiguousarray(x.reshape(gh * gw, 3 * tp * p * p)), (1, gh, gw)


# ----------------------------------------------------------------------------------------------------------
# Rows.
# ----------------------------------------------------------------------------------------------------------
def _b64(text: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImageError(f"invalid base64 ({e})") from None


_DATA_URI = re.compile(r"^data:image/[\w.+-]+;base64,", re.ASCII)


def _image_bytes(item: Any, base_dir: str) -> tuple[bytes, str]:
    """(encoded bytes, a short description) of one ``images`` entry."""
    if isinstance(item, Mapping):
        if item.get("bytes") is not None:
            data = item["bytes"]
            return (data if isinstance(data, (bytes, bytearray)) else _b64(str(data))), "bytes"
        if item.get("path") is not None:
            return _image_bytes(str(item["path"]), base_dir)
        raise ImageError(f"an image object needs 'bytes' or 'path', got keys {sorted(item)}")
    if isinstance(item, (bytes, bytearray, memoryview)):
        return bytes(item), "bytes"
    if isinstance(item, str):
        if _DATA_URI.match(item):
            return _b64(item[item.index(",") + 1:]), "data URI"
        if not item.strip():
            raise ImageError("empty image path")
        path = item if os.path.isabs(item) else os.path.join(base_dir, item)
        try:
            with open(path, "rb") as f:
                return f.read(), repr(item)
        except FileNotFoundError:
            raise ImageError(f"{item!r}: file not found") from None
        except OSError as e:
            raise ImageError(f"{item!r}: cannot read ({e.strerror or e})") from None
    raise ImageError(f"an image must be a path, bytes or {{'bytes', 'path'}}, got {type(item).__name__}")


def _image_list(value: Any) -> list[Any]:
    if value is None:
        return []
    if hasattr(value, "tolist") and not isinstance(value, (bytes, str)):  # numpy array from Parquet
        value = value.tolist()
    return list(value) if isinstance(value, (list, tuple)) else [value]


def user_content(text: str, n_images: int) -> list[dict[str, Any]]:
    """The content parts of a user turn: ``text`` split at ``<image>`` markers (one per image, or none: images
    first), empty text parts dropped."""
    pieces = text.split(IMAGE_MARKER)
    markers = len(pieces) - 1
    if markers and markers != n_images:
        raise RowError(f"the prompt has {markers} {IMAGE_MARKER} markers but the row has {n_images} images")
    parts: list[dict[str, Any]] = []
    if not markers:
        parts += [{"type": "image"}] * n_images
        pieces = [text]
    for i, piece in enumerate(pieces):
        if i:
            parts.append({"type": "image"})
        if piece:
            parts.append({"type": "text", "text": piece})
    return parts


@dataclasses.dataclass(frozen=True, eq=False)
class ImageInputs:
    """The images of one prompt as they travel through a run (generator request -> trajectory -> trainer batch):
    the *encoded* files, their grids and the processor settings, not pixels. ``pixel_values()`` decodes and
    processes them on first use and keeps the result on this object (bit-identical every time: same bytes, same
    processor), so the generator's prefill and the trainer's log-prob recompute of the samples of one prompt share
    one decode when they share the object; a copy across processes ships the encoded bytes (~27x smaller than the
    float32 patches). ``digest`` identifies the content (equal bytes + grids + processor)."""

    images: tuple[bytes, ...]
    grid_thw: np.ndarray  # [n, 3] int64
    processor: ImageProcessorConfig

    def __post_init__(self):
        g = np.asarray(self.grid_thw, np.int64).reshape(-1, 3)
        if g.shape[0] != len(self.images):
            raise ValueError(f"ImageInputs: {len(self.images)} images but {g.shape[0]} grid rows")
        object.__setattr__(self, "grid_thw", g)
        object.__setattr__(self, "_pixels", None)

    def __len__(self) -> int:
        return len(self.images)

    @property
    def num_patches(self) -> int:
        return int(np.prod(self.grid_thw, axis=1).sum())

    @property
    def num_tokens(self) -> int:
        """Placeholder tokens of all the images (``t*h*w / merge**2`` each)."""
        return sum(self.processor.num_tokens(g) for g in self.grid_thw)

    @property
    def nbytes(self) -> int:
        """Bytes this object carries between processes (the encoded files + grids)."""
        return sum(len(b) for b in self.images) + self.grid_thw.nbytes

    @property
    def digest(self) -> str:
        import hashlib

        h = hashlib.blake2b(digest_size=16)
        for b in self.images:
            h.update(len(b).to_bytes(8, "little"))
            h.update(b)
        h.update(self.grid_thw.tobytes())
        h.update(repr(self.processor).encode())
        return h.hexdigest()

    def pixel_values(self) -> np.ndarray:
        """[num_patches, 3*Tp*P*P] float32, the processor's patches, images in order (cached on this object)."""
        px = getattr(self, "_pixels", None)  # (absent on an object the RPC codec built field by field)
        if px is None:
            cfg = self.processor
            out = [process_image(decode_image(b, cfg.max_image_pixels), cfg)[0] for b in self.images]
            px = np.concatenate(out) if out else np.zeros((0, cfg.patch_dim), np.float32)
            px.setflags(write=False)
            object.__setattr__(self, "_pixels", px)
        return px

    def drop_pixels(self) -> None:
        """Forget the cached pixels (they are recomputed on the next ``pixel_values()``)."""
        object.__setattr__(self, "_pixels", None)

    def __getstate__(self):  # pickles (process boundaries) carry the encoded bytes, never the pixels
        return {"images": self.images, "grid_thw": self.grid_thw, "processor": self.processor}

    def __setstate__(self, state):
        for k, v in state.items():
            object.__setattr__(self, k, v)
        object.__setattr__(self, "_pixels", None)


@dataclasses.dataclass(frozen=True)
class VLTokens:
    """The special tokens of the Qwen2.5-VL chat format (the tokenizer's strings)."""

    image_pad: str = "<|image_pad|>"
    vision_start: str = "<|vision_start|>"
    vision_end: str = "<|vision_end|>"


def vl_tokens_of(tokenizer) -> VLTokens:
    """The tokenizer's vision special tokens (Qwen2.5-VL's strings; a ValueError naming the missing one)."""
    t = VLTokens()
    vocab = tokenizer.get_vocab()
    for s in (t.image_pad, t.vision_start, t.vision_end):
        if s not in vocab:
            raise ValueError(f"the tokenizer has no {s} token: a vision-language policy needs Qwen2.5-VL's special "
                             "tokens (data.tokenizer_kind=arithmetic_vl builds a local tokenizer with them)")
    return t


def vl_token_ids(tokenizer) -> dict[str, int]:
    """``VLConfig``'s special token ids from the tokenizer (``<|video_pad|>`` optional: -1 when absent)."""
    t = vl_tokens_of(tokenizer)
    vocab = tokenizer.get_vocab()
    return {"image_token_id": vocab[t.image_pad], "vision_start_token_id": vocab[t.vision_start],
            "vision_end_token_id": vocab[t.vision_end], "video_token_id": vocab.get("<|video_pad|>", -1)}


@dataclasses.dataclass(frozen=True, eq=False)
class VLPromptRecord(PromptRecord):
    """A :class:`PromptRecord` with images: ``images`` the encoded files (in prompt order), ``image_grid_thw``
    [n, 3] int64, ``image_processor`` the settings that made the grids. ``prompt_ids`` already holds each image's
    ``num_tokens`` placeholders. ``pixel_values()`` = the processor's pixel patches [sum(t*h*w), 3*Tp*P*P]."""

    images: tuple[bytes, ...] = ()
    image_grid_thw: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros((0, 3), np.int64))
    image_processor: ImageProcessorConfig = dataclasses.field(default_factory=ImageProcessorConfig)

    def pixel_values(self) -> np.ndarray:
        cfg = self.image_processor
        out = [process_image(decode_image(b, cfg.max_image_pixels), cfg)[0] for b in self.images]
        return np.concatenate(out) if out else np.zeros((0, cfg.patch_dim), np.float32)

    def image_inputs(self) -> "ImageInputs | None":
        """The record's images as they travel with requests and trajectories (None for a text-only row). One
        object per record (cached), so every sample of the prompt shares its decoded pixels."""
        if not self.images:
            return None
        got = self.__dict__.get("_image_inputs")
        if got is None:
            got = ImageInputs(tuple(self.images), self.image_grid_thw, self.image_processor)
            object.__setattr__(self, "_image_inputs", got)
        return got

    @property
    def num_image_tokens(self) -> int:
        return sum(self.image_processor.num_tokens(g) for g in self.image_grid_thw)


def batch_vision_inputs(records: Sequence[PromptRecord]) -> dict[str, np.ndarray] | None:
    """``pixel_values`` [N, D] and ``image_grid_thw`` [n, 3] of a batch, images in record order (what the model's
    ``prepare_inputs`` / ``forward`` take with the batch's tokens); None when no record has an image."""
    pix, grids = [], []
    for r in records:
        if isinstance(r, VLPromptRecord) and r.images:
            pix.append(r.pixel_values())
            grids.append(r.image_grid_thw)
    if not pix:
        return None
    return {"pixel_values": np.concatenate(pix), "image_grid_thw": np.concatenate(grids).astype(np.int64)}


def _render(text: str, n_images: int, tokenizer, cfg: DatasetConfig, tokens: VLTokens) -> str:
    if not cfg.apply_chat_template:
        if IMAGE_MARKER not in text:
            text = IMAGE_MARKER * n_images + text
        elif text.count(IMAGE_MARKER) != n_images:
            raise RowError(f"the prompt has {text.count(IMAGE_MARKER)} {IMAGE_MARKER} markers but the row has "
                           f"{n_images} images")
        return text.replace(IMAGE_MARKER, tokens.vision_start + tokens.image_pad + tokens.vision_end)
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("tokenizer has no chat_template; set DatasetConfig.apply_chat_template=False for raw prompts")
    messages = ([{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else [])
    messages.append({"role": "user", "content": user_content(text, n_images)})
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def _expand(rendered: str, counts: Sequence[int], pad: str) -> str:
    """Each ``pad`` of the rendered text repeated its image's token count (HF's ``replace_image_token``)."""
    pieces = rendered.split(pad)
    if len(pieces) - 1 != len(counts):
        raise ValueError(f"the chat template rendered {len(pieces) - 1} {pad} placeholders for {len(counts)} images; "
                         "use a Qwen2.5-VL chat template (image content parts)")
    return pieces[0] + "".join(pad * n + piece for n, piece in zip(counts, pieces[1:]))


def read_vl_prompt_records(cfg: DatasetConfig, tokenizer, image_processor: ImageProcessorConfig | None = None,
                           tokens: VLTokens = VLTokens()) -> tuple[list[PromptRecord], DataStats]:
    """:func:`datasets.read_prompt_records` for rows with images (module docstring): every row becomes a
    :class:`VLPromptRecord` (rows without images too: ``images=()``)."""
    ip = image_processor or ImageProcessorConfig()
    img_col = cfg.fields.get("images", "images")
    fields = {k: v for k, v in cfg.fields.items() if k != "images"}
    stats = DataStats()
    records: list[PromptRecord] = []
    rows_taken = 0

    def bad(path: str, lineno: int, msg: str) -> None:
        if not cfg.skip_bad_rows:
            raise DataFormatError(path, lineno, msg)
        stats.bad_rows += 1
        if len(stats.bad_row_examples) < 10:
            stats.bad_row_examples.append(f"{path}: row {lineno}: {msg}")

    for path in cfg.paths:
        base_dir = os.path.dirname(os.path.abspath(path))
        for lineno, row in iter_raw_rows(path):
            if cfg.max_rows is not None and rows_taken >= cfg.max_rows:
                break
            stats.rows_read += 1
            try:
                if isinstance(row, RowError):
                    raise row
                if not isinstance(row, Mapping):
                    raise RowError(f"row must be a JSON object, got {type(row).__name__}")
                items = _image_list(row.get(img_col))
                parsed = parse_row({k: v for k, v in row.items() if k != img_col}, cfg.format, fields)
                text = parsed.prompt + cfg.prompt_suffix
                if cfg.apply_chat_template:
                    user_content(text, len(items))  # marker count check
            except RowError as e:
                bad(path, lineno, f"[{cfg.format}] {e}")
                continue
            rows_taken += 1
            blobs, grids, err = [], [], None
            for k, item in enumerate(items, start=1):
                what = ""
                try:
                    data, what = _image_bytes(item, base_dir)
                    image = decode_image(data, ip.max_image_pixels)
                    grid = ip.grid(image.height, image.width)
                except ImageError as e:
                    desc = f" ({what})" if what.startswith(("'", '"')) else ""  # a path: name it
                    err = f"image {k}{desc}: {e}"
                    break
                n_tok = ip.num_tokens(grid)
                if cfg.max_prompt_len is not None and n_tok > cfg.max_prompt_len:
                    err = (f"image {k}: too large: {image.width}x{image.height} makes {n_tok} image tokens > "
                           f"max_prompt_len={cfg.max_prompt_len}")
                    break
                blobs.append(data)
                grids.append(grid)
            if err is None and cfg.max_prompt_len is not None:
                total = sum(ip.num_tokens(g) for g in grids)
                if total > cfg.max_prompt_len:
                    err = f"the images make {total} image tokens > max_prompt_len={cfg.max_prompt_len}"
            if err is not None:
                bad(path, lineno, err)
                continue
            rendered = _render(text, len(blobs), tokenizer, cfg, tokens)
            expanded = _expand(rendered, [ip.num_tokens(g) for g in grids], tokens.image_pad)
            ids = list(tokenizer(expanded, add_special_tokens=not cfg.apply_chat_template)["input_ids"])
            stats.max_prompt_tokens = max(stats.max_prompt_tokens, len(ids))
            if cfg.max_prompt_len is not None and len(ids) > cfg.max_prompt_len:
                stats.too_long += 1
                continue
            meta = dict(parsed.metadata, raw_prompt=text, source=f"{path}:{lineno}")
            row_id = parsed.id if parsed.id is not None else f"{os.path.basename(path)}:{lineno}"
            records.append(VLPromptRecord(
                id=row_id, prompt=expanded, prompt_ids=ids, answer=parsed.answer, metadata=meta, images=tuple(blobs),
                image_grid_thw=np.asarray(grids, np.int64).reshape(-1, 3), image_processor=ip))
    stats.kept = len(records)
    log_load_stats(cfg, stats)
    return records, stats


def load_vl_prompt_dataset(cfg: DatasetConfig, tokenizer, image_processor: ImageProcessorConfig | None = None,
                           tokens: VLTokens = VLTokens()) -> PromptDataset:
    """:func:`read_vl_prompt_records` into a :class:`PromptDataset` (grain MapDataset; the iterators as for text)."""
    records, stats = read_vl_prompt_records(cfg, tokenizer, image_processor, tokens)
    return PromptDataset(records, stats)
