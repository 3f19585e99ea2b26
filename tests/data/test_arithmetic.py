import dataclasses
import json

import pytest

from jaxrl_async.data import (
    ArithmeticConfig, DatasetConfig, build_splits, load_prompt_dataset, sft_example, write_arithmetic_dataset,
)
from jaxrl_async.data.arithmetic import evaluate_with_steps, held_out_bucket, make_problem
from jaxrl_async.data.formats import last_boxed_content

HARD = ArithmeticConfig(min_digits=1, max_digits=3, operators=("+", "-", "*"), min_operands=2, max_operands=3,
                        mul_max_digits=2, num_train=400, num_eval=100, seed=7)


@pytest.mark.parametrize("operands,ops,value,steps", [
    ((37, 58), ("+",), 95, ["37+58 = 95"]),
    ((12, 3, 4), ("+", "*"), 24, ["3*4 = 12", "12+12 = 24"]),
    ((5, 9, 3), ("-", "+"), -1, ["5-9 = -4", "-4+3 = -1"]),
    ((2, 3, 4), ("*", "*"), 24, ["2*3 = 6", "6*4 = 24"]),
    ((20, 3, 4, 5), ("-", "*", "+"), 13, ["3*4 = 12", "20-12 = 8", "8+5 = 13"]),
])
def test_evaluate_with_steps(operands, ops, value, steps):
    assert evaluate_with_steps(operands, ops) == (value, steps)


def test_make_problem_text():
    p = make_problem((37, 58), ("+",))
    assert (p.id, p.prompt, p.answer) == ("arith:37+58", "What is 37+58?", "95")
    assert p.completion == "37+58 = 95\nThe answer is \\boxed{95}."


def test_answers_and_completions_correct():
    train, held = build_splits(HARD)
    for p in train + held:
        assert int(p.answer) == eval(p.expression)  # independent check of precedence handling
        assert last_boxed_content(p.completion) == p.answer
        assert p.prompt == f"What is {p.expression}?"
        operands = [int(x) for x in p.expression.replace("*", " ").replace("+", " ").replace("-", " ").split()]
        assert 2 <= len(operands) <= 3 and all(0 <= x <= 999 for x in operands)


def test_gold_completion_scored_by_math_verify():
    from math_verify import parse, verify

    train, _ = build_splits(dataclasses.replace(HARD, num_train=5, num_eval=0))
    for p in train:
        assert verify(parse(p.answer), parse(p.completion))
        wrong = p.completion.replace(f"\\boxed{{{p.answer}}}", f"\\boxed{{{int(p.answer) + 1}}}")
        assert not verify(parse(p.answer), parse(wrong))


def test_splits_disjoint_exact_deterministic():
    train, held = build_splits(HARD)
    assert (len(train), len(held)) == (400, 100)
    tr, he = {p.expression for p in train}, {p.expression for p in held}
    assert len(tr) == 400 and len(he) == 100 and not tr & he
    assert all(held_out_bucket(e) < HARD.held_out_fraction for e in he)
    assert all(held_out_bucket(e) >= HARD.held_out_fraction for e in tr)
    assert build_splits(HARD) == (train, held)
    train2, held2 = build_splits(dataclasses.replace(HARD, seed=8))
    assert [p.expression for p in train2] != [p.expression for p in train]
    # Split membership is by problem: no seed's train set meets another seed's held-out set.
    assert not tr & {p.expression for p in held2} and not he & {p.expression for p in train2}


def test_config_respected():
    cfg = ArithmeticConfig(min_digits=2, max_digits=2, operators=("*",), mul_max_digits=None, num_train=50, num_eval=10)
    train, held = build_splits(cfg)
    for p in train + held:
        a, b = p.expression.split("*")
        assert 10 <= int(a) <= 99 and 10 <= int(b) <= 99


def test_space_too_small_raises():
    cfg = ArithmeticConfig(min_digits=1, max_digits=1, operators=("+",), num_train=200, num_eval=10)
    with pytest.raises(ValueError, match="too small"):
        build_splits(cfg)  # only 100 distinct 1-digit sums exist


def test_written_jsonl_flows_through_generic_reader(tmp_path, arith_tok):
    cfg = dataclasses.replace(HARD, num_train=30, num_eval=10)
    paths = write_arithmetic_dataset(tmp_path, cfg)
    train, held = build_splits(cfg)
    with open(paths["train"]) as f:
        rows = [json.loads(line) for line in f]
    assert rows == [p.to_json() for p in train]
    ds = load_prompt_dataset(DatasetConfig(paths["eval"], format="generic"), arith_tok)
    assert [r.answer for r in ds.records] == [p.answer for p in held]
    assert [r.id for r in ds.records] == [p.id for p in held]
    assert ds[0].metadata["completion"] == held[0].completion


def test_sft_example(arith_tok):
    p = make_problem((37, 58), ("+",))
    prompt, completion = sft_example(p, arith_tok)
    assert prompt == "<|im_start|>user\nWhat is 37+58?<|im_end|>\n<|im_start|>assistant\n"
    assert completion == p.completion + "<|im_end|>"
    assert sft_example(p) == (p.prompt, p.completion)


@pytest.mark.parametrize("a,op,b,lines", [
    (47, "+", 85, ["7+5 = 12", "4+8+1 = 13"]),
    (52, "-", 17, ["12-7 = 5", "5-1-1 = 3"]),
    (17, "-", 52, ["-(52-17)", "12-7 = 5", "5-1-1 = 3"]),
    (50, "-", 8, ["10-8 = 2", "5-0-1 = 4"]),
    (3, "+", 4, ["3+4 = 7", "0+0+0 = 0"]),
    (99, "+", 99, ["9+9 = 18", "9+9+1 = 19"]),
])
def test_column_steps(a, op, b, lines):
    from jaxrl_async.data.arithmetic import column_steps

    assert column_steps(a, op, b) == lines


def test_columns_style_exhaustive_and_scored():
    """Every 2-operand +/- problem with operands 0..99: the column work is internally consistent
    (each line's arithmetic holds) and the boxed answer is the true value."""
    from jaxrl_async.data.arithmetic import gold_completion

    for a in range(100):
        for b in range(100):
            for op in "+-":
                value, text = gold_completion((a, b), (op,), "columns")
                assert value == (a + b if op == "+" else a - b)
                assert last_boxed_content(text) == str(value)
                for line in text.split("\n")[:-1]:
                    if line.startswith("-("):
                        continue
                    lhs, rhs = line.split(" = ")
                    assert eval(lhs) == int(rhs), (a, op, b, line)
    assert gold_completion((4, 5), ("+",), "direct")[1] == "The answer is \\boxed{9}."


def test_style_mixture_deterministic_by_problem():
    cfg = ArithmeticConfig(num_train=2000, num_eval=100, styles=("direct", "columns"), style_weights=(0.5, 0.5))
    train, held = build_splits(cfg)
    direct = [p.completion.startswith("The answer") for p in train]
    assert 0.45 < sum(direct) / len(direct) < 0.55
    # the style is a function of the problem, not of the sampling order
    small, _ = build_splits(dataclasses.replace(cfg, num_train=300, num_eval=0))
    by_expr = {p.expression: p.completion for p in train}
    assert all(by_expr[p.expression] == p.completion for p in small if p.expression in by_expr)
    only = build_splits(dataclasses.replace(cfg, style_weights=(0.0, 1.0)))[0]
    assert not any(p.completion.startswith("The answer") for p in only)


@pytest.mark.parametrize("kw,match", [
    (dict(styles=("cot",)), "styles"),
    (dict(styles=("direct", "columns"), style_weights=(1.0,)), "style_weights"),
    (dict(styles=("direct", "columns"), style_weights=(-1.0, 2.0)), "style_weights"),
    (dict(styles=("columns",), max_digits=3), "columns"),
    (dict(styles=("columns",), operators=("+", "*")), "columns"),
])
def test_style_config_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        ArithmeticConfig(**kw)
