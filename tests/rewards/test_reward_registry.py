"""Custom rewards by import string: load errors name the string; failures give 0 and are counted."""
import math

import pytest

import reward_pool_targets as targets
from jaxrl_async.rewards.pool import PoolConfig
from jaxrl_async.rewards.registry import (
    PooledReward,
    RewardLoadError,
    SafeReward,
    load_reward_fn,
    make_reward,
)

T = targets.__name__


def test_load_reward_fn_and_errors_name_the_string():
    assert load_reward_fn(f"{T}:slow_reward") is targets.slow_reward
    assert load_reward_fn("os.path:join") is __import__("os").path.join
    assert load_reward_fn("collections:OrderedDict.fromkeys")  # dotted attribute path
    for spec, fragment in [("no_such_mod_abc:f", "cannot import module 'no_such_mod_abc'"),
                           ("json:nope", "has no attribute path 'nope'"),
                           ("json", "must look like"),
                           ("math:pi", "non-callable float")]:
        with pytest.raises(RewardLoadError) as err:
            load_reward_fn(spec)
        assert repr(spec) in str(err.value) and fragment in str(err.value), str(err.value)


def test_safe_reward_accounting():
    def raising(prompt, completion, answer, **md):
        raise KeyError("boom")

    r = SafeReward(raising, default=0.0)
    assert r("p", "c", "a") == 0.0 and r.stats() == dict(calls=1, errors=1, invalid=0)
    assert "KeyError" in r.last_error

    values = iter([True, 2, float("nan"), "1.0", None, math.inf, 0.25])
    r = SafeReward(lambda *a, **k: next(values))
    got = [r("p", "c", "a") for _ in range(7)]
    assert got == [1.0, 2.0, 0.0, 0.0, 0.0, 0.0, 0.25]
    assert r.stats() == dict(calls=7, errors=0, invalid=4)

    s = SafeReward(f"{T}:slow_reward")
    assert s("p", "x", "x", bonus=0.5) == 1.5 and s.name == f"{T}:slow_reward"


def test_make_reward_builtins_and_custom():
    math_r = make_reward("math")
    assert math_r("q", r"\boxed{12}", "#### 12") == 1.0 and math_r.stats()["calls"] == 1
    math_r.close()
    gsm = make_reward("gsm8k")
    assert gsm("q", r"#### 5 but \boxed{6}", "5") == 1.0  # gsm8k marker wins over the box
    assert make_reward(f"{T}:add")("p", "c", "a") == 0.0  # wrong signature → TypeError → 0, counted
    with pytest.raises(RewardLoadError, match="'nonsense'"):
        make_reward("nonsense")
    with pytest.raises(TypeError, match="only for built-in"):
        make_reward(f"{T}:slow_reward", foo=1)


def test_pooled_reward_times_out_to_zero():
    with pytest.raises(RewardLoadError, match="no_such_mod_abc"):
        PooledReward("no_such_mod_abc:f")
    with PooledReward(f"{T}:slow_reward", PoolConfig(num_workers=1, timeout_s=0.5, retries=0)) as r:
        assert r("p", "x", "x", bonus=0.25) == 1.25
        assert r("p", "slow", "x") == 0.0
        assert r("p", "y", "y") == 1.0
        s = r.stats()
        assert (s["calls"], s["timeouts"], s["worker_restarts"], s["failed_calls"]) == (3, 1, 1, 1)


def test_make_reward_pooled_and_non_json_metadata():
    r = make_reward(f"{T}:slow_reward", pool=PoolConfig(num_workers=1, timeout_s=5, retries=0))
    try:
        assert r("p", "z", "z") == 1.0
        assert r("p", "z", "z", bonus=object()) == 0.0  # not JSON-serializable → 0, counted by the pool
        assert r.fn.stats()["failed_calls"] == 1 and r.fn.stats()["errors"] == 1
    finally:
        r.close()


def test_the_readme_custom_reward_example_works(tmp_path):
    """README "Custom rewards": its module, called as the run calls it, and its `main --dry-run` line validates."""
    import os
    import re
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    readme = open(os.path.join(root, "README.md"), encoding="utf-8").read()
    code = re.search(r"```python\n(# my_rewards\.py\n.*?)```", readme, re.S).group(1)
    (tmp_path / "my_rewards.py").write_text(code)
    sys.path.insert(0, str(tmp_path))
    try:
        r = make_reward("my_rewards:last_number")
        assert r("p", "so 40 + 2 = 42", "42") == 1.0 and r("p", "1,200 apples", "1200") == 1.0
        assert r("p", "42 or 41", "42") == 0.0 and r("p", "no number", "42") == 0.0
        assert r("p", "x = 3/2", "\\frac{3}{2}") == 0.0  # raised: scored 0, counted
        assert r.stats() == dict(calls=5, errors=1, invalid=0) and "ValueError" in r.last_error
        assert r("p", "7", "7", raw_prompt="q", source="f.jsonl:1", level=3) == 1.0  # metadata as keywords
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("my_rewards", None)
    cmd = re.search(r"\n(python -m jaxrl_async\.main .*rollout\.reward=my_rewards:last_number --dry-run)\n", readme).group(1)
    argv = cmd.split()[3:]
    argv[argv.index("configs/tiny_cpu.py")] = os.path.join(root, "configs", "tiny_cpu.py")
    env = dict(os.environ, PYTHONPATH=root, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-m", "jaxrl_async.main", *argv], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "rollout.reward = 'my_rewards:last_number'" in proc.stdout and "config OK" in proc.stdout
