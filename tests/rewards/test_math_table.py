"""A table of (model output, gold answer, mathematically right reward) run through the project's MathReward.

Expected values are what a careful grader would decide, never what the implementation happens to
return; the cases MathReward gets wrong are listed separately in KNOWN_WRONG as strict xfails (the
test starts failing, i.e. passing, when one is fixed). Each verdict must come from a real comparison
(fast path, math-verify pool or no extractable answer), never from a pool failure or timeout.
"""
import pytest

from jaxrl_async.rewards.math_reward import MathReward

TABLE = [
    # fractions
    ("The answer is \\boxed{\\frac{1}{2}}.", "1/2", 1.0),
    ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("\\boxed{\\dfrac{3}{4}}", "0.75", 1.0),
    ("\\boxed{2/4}", "\\frac12", 1.0),
    ("\\boxed{\\frac{7}{2}}", "3\\frac{1}{2}", 1.0),  # mixed number in the gold answer
    ("\\boxed{0.33}", "\\frac{1}{3}", 0.0),
    ("\\boxed{\\frac{2}{3}}", "\\frac{3}{2}", 0.0),
    # decimals and thousands separators
    ("\\boxed{3.50}", "3.5", 1.0),
    ("\\boxed{1,234.5}", "1234.5", 1.0),
    ("\\boxed{.5}", "0.5", 1.0),
    ("\\boxed{1{,}000}", "1000", 1.0),
    ("\\boxed{3.1}", "3.01", 0.0),
    # LaTeX roots
    ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", 1.0),
    ("\\boxed{\\frac{1}{\\sqrt{2}}}", "\\frac{\\sqrt{2}}{2}", 1.0),
    ("\\boxed{\\dfrac{\\sqrt{6}}{2}}", "\\sqrt{\\frac{3}{2}}", 1.0),
    ("\\boxed{\\sqrt2}", "\\sqrt{2}", 1.0),
    ("\\boxed{\\sqrt{12}}", "3\\sqrt{2}", 0.0),  # sqrt(12) = 2 sqrt(3)
    # units
    ("\\boxed{5 \\text{ cm}}", "5", 1.0),
    ("\\boxed{5 cm}", "5", 1.0),
    ("\\boxed{12 \\mbox{ inches}}", "12", 1.0),
    ("\\boxed{90^\\circ}", "90", 1.0),
    ("\\boxed{\\$18.00}", "18", 1.0),
    ("\\boxed{5 \\text{ cm}}", "6", 0.0),
    # percentages
    ("\\boxed{50\\%}", "50", 1.0),
    ("\\boxed{10\\%}", "0.1", 1.0),
    ("\\boxed{12.5\\%}", "\\frac{1}{8}", 1.0),
    ("\\boxed{25\\%}", "50\\%", 0.0),
    # intervals
    ("\\boxed{[1, 2)}", "[1,2)", 1.0),
    ("\\boxed{(-\\infty, -2) \\cup (3, \\infty)}", "(3,\\infty)\\cup(-\\infty,-2)", 1.0),
    ("\\boxed{[2,\\infty)}", "x \\geq 2", 1.0),
    ("\\boxed{(1, 2)}", "[1,2]", 0.0),
    ("\\boxed{(-\\infty, 3)}", "(-\\infty,3]", 0.0),
    # sets
    ("\\boxed{\\{1, 2, 3\\}}", "\\{3, 2, 1\\}", 1.0),
    ("\\boxed{2, 1}", "\\{1,2\\}", 1.0),
    ("\\boxed{\\{1,2\\}}", "\\{1,2,3\\}", 0.0),
    ("\\boxed{\\{1, 2, 3\\}}", "\\{1, 2, 4\\}", 0.0),
    # negative numbers
    ("\\boxed{-7}", "-7", 1.0),
    ("\\boxed{- 7}", "-7", 1.0),
    ("\\boxed{\u22127}", "-7", 1.0),  # Unicode minus sign
    ("\\boxed{-\\frac{1}{2}}", "-0.5", 1.0),
    ("#### -12", "-12", 1.0),
    ("\\boxed{-7}", "7", 0.0),
    ("\\boxed{-1.5}", "\\frac{3}{2}", 0.0),
    # scientific notation
    ("\\boxed{1.5 \\times 10^{3}}", "1500", 1.0),
    ("\\boxed{2.5 \\times 10^{-3}}", "0.0025", 1.0),
    ("\\boxed{1.5E3}", "1500", 1.0),
    ("\\boxed{1000000}", "10^6", 1.0),
    ("\\boxed{2\\times10^3}", "20000", 0.0),
    # equivalent expressions
    ("\\boxed{2x + 2}", "2(x+1)", 1.0),
    ("\\boxed{x^2 + 2x + 1}", "(x+1)^2", 1.0),
    ("\\boxed{\\frac{x+1}{2}}", "\\frac{x}{2}+\\frac{1}{2}", 1.0),
    ("\\boxed{2\\pi}", "\\pi \\cdot 2", 1.0),
    ("\\boxed{\\log_2 8}", "3", 1.0),
    ("\\boxed{\\binom{5}{2}}", "10", 1.0),
    ("\\boxed{y = 2x + 1}", "2x+1", 1.0),
    ("\\boxed{x^2+1}", "(x+1)^2", 0.0),
    ("\\boxed{3.14}", "\\pi", 0.0),
    # extraction, multiple choice and clearly wrong answers
    ("\\boxed{12}", "3 * 4 = <<3*4=12>>12\n#### 12", 1.0),  # GSM8K solution as gold
    ("So the final answer is 42.", "42", 1.0),  # no box: last number
    ("\\boxed{6} wait, no: \\boxed{5}", "5", 1.0),  # the last box counts
    ("\\boxed{5} hmm, actually \\boxed{6}", "5", 0.0),
    ("\\boxed{\\text{(A)}}", "A", 1.0),
    ("\\boxed{\\text{(B)}}", "A", 0.0),
    ("I don't know.", "5", 0.0),
    ("\\boxed{}", "5", 0.0),
    ("\\boxed{five}", "5", 0.0),
    ("\\boxed{42}", "24", 0.0),
]

# MathReward's verdict differs from the right one (reported to the lead; see the reasons).
KNOWN_WRONG = [
    ("\\boxed{1.5e3}", "1500", 1.0, "lower-case e-notation is parsed as 1.5 * e * 3 (Euler's number)"),
    ("\\boxed{100}", "1e2", 1.0, "same e-notation problem on the gold side"),
    ("\\boxed{10\\,000}", "10000", 1.0, "LaTeX thin-space thousands separator '\\,' is not understood"),
    ("\\boxed{x \\geq 2}", "[2, \\infty)", 1.0,
     "an inequality prediction is not matched to an interval gold (the reverse direction is accepted)"),
    ("\\boxed{-3 < x < 5}", "(-3, 5)", 1.0, "chained inequality vs interval"),
    ("\\boxed{\\varnothing}", "\\emptyset", 1.0, "\\varnothing is not recognised as the empty set"),
    ("\\boxed{0.0000001}", "0.0000002", 0.0,
     "numbers are compared after absolute rounding to float_rounding=6 decimals, so distinct small numbers match"),
    ("\\boxed{1.0000004}", "1", 0.0,
     "the in-process fast path rounds to 6 decimals and accepts; math-verify itself rejects this pair"),
]


@pytest.fixture(scope="module")
def reward():
    r = MathReward()
    yield r
    r.close()


def test_table_is_large_and_balanced():
    assert len(TABLE) >= 40
    assert sum(e == 0.0 for *_, e in TABLE) >= 15 and sum(e == 1.0 for *_, e in TABLE) >= 25
    assert len({(p, g) for p, g, _ in TABLE}) == len(TABLE)


@pytest.mark.parametrize("prediction, gold, expected", TABLE)
def test_math_reward_table(reward, prediction, gold, expected):
    score = reward.score(prediction, gold)
    assert score.path in ("fast", "pool", "no_answer"), score  # a real verdict, not a pool failure
    assert score.reward == expected, score
    assert reward("prompt", prediction, gold) == expected  # the RL-loop entry point agrees


@pytest.mark.parametrize("prediction, gold, expected", [
    pytest.param(p, g, e, marks=pytest.mark.xfail(strict=True, reason=why)) for p, g, e, why in KNOWN_WRONG])
def test_math_reward_known_wrong(reward, prediction, gold, expected):
    score = reward.score(prediction, gold)
    assert score.path in ("fast", "pool", "no_answer"), score
    assert score.reward == expected, score
