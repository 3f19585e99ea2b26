"""Functions run inside WorkerPool workers by tests/rewards (imported by name in the worker)."""
import os
import time


def add(a, b):
    return a + b


def boom(msg):
    raise ValueError(msg)


def sleep_then_pid(seconds):
    time.sleep(seconds)
    return os.getpid()


def die(code):
    os._exit(code)


def die_once(marker_path):
    """Crash the worker on the first call (marker file absent), succeed afterwards."""
    if not os.path.exists(marker_path):
        open(marker_path, "w").close()
        os._exit(3)
    return "survived"


def hang_on(pred, gold, float_rounding=6, inner_timeout_s=1):
    """A MathReward verify target that wedges (ignores signals' default path: busy loop) on 'HANG'."""
    if pred == "HANG":
        while True:
            pass
    return pred == gold


def slow_reward(prompt, completion, answer, **metadata):
    if completion == "slow":
        time.sleep(60)
    return float(completion == answer) + metadata.get("bonus", 0.0)
