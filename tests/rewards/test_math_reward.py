"""Math reward: extraction, numeric fast path, math-verify pool path, format gate, timeouts, threads."""
import threading
from decimal import Decimal

import pytest

import reward_pool_targets as targets
from jaxrl_async.rewards.math_reward import (
    MathReward,
    MathRewardConfig,
    count_boxed,
    extract_answer,
    extract_gsm8k,
    extract_last_boxed,
    extract_last_number,
    numbers_equal,
    parse_plain_number,
)
from jaxrl_async.rewards.pool import PoolConfig


@pytest.mark.parametrize("text, expected", [
    (r"first \boxed{1} then \boxed{\frac{1}{2}}", r"\frac{1}{2}"),
    (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),  # escaped braces are not grouping braces
    (r"\boxed{ x^{2} + \sqrt{y_{1}} }", r"x^{2} + \sqrt{y_{1}}"),
    (r"\boxed{3} and a broken \boxed{4", "3"),  # unbalanced trailing box ignored
    (r"\fbox{7}", "7"),
    ("no box here", None),
])
def test_extract_last_boxed(text, expected):
    assert extract_last_boxed(text) == expected


def test_other_extractors_and_order():
    assert count_boxed(r"\boxed{1} \boxed{2}") == 2 and count_boxed(r"\boxed{1") == 0
    assert extract_gsm8k("step 1 #### 5\n more #### 1,234") == "1,234"
    assert extract_gsm8k("#### -5.5") == "-5.5"
    assert extract_gsm8k("no marker 12") is None
    assert extract_last_number("The answer is 42.") == "42"
    assert extract_last_number("costs 1,000 dollars, or 3.5 each.") == "3.5"
    assert extract_last_number("none") is None
    text = r"#### 5 and \boxed{6} then 7"
    assert extract_answer(text, ("boxed", "gsm8k")) == "6"
    assert extract_answer(text, ("gsm8k", "boxed")) == "5"
    assert extract_answer(text, ("last_number",)) == "7"


def test_plain_numbers_and_rounding():
    assert parse_plain_number("1,234") == Decimal(1234)
    assert parse_plain_number(r"\$ 5.50") == Decimal("5.50")
    assert parse_plain_number("72.") == Decimal(72)
    assert parse_plain_number("-.5") == Decimal("-0.5")
    for not_plain in (r"\frac{1}{2}", "1,23", "2x", "1e3", "50\\%", ""):
        assert parse_plain_number(not_plain) is None, not_plain
    # round(·, 6), half-even: 0.1234564 → 0.123456 == 0.1234560; 0.1234566 → 0.123457
    assert numbers_equal(Decimal("0.1234564"), Decimal("0.123456"), 6)
    assert not numbers_equal(Decimal("0.1234566"), Decimal("0.123456"), 6)
    assert numbers_equal(Decimal("1234"), Decimal("1234.000"), 6)


def test_fast_path_never_starts_the_pool():
    r = MathReward()
    try:
        assert r("q", r"so \boxed{1,234}", "work... #### 1234") == 1.0
        assert r("q", "The answer is 72.", "#### 72") == 1.0
        assert r("q", r"\boxed{73}", "72") == 0.0
        assert r("q", "no digits at all", "72") == 0.0
        assert r._pool is None
        s = r.stats()
        assert (s["calls"], s["fast_path"], s["no_answer"], s["pool_path"]) == (4, 3, 1, 0)
    finally:
        r.close()


def test_pool_path_symbolic_equivalence():
    with MathReward(MathRewardConfig(pool=PoolConfig(num_workers=1, timeout_s=10, preload=("math_verify",)))) as r:
        half = r.score(r"thus \boxed{\frac{1}{2}}", "0.5")
        assert (half.reward, half.path, half.predicted) == (1.0, "pool", r"\frac{1}{2}")
        assert r.score(r"\boxed{(x+1)^2}", "x^2+2x+1").correct
        assert r.score(r"\boxed{\{2, 1\}}", r"\boxed{\{1,2\}}").correct
        assert not r.score(r"\boxed{\sqrt{2}}", "2").correct
        assert not r.score(r"\boxed{\pi}", "3.14159").correct
        s = r.stats()
        assert s["pool_path"] == 5 and s["failures"] == 0 and s["timeouts"] == 0


def test_format_gate():
    single = MathReward(MathRewardConfig(format="single_boxed", format_fail_reward=-1.0))
    assert single("q", r"\boxed{3}", "3") == 1.0
    assert single("q", r"\boxed{2} no wait \boxed{3}", "3") == -1.0
    assert single("q", "3", "3") == -1.0
    assert single.stats()["format_failures"] == 2
    rx = MathReward(MathRewardConfig(format="regex", format_regex=r"^<think>.*</think>"))
    assert rx("q", "<think>hmm\n</think> \\boxed{3}", "3") == 1.0
    assert rx("q", "\\boxed{3}", "3") == 0.0
    with pytest.raises(ValueError, match="format_regex"):
        MathRewardConfig(format="regex")
    with pytest.raises(ValueError, match="extractors"):
        MathRewardConfig(extractors=("boxd",))


def test_wedged_verifier_times_out_gives_zero_and_recovers():
    cfg = MathRewardConfig(verify_target=f"{targets.__name__}:hang_on",
                           pool=PoolConfig(num_workers=1, timeout_s=0.5, retries=1))
    with MathReward(cfg) as r:
        assert r("q", r"\boxed{x}", "x") == 1.0  # non-numeric → pool
        score = r.score(r"\boxed{HANG}", "x")
        assert (score.reward, score.path) == (0.0, "failed") and "timed out" in score.error
        assert r("q", r"\boxed{y}", "y") == 1.0  # replacement worker serves
        s = r.stats()
        assert (s["timeouts"], s["worker_restarts"], s["failures"]) == (2, 2, 1)


def test_concurrent_calls_from_threads():
    with MathReward(MathRewardConfig(pool=PoolConfig(num_workers=2, timeout_s=10, preload=("math_verify",)))) as r:
        cases = [(rf"\boxed{{\frac{{{i}}}{{2}}}}", f"{i / 2}", True) for i in range(1, 9)]
        cases += [(rf"\boxed{{{i}}}", f"#### {i + 1}", False) for i in range(8)]
        results = [None] * len(cases)

        def work(k):
            completion, gold, _ = cases[k]
            results[k] = r("q", completion, gold)

        threads = [threading.Thread(target=work, args=(k,)) for k in range(len(cases))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert results == [1.0 if ok else 0.0 for *_, ok in cases]
        s = r.stats()
        assert s["calls"] == 16 and s["fast_path"] == 8 and s["pool_path"] == 8 and s["failures"] == 0


def test_bad_inputs_never_raise():
    r = MathReward()
    assert r("q", None, "3") == 0.0  # non-string completion
    assert r("q", r"\boxed{3}", None) == 0.0
    s = r.stats()
    assert s["failures"] == 1 and s["no_answer"] == 1
