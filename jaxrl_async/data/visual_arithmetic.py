"""The arithmetic task shown as an image: a synthetic vision-language task made locally (no downloads).

Each problem of :mod:`arithmetic` (same distribution, same disjoint train / held-out split by a hash of the
expression, same gold completions and ``\\boxed{}`` answers) is rendered into a small PNG: the expression
``37+58`` drawn with a built-in 3 x 5 pixel font (:data:`GLYPHS`, scaled ``scale`` times, white on black with a
per-problem offset, so the pixels do not depend on the installed fonts or the Pillow version), and the text of the
prompt only asks about the picture (``<image>What is the value shown?``). The model has
to read the digits from the image to answer: nothing of the expression is in the text. Rows are the ``generic``
format with an ``images`` column of paths relative to the data file (data/images.py), so the run reads them with
the usual VL data path.

Image size: ``width x height`` pixels (defaults 48 x 16: with 4-pixel patches and 2 x 2 merging, 48 x 16 is a
12 x 4 grid of patches = 12 image tokens; the processor keeps it as is when it is a multiple of 8 within the
processor's pixel bounds).
"""
from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
from collections.abc import Sequence

import numpy as np

from jaxrl_async.data.arithmetic import ArithmeticConfig, ArithmeticProblem, build_splits

__all__ = ["GLYPHS", "VisualArithmeticConfig", "render_expression", "write_visual_arithmetic_dataset"]

# 3 x 5 glyphs, rows top to bottom, "#" = ink
GLYPHS: dict[str, tuple[str, ...]] = {
    "0": ("###", "#.#", "#.#", "#.#", "###"),
    "1": (".#.", "##.", ".#.", ".#.", "###"),
    "2": ("###", "..#", "###", "#..", "###"),
    "3": ("###", "..#", ".##", "..#", "###"),
    "4": ("#.#", "#.#", "###", "..#", "..#"),
    "5": ("###", "#..", "###", "..#", "###"),
    "6": ("###", "#..", "###", "#.#", "###"),
    "7": ("###", "..#", ".#.", ".#.", ".#."),
    "8": ("###", "#.#", "###", "#.#", "###"),
    "9": ("###", "#.#", "###", "..#", "###"),
    "+": ("...", ".#.", "###", ".#.", "..."),
    "-": ("...", "...", "###", "...", "..."),
    "*": ("#.#", ".#.", "###", ".#.", "#.#"),
    " ": ("...", "...", "...", "...", "..."),
}
PROMPT = "<image>What is the value shown?"


@dataclasses.dataclass(frozen=True)
class VisualArithmeticConfig:
    """Image settings of the visual task (the problems are ``arithmetic``'s).

    Attributes:
      width / height: image size in pixels.
      scale: glyph pixels per font pixel (a glyph is 3*scale x 5*scale, 1*scale apart).
      jitter: the expression's top-left corner moves by up to this many pixels (per problem, by a hash).
      prompt: the text of the prompt (``<image>`` marks the image).
    """

    width: int = 48
    height: int = 16
    scale: int = 2
    jitter: int = 2
    prompt: str = PROMPT

    def __post_init__(self):
        if min(self.width, self.height, self.scale) < 1 or self.jitter < 0:
            raise ValueError("VisualArithmeticConfig: width, height, scale must be >= 1 and jitter >= 0")
        if self.prompt.count("<image>") != 1:
            raise ValueError("VisualArithmeticConfig.prompt needs exactly one <image> marker")


def render_expression(text: str, cfg: VisualArithmeticConfig = VisualArithmeticConfig(), offset: tuple[int, int] = (0, 0)
                      ) -> np.ndarray:
    """[height, width, 3] uint8: ``text`` in the built-in font, white on black, top-left at ``offset`` (x, y) past
    the centred position. Raises ValueError when a character has no glyph or the text does not fit."""
    s = cfg.scale
    gw, gh, gap = 3 * s, 5 * s, s
    w = len(text) * (gw + gap) - gap
    if w > cfg.width or gh > cfg.height:
        raise ValueError(f"{text!r} needs {w}x{gh} pixels, the image is {cfg.width}x{cfg.height}")
    x0 = min(max((cfg.width - w) // 2 + offset[0], 0), cfg.width - w)
    y0 = min(max((cfg.height - gh) // 2 + offset[1], 0), cfg.height - gh)
    img = np.zeros((cfg.height, cfg.width, 3), np.uint8)
    for i, ch in enumerate(text):
        rows = GLYPHS.get(ch)
        if rows is None:
            raise ValueError(f"no glyph for {ch!r} (have {''.join(sorted(GLYPHS))})")
        ink = np.repeat(np.repeat(np.array([[c == "#" for c in r] for r in rows]), s, 0), s, 1)
        x = x0 + i * (gw + gap)
        img[y0:y0 + gh, x:x + gw][ink] = 255
    return img


def _offset(expression: str, jitter: int) -> tuple[int, int]:
    if jitter == 0:
        return 0, 0
    h = hashlib.sha256(("offset:" + expression).encode()).digest()
    return h[0] % (2 * jitter + 1) - jitter, h[1] % (2 * jitter + 1) - jitter


def _png(img: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="PNG")
    return buf.getvalue()


def _rows(problems: Sequence[ArithmeticProblem], out_dir: str, split: str, cfg: VisualArithmeticConfig) -> str:
    img_dir = os.path.join(out_dir, "images", split)
    os.makedirs(img_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{split}.jsonl")
    with open(path, "w", encoding="utf-8") as f:
        for i, p in enumerate(problems):
            name = f"{i:06d}.png"
            with open(os.path.join(img_dir, name), "wb") as g:
                g.write(_png(render_expression(p.expression, cfg, _offset(p.expression, cfg.jitter))))
            row = p.to_json()
            row.update(prompt=cfg.prompt, images=[f"images/{split}/{name}"], expression=p.expression)
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path


def write_visual_arithmetic_dataset(out_dir: str | os.PathLike, problems: ArithmeticConfig | None = None,
                                    cfg: VisualArithmeticConfig | None = None) -> dict[str, str]:
    """Writes ``train.jsonl`` / ``eval.jsonl`` (generic rows with ``images``) and ``images/{train,eval}/*.png``
    under out_dir; returns {"train": path, "eval": path}. Deterministic for fixed configs."""
    problems = problems if problems is not None else ArithmeticConfig()
    cfg = cfg if cfg is not None else VisualArithmeticConfig()
    train, held = build_splits(problems)
    out_dir = os.fspath(out_dir)
    return {"train": _rows(train, out_dir, "train", cfg), "eval": _rows(held, out_dir, "eval", cfg)}
