"""Synthetic multi-digit arithmetic reasoning task with ``\\boxed{}`` answers.

A problem is an integer expression ``a0 op1 a1 op2 a2 ...`` over ``+ - *`` evaluated with the usual
precedence (``*`` before ``+``/``-``, each level left to right). Its gold completion lists the reduction
steps and ends in ``The answer is \\boxed{v}.``, so the same math reward used on GSM8K scores it.

Split assignment is by problem, never by sampling order: a problem (its canonical expression string e)
is held-out iff ``bucket(e) < held_out_fraction``, where
``bucket(e) = int(sha256(e)[:8 hex]) / 16**8`` is a fixed hash in [0, 1). Train and held-out sets are
therefore disjoint for *any* seeds/configs (the same expression can never land in both), and each split is
filled by rejection sampling from a ``random.Random(seed)`` stream (deterministic by seed).

Completion styles (what the supervised warm start imitates; the reward only reads the boxed answer):

* ``steps`` (default): the reduction steps, ``"37+58 = 95"``, then the boxed answer.
* ``direct``: only ``"The answer is \\boxed{95}."`` (a terse teacher: the answer without work).
* ``columns``: two-operand ``+``/``-`` worked column by column, units first, the carry/borrow written
  into the next column (``"7+8 = 15\n3+5+1 = 9"``; ``"12-7 = 5\n5-1-1 = 3"``; ``a < b`` is rewritten as
  ``-(b-a)``), then the boxed answer: every step is a one-digit fact, which a tiny model learns far
  more reliably than the whole sum at once.

``styles``/``style_weights`` mix teachers: each problem's completion style is drawn from the weights by
a fixed hash of (expression, seed), so a dataset is deterministic and a problem always has one style.
The embedded default warm-starts on a mixture of ``direct`` and ``columns`` demonstrations: the
policy knows both, greedy decoding prefers the more frequent terse style, and RL has to discover that
working the columns pays (the mixture setting of "Echo Chamber: RL post-training amplifies behaviors
learned in pretraining", Zhao et al. 2025).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
from collections.abc import Sequence

OPERATORS = ("+", "-", "*")
STYLES = ("steps", "direct", "columns")
BOXED_ANSWER_FORMAT = "The answer is \\boxed{{{value}}}."


@dataclasses.dataclass(frozen=True)
class ArithmeticConfig:
    """Problem distribution and split sizes.

    Attributes:
      min_digits / max_digits: each operand has a digit count drawn uniformly in [min, max]; the operand is
        uniform among numbers with that many digits (1-digit operands include 0).
      operators: allowed operators (subset of ``+ - *``), drawn uniformly per position.
      min_operands / max_operands: number of operands per problem (difficulty), uniform in [min, max].
      mul_max_digits: cap on the digit count of both operands of a ``*`` (keeps products short); None = no cap.
      num_train / num_eval: split sizes (exact).
      held_out_fraction: share of the problem space reserved for the held-out split (hash bucket).
      seed: sampling seed.
      prompt_template: prompt text, ``{expr}`` is replaced by the expression.
      styles: completion styles of the gold completions (module docstring), mixed by ``style_weights``.
      style_weights: one non-negative weight per style (empty = equal weights).
    """

    min_digits: int = 1
    max_digits: int = 2
    operators: tuple[str, ...] = ("+", "-")
    min_operands: int = 2
    max_operands: int = 2
    mul_max_digits: int | None = 1
    num_train: int = 2000
    num_eval: int = 200
    held_out_fraction: float = 0.2
    seed: int = 0
    prompt_template: str = "What is {expr}?"
    styles: tuple[str, ...] = ("steps",)
    style_weights: tuple[float, ...] = ()

    def __post_init__(self):
        if not 1 <= self.min_digits <= self.max_digits:
            raise ValueError(f"ArithmeticConfig: need 1 <= min_digits <= max_digits, got {self.min_digits}, {self.max_digits}")
        if not 2 <= self.min_operands <= self.max_operands:
            raise ValueError(f"ArithmeticConfig: need 2 <= min_operands <= max_operands, got {self.min_operands}, "
                             f"{self.max_operands}")
        bad = [op for op in self.operators if op not in OPERATORS]
        if not self.operators or bad:
            raise ValueError(f"ArithmeticConfig.operators must be a non-empty subset of {OPERATORS}, got {self.operators}")
        if self.mul_max_digits is not None and self.mul_max_digits < 1:
            raise ValueError(f"ArithmeticConfig.mul_max_digits must be >= 1 or None, got {self.mul_max_digits}")
        if not 0.0 < self.held_out_fraction < 1.0:
            raise ValueError(f"ArithmeticConfig.held_out_fraction must be in (0, 1), got {self.held_out_fraction}")
        if self.num_train < 0 or self.num_eval < 0:
            raise ValueError("ArithmeticConfig.num_train/num_eval must be >= 0")
        if "{expr}" not in self.prompt_template:
            raise ValueError("ArithmeticConfig.prompt_template must contain '{expr}'")
        bad = [s for s in self.styles if s not in STYLES]
        if not self.styles or bad:
            raise ValueError(f"ArithmeticConfig.styles must be a non-empty subset of {STYLES}, got {self.styles}")
        if self.style_weights and (len(self.style_weights) != len(self.styles) or min(self.style_weights) < 0
                                   or sum(self.style_weights) <= 0):
            raise ValueError(f"ArithmeticConfig.style_weights must be empty or one non-negative weight per style "
                             f"(with a positive sum), got {self.style_weights} for styles {self.styles}")
        if "columns" in self.styles and (self.max_operands != 2 or self.max_digits > 2 or "*" in self.operators):
            raise ValueError("ArithmeticConfig.styles: 'columns' is defined for two operands of at most 2 digits "
                             f"with + and -, got operands <= {self.max_operands}, digits <= {self.max_digits}, "
                             f"operators {self.operators}")


@dataclasses.dataclass(frozen=True)
class ArithmeticProblem:
    """One problem. ``answer`` is the gold value as a string; ``completion`` the gold SFT response."""

    id: str
    expression: str
    prompt: str
    answer: str
    completion: str

    def to_json(self) -> dict:
        """Generic-format row (``prompt``, ``answer``) plus ``id`` and ``completion`` (kept as metadata)."""
        return {"id": self.id, "prompt": self.prompt, "answer": self.answer, "completion": self.completion}


# ----------------------------------------------------------------------------------------------------------
# Expression evaluation with step trace (pure functions).
# ----------------------------------------------------------------------------------------------------------
def _fmt(expr_operands: Sequence[int], ops: Sequence[str]) -> str:
    out = str(expr_operands[0])
    for op, v in zip(ops, expr_operands[1:]):
        out += f"{op}{v}"
    return out


def _apply(a: int, op: str, b: int) -> int:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    raise ValueError(f"unknown operator {op!r}")


def evaluate_with_steps(operands: Sequence[int], ops: Sequence[str]) -> tuple[int, list[str]]:
    """Evaluates ``operands[0] ops[0] operands[1] ...`` with ``*`` first, then ``+``/``-`` left to right.

    Returns (value, steps) where each step is ``"a op b = c"`` for one binary reduction, in the order
    they are performed. E.g. (12, 3, 4), ("+", "*") -> (24, ["3*4 = 12", "12+12 = 24"]).
    """
    if len(operands) != len(ops) + 1 or not operands:
        raise ValueError(f"need len(operands) == len(ops) + 1, got {len(operands)} and {len(ops)}")
    vals, pend, steps = [operands[0]], [], []
    for op, b in zip(ops, operands[1:]):  # pass 1: reduce '*' runs
        if op == "*":
            a = vals.pop()
            c = _apply(a, op, b)
            steps.append(f"{a}*{b} = {c}")
            vals.append(c)
        else:
            pend.append(op)
            vals.append(b)
    acc = vals[0]
    for op, b in zip(pend, vals[1:]):  # pass 2: '+'/'-' left to right
        c = _apply(acc, op, b)
        steps.append(f"{acc}{op}{b} = {c}")
        acc = c
    return acc, steps


def column_steps(a: int, op: str, b: int) -> list[str]:
    """Column-by-column work for ``a op b`` with 0 <= a, b <= 99 and op in ``+ -`` (units, then tens).

    Addition: ``"a0+b0 = s0"`` then ``"a1+b1+c = s1"`` with c = s0 // 10 (the carry, always written);
    the answer is s1 followed by the last digit of s0 (s1 omitted when 0). Subtraction with a >= b:
    ``"(a0 + 10 w)-b0 = d0"`` then ``"a1-b1-w = d1"`` with w = [a0 < b0] (the borrow); answer d1 d0.
    a < b: first the line ``"-(b-a)"``, then the work for b - a. E.g. 47+85 -> ["7+5 = 12", "4+8+1 = 13"];
    52-17 -> ["12-7 = 5", "5-1-1 = 3"]; 17-52 -> ["-(52-17)", "12-7 = 5", "5-1-1 = 3"].
    """
    if not (0 <= a <= 99 and 0 <= b <= 99) or op not in "+-":
        raise ValueError(f"column_steps: needs 0 <= a, b <= 99 and op in '+-', got {a}{op}{b}")
    if op == "-" and a < b:
        return [f"-({b}-{a})"] + column_steps(b, "-", a)
    a1, a0, b1, b0 = a // 10, a % 10, b // 10, b % 10
    if op == "+":
        s0 = a0 + b0
        return [f"{a0}+{b0} = {s0}", f"{a1}+{b1}+{s0 // 10} = {a1 + b1 + s0 // 10}"]
    w = int(a0 < b0)
    return [f"{a0 + 10 * w}-{b0} = {a0 + 10 * w - b0}", f"{a1}-{b1}-{w} = {a1 - b1 - w}"]


def gold_completion(operands: Sequence[int], ops: Sequence[str], style: str = "steps") -> tuple[int, str]:
    """(value, completion text) in ``style`` (module docstring), ending with the boxed answer."""
    value, steps = evaluate_with_steps(operands, ops)
    if style == "direct":
        steps = []
    elif style == "columns":
        if len(operands) != 2:
            raise ValueError(f"style 'columns' needs two operands, got {len(operands)}")
        steps = column_steps(operands[0], ops[0], operands[1])
    elif style != "steps":
        raise ValueError(f"unknown completion style {style!r} (one of {STYLES})")
    return value, "\n".join(steps + [BOXED_ANSWER_FORMAT.format(value=value)])


def style_for(expression: str, cfg: "ArithmeticConfig") -> str:
    """The completion style of one problem: drawn from ``cfg.style_weights`` by a fixed hash of
    (seed, expression), independent of sampling order."""
    if len(cfg.styles) == 1:
        return cfg.styles[0]
    w = cfg.style_weights or (1.0,) * len(cfg.styles)
    u = _unit_hash(f"style:{cfg.seed}:{expression}")
    acc, total = 0.0, float(sum(w))
    for style, wi in zip(cfg.styles, w):
        acc += wi / total
        if u < acc:
            return style
    return cfg.styles[-1]


def _unit_hash(text: str) -> float:
    """Fixed hash in [0, 1): first 32 bits of sha256(text) / 2**32."""
    return int(hashlib.sha256(text.encode("utf-8")).hexdigest()[:8], 16) / 16**8


def held_out_bucket(expression: str) -> float:
    """Fixed hash of a problem in [0, 1): first 32 bits of sha256(expression) / 2**32."""
    return _unit_hash(expression)


def is_held_out(expression: str, held_out_fraction: float) -> bool:
    return held_out_bucket(expression) < held_out_fraction


def make_problem(operands: Sequence[int], ops: Sequence[str], prompt_template: str = "What is {expr}?",
                 style: str = "steps") -> ArithmeticProblem:
    expr = _fmt(operands, ops)
    value, completion = gold_completion(operands, ops, style)
    return ArithmeticProblem(
        id=f"arith:{expr}", expression=expr, prompt=prompt_template.format(expr=expr), answer=str(value), completion=completion
    )


def _sample_operand(rng: random.Random, lo_digits: int, hi_digits: int) -> int:
    d = rng.randint(lo_digits, hi_digits)
    return rng.randint(0 if d == 1 else 10 ** (d - 1), 10**d - 1)


def _sample(rng: random.Random, cfg: ArithmeticConfig) -> tuple[list[int], list[str]]:
    n = rng.randint(cfg.min_operands, cfg.max_operands)
    ops = [rng.choice(cfg.operators) for _ in range(n - 1)]
    operands = []
    for i in range(n):
        touches_mul = (i > 0 and ops[i - 1] == "*") or (i < n - 1 and ops[i] == "*")
        hi = cfg.max_digits
        if touches_mul and cfg.mul_max_digits is not None:
            hi = min(hi, cfg.mul_max_digits)
        operands.append(_sample_operand(rng, min(cfg.min_digits, hi), hi))
    return operands, ops


def build_splits(cfg: ArithmeticConfig) -> tuple[list[ArithmeticProblem], list[ArithmeticProblem]]:
    """(train, held_out) problem lists, deterministic in ``cfg``; disjoint by expression (hash buckets).

    Raises ValueError when the problem space is too small to fill the requested sizes (the rejection
    sampler gives up after ``50 * (num_train + num_eval) + 10_000`` draws).
    """
    rng = random.Random(cfg.seed)
    train: list[ArithmeticProblem] = []
    held: list[ArithmeticProblem] = []
    seen: set[str] = set()
    budget = 50 * (cfg.num_train + cfg.num_eval) + 10_000
    draws = 0
    while len(train) < cfg.num_train or len(held) < cfg.num_eval:
        if draws >= budget:
            raise ValueError(
                f"arithmetic problem space too small: got {len(train)}/{cfg.num_train} train and "
                f"{len(held)}/{cfg.num_eval} held-out problems after {draws} draws; widen digits/operators/operands "
                "or lower num_train/num_eval"
            )
        draws += 1
        operands, ops = _sample(rng, cfg)
        expr = _fmt(operands, ops)
        if expr in seen:
            continue
        target = held if is_held_out(expr, cfg.held_out_fraction) else train
        limit = cfg.num_eval if target is held else cfg.num_train
        if len(target) >= limit:
            continue
        seen.add(expr)
        target.append(make_problem(operands, ops, cfg.prompt_template, style_for(expr, cfg)))
    return train, held


def sft_example(problem: ArithmeticProblem, tokenizer=None, *, apply_chat_template: bool = True) -> tuple[str, str]:
    """(prompt_text, completion_text) for supervised warm-start; loss goes on the completion only.

    With a tokenizer and ``apply_chat_template`` the prompt is rendered by the tokenizer's own chat template
    with the generation prompt, and the completion is terminated by ``tokenizer.eos_token`` so the model
    learns to stop. Without a tokenizer the raw prompt and completion are returned.
    """
    if tokenizer is None:
        return problem.prompt, problem.completion
    if apply_chat_template:
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": problem.prompt}], tokenize=False, add_generation_prompt=True
        )
    else:
        prompt = problem.prompt
    return prompt, problem.completion + (tokenizer.eos_token or "")


def write_jsonl(problems: Sequence[ArithmeticProblem], path: str | os.PathLike) -> str:
    """Writes generic-format rows (``id``, ``prompt``, ``answer``, ``completion``); returns the path."""
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for p in problems:
            f.write(json.dumps(p.to_json(), ensure_ascii=False) + "\n")
    return path


def write_arithmetic_dataset(out_dir: str | os.PathLike, cfg: ArithmeticConfig = ArithmeticConfig()) -> dict[str, str]:
    """Writes ``train.jsonl`` and ``eval.jsonl`` under out_dir; returns {"train": path, "eval": path}."""
    train, held = build_splits(cfg)
    out_dir = os.fspath(out_dir)
    return {"train": write_jsonl(train, os.path.join(out_dir, "train.jsonl")),
            "eval": write_jsonl(held, os.path.join(out_dir, "eval.jsonl"))}


def tokenizer_corpus(num_problems: int = 600, seed: int = 1234) -> list[str]:
    """Deterministic text corpus for training the "arithmetic" tokenizer: prompts + gold completions of
    problems over all operators with 1-3 operands, plus the chat-role words."""
    cfg = ArithmeticConfig(min_digits=1, max_digits=3, operators=OPERATORS, min_operands=2, max_operands=3,
                           mul_max_digits=2, num_train=num_problems, num_eval=0, held_out_fraction=0.5, seed=seed)
    train, _ = build_splits(cfg)
    texts = [f"user\n{p.prompt}\nassistant\n{p.completion}\n" for p in train]
    texts += ["system\nYou are a helpful assistant.\n"] * 4
    texts += ["Please put your final answer within \\boxed{}.\n(1+2)*3 = 9\n"] * 4
    return texts
