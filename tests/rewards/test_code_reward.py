"""Code reward: stdin/stdout, call-based and assert tests in the sandbox; fraction vs all-or-nothing."""
import threading
import time

import pytest

from jaxrl_async.rewards.code_reward import (
    CodeReward,
    CodeRewardConfig,
    extract_code,
    parse_tests,
    stdout_matches,
    values_equal,
)
from jaxrl_async.rewards.sandbox import SandboxConfig, probe_isolation

PROBE = probe_isolation()
needs_sandbox = pytest.mark.skipif(not (PROBE["namespaces"] and PROBE["net"]), reason=f"no sandbox here: {PROBE}")

DOUBLE = "```python\nn = int(input())\nprint(n * 2)\n```"
STDIO = {"inputs": ["1\n", "2\n", "3\n", "5\n"], "outputs": ["2\n", "4\n", "6\n", "11\n"]}  # last one is wrong


def test_pure_helpers():
    assert extract_code("a\n```python\nx=1\n```\nb\n```py\nx=2\n```") == "x=2\n"
    assert extract_code("```bash\nls\n```") is None
    assert extract_code("print(1)", "last_block_or_raw") == "print(1)"
    assert stdout_matches("1 \n2\n\n", "1\n2", "lines") and not stdout_matches("1 \n2", "1\n2", "exact")
    assert stdout_matches("1   2\n3", "1 2 3", "tokens") and not stdout_matches("1\n3", "1\n2", "lines")
    assert values_equal((1, [2.0000001]), [1, [2.0]]) and not values_equal(1, True)
    assert not values_equal([1, 2], [1, 2, 3]) and values_equal({"a": 1.5}, {"a": 1.5}) and not values_equal("1", 1)
    cases = parse_tests('{"fn_name": "f", "inputs": [[1, 2]], "outputs": [3]}')
    assert cases[0].kind == "call" and cases[0].args == (1, 2) and cases[0].expected == 3
    assert [c.kind for c in parse_tests([{"stdin": "1", "stdout": "2"}, {"assert": "assert 1"}])] == ["stdio", "assert"]
    with pytest.raises(ValueError, match="code test 1"):
        parse_tests([{"stdin": "1", "stdout": "2"}, {"bogus": 1}])
    with pytest.raises(ValueError, match="2 inputs but 1 outputs"):
        parse_tests({"inputs": ["a", "b"], "outputs": ["c"]})


@pytest.fixture(scope="module")
def cr():
    with CodeReward(CodeRewardConfig(max_concurrency=2, sandbox=SandboxConfig(wall_timeout_s=3, cpu_time_s=2))) as r:
        yield r


@needs_sandbox
def test_stdio_fraction_and_all_or_nothing(cr):
    assert cr("p", DOUBLE, "", tests=STDIO) == pytest.approx(0.75)  # 3 of 4
    with CodeReward(CodeRewardConfig(mode="all_or_nothing", max_concurrency=1), sandbox=cr.sandbox) as strict:
        score = strict.score(DOUBLE, STDIO)
        assert score.reward == 0.0 and score.passed <= 3
        first3 = {"inputs": STDIO["inputs"][:3], "outputs": STDIO["outputs"][:3]}
        assert strict.score(DOUBLE, first3).reward == 1.0
    # tests may also come as the `answer` (JSON string) when metadata has no `tests`
    assert cr("p", DOUBLE, '[{"stdin": "4", "stdout": "8"}]') == 1.0


@needs_sandbox
def test_call_based_and_reward_hacks(cr):
    f = "```python\ndef f(a, b):\n    return [a + b, a * b / 4]\n```"
    tests = {"fn_name": "f", "inputs": [[1, 2], [2, 3]], "outputs": [[3, 0.5], [5, 1.0]]}  # 2nd expects 1.5
    score = cr.score(f, tests)
    assert score.reward == 0.5 and [o.reason for o in score.outcomes] == ["passed", "wrong_answer"]
    leet = "```python\nclass Solution:\n    def twoSum(self, xs, t):\n        return sorted(xs)[:2]\n```"
    assert cr.score(leet, {"fn_name": "twoSum", "inputs": [[[3, 1, 2], 0]], "outputs": [[1, 2]]}).reward == 1.0
    always_eq = "```python\nclass E:\n    def __eq__(self, o): return True\ndef f(a, b): return E()\n```"
    assert cr.score(always_eq, {"fn_name": "f", "inputs": [[1, 2]], "outputs": [3]}).reward == 0.0
    forged = "```python\nprint('@@jaxrl-result-' + '0' * 32 + '@@3')\ndef f(a, b): return -1\n```"
    assert cr.score(forged, {"fn_name": "f", "inputs": [[1, 2]], "outputs": [3]}).reward == 0.0
    exits = "```python\nimport sys\ndef f(a, b): return 3\nsys.exit(0)\n```"
    assert cr.score(exits, {"fn_name": "f", "inputs": [[1, 2]], "outputs": [3]}).reward == 0.0


@needs_sandbox
def test_assert_tests_and_failures(cr):
    sq = "```python\ndef sq(x):\n    return x * x\n```"
    score = cr.score(sq, [{"assert": "assert sq(3) == 9"}, {"assert": "assert sq(2) == 5"}])
    assert score.reward == 0.5 and [o.reason for o in score.outcomes] == ["passed", "runtime_error"]
    loop = "```python\nwhile True: pass\n```"
    t0 = time.monotonic()
    score = cr.score(loop, [{"stdin": "", "stdout": "1"}] * 2)
    assert score.reward == 0.0 and {o.reason for o in score.outcomes} <= {"timeout", "killed:cpu_limit"}
    assert time.monotonic() - t0 < 8  # two tests, both killed in ~2-3 s, run concurrently
    before = cr.stats()
    assert cr("p", "no code here", "", tests=STDIO) == 0.0
    assert cr("p", DOUBLE, "", tests="not json") == 0.0
    after = cr.stats()
    assert after["no_code"] == before["no_code"] + 1 and after["invalid_tests"] == before["invalid_tests"] + 1


@needs_sandbox
def test_concurrency_is_bounded():
    probe = "```python\nimport time\ntime.sleep(0.4)\nprint('ok')\n```"
    tests = [{"stdin": "", "stdout": "ok"}] * 4
    with CodeReward(CodeRewardConfig(max_concurrency=2)) as r:
        results = []
        t0 = time.monotonic()
        threads = [threading.Thread(target=lambda: results.append(r("p", probe, "", tests=tests))) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.monotonic() - t0
    assert results == [1.0, 1.0]
    assert elapsed >= 4 * 0.4 - 0.05  # 8 tests × 0.4 s over 2 sandboxes at a time ≥ 1.6 s
