"""The arithmetic task shown as an image: a synthetic vision-language task made locally (no downloads).

Each problem of :mod:`arithmetic` (same distribution, same disjoint train / held-out split by a hash of the
expression, same gold completions and ``\\boxed{}`` answers) is rendered into a small PNG: the expression
``37+58`` drawn with a built-in 3 x 5 pixel font (:data:`GLYPHS`, white on black, one character per square cell,
so the pixels do not depend on the installed fonts or the Pillow version), and the text of the prompt only asks
about the picture (``<image>What is the value shown?``). The model has
to read the digits from the image to answer: nothing of the expression is in the text. Rows are the ``generic``
format with an ``images`` column of paths relative to the data file (data/images.py), so the run reads them with
the usual VL data path.

Image size: one row of ``max_chars`` cells of ``cell`` pixels (defaults: 8-pixel cells, as many as the longest
expression: 5 x 8 = 40 x 8 pixels for two 2-digit operands; with 4-pixel patches and 2 x 2 merging that is one image
token per character, within the processor's default bounds so it is not resized).
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
      cell: pixels per character cell (square); the image is one row of ``max_chars`` cells, ``cell`` pixels high.
        The default 8 is one merge unit of the tiny tower (4-pixel patches, 2 x 2 merging): one image token per
        character.
      scale: font pixels per glyph pixel (a glyph is 3*scale x 5*scale, centred in its cell).
      max_chars: cells per image (None: the longest expression the problem settings can make).
      jitter: the expression starts up to this many cells right of the left edge (per problem, by a hash of the
        expression), so reading does not depend on a fixed place.
      prompt: the text of the prompt (``<image>`` marks the image).
    """

    cell: int = 8
    scale: int = 1
    max_chars: int | None = None
    jitter: int = 0
    prompt: str = PROMPT

    def __post_init__(self):
        if min(self.cell, self.scale) < 1 or self.jitter < 0 or (self.max_chars is not None and self.max_chars < 1):
            raise ValueError("VisualArithmeticConfig: cell, scale and max_chars must be >= 1 and jitter >= 0")
        if 3 * self.scale > self.cell or 5 * self.scale > self.cell:
            raise ValueError(f"VisualArithmeticConfig: a {3 * self.scale}x{5 * self.scale} glyph does not fit a "
                             f"{self.cell}-pixel cell")
        if self.prompt.count("<image>") != 1:
            raise ValueError("VisualArithmeticConfig.prompt needs exactly one <image> marker")


def max_expression_chars(problems: ArithmeticConfig) -> int:
    """The longest expression ``problems`` can make (digits and operators)."""
    return problems.max_operands * (problems.max_digits + 1) - 1


def render_expression(text: str, cfg: VisualArithmeticConfig = VisualArithmeticConfig(), max_chars: int | None = None,
                      start: int = 0) -> np.ndarray:
    """[cell, cell * max_chars, 3] uint8: ``text`` in the built-in font, white on black, one character per cell from
    cell ``start``. Raises ValueError when a character has no glyph or the text does not fit."""
    n = max_chars or cfg.max_chars or len(text)
    if start + len(text) > n:
        raise ValueError(f"{text!r} from cell {start} needs {start + len(text)} cells, the image has {n}")
    c, s = cfg.cell, cfg.scale
    img = np.zeros((c, c * n, 3), np.uint8)
    y0, dx = (c - 5 * s) // 2, (c - 3 * s) // 2
    for i, ch in enumerate(text):
        rows = GLYPHS.get(ch)
        if rows is None:
            raise ValueError(f"no glyph for {ch!r} (have {''.join(sorted(GLYPHS))})")
        ink = np.repeat(np.repeat(np.array([[q == "#" for q in r] for r in rows]), s, 0), s, 1)
        x = (start + i) * c + dx
        img[y0:y0 + 5 * s, x:x + 3 * s][ink] = 255
    return img


def _start(expression: str, jitter: int, room: int) -> int:
    if jitter == 0 or room <= 0:
        return 0
    h = hashlib.sha256(("offset:" + expression).encode()).digest()
    return h[0] % (min(jitter, room) + 1)


def _png(img: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="PNG")
    return buf.getvalue()


def _rows(problems: Sequence[ArithmeticProblem], out_dir: str, split: str, cfg: VisualArithmeticConfig,
          max_chars: int) -> str:
    img_dir = os.path.join(out_dir, "images", split)
    os.makedirs(img_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{split}.jsonl")
    with open(path, "w", encoding="utf-8") as f:
        for i, p in enumerate(problems):
            name = f"{i:06d}.png"
            with open(os.path.join(img_dir, name), "wb") as g:
                start = _start(p.expression, cfg.jitter, max_chars - len(p.expression))
                g.write(_png(render_expression(p.expression, cfg, max_chars, start)))
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
    n = cfg.max_chars or max_expression_chars(problems) + cfg.jitter
    return {"train": _rows(train, out_dir, "train", cfg, n), "eval": _rows(held, out_dir, "eval", cfg, n)}
