"""Generator replicas through the local launcher: 1 vs 2 replicas on the same CPUs, and a killed replica's recovery.

    python benchmarks/bench_replicas.py --steps 60 --rounds 2 --json replicas.json

The tests' tiny run (``tests/loop/tiny_config.py``; trainer on 2 simulated CPU devices, each generator
process on 1) through ``python -m jaxrl_async.distributed.launch`` with ``--generators 1`` and
``--generators 2``, alternating (1, 2, 1, 2, ...), the same steps, on the same machine: every process shares
the machine's cores, so the second replica adds processes, not compute (on a cluster it would bring its own
devices). Per run, from the run's own ``metrics.jsonl`` (step rows): steps/s and generated tokens/s over the
steady part (from the first step row to the last: process start, compiles and the warm start excluded),
and the wall time of the launcher (a first, uncounted 2-replica run fills the shared compilation cache, so
every counted run starts warm). Then (``--kill``) one more 2-replica run paced by the slow reward
(``loop_targets:has_digit_slow``, so the run outlasts a restart) in which generator-1's process is SIGKILLed
after step ``--kill-after``; reported: SIGKILL -> the controller's ``generator replica lost`` line
(detection), SIGKILL -> its ``back in service`` line, and the controller's own ``generator/recovery_s``
(death noticed -> back in service) and ``generator/lost_s`` (replica-seconds out of service) from the last
step row, with the requests re-queued and those the restarted replica served afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "tests", "loop", "tiny_config.py")


def _rows(run: str) -> list[dict]:
    path = os.path.join(run, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip().endswith("}")]
    return [r for r in rows if "train/loss" in r]


def _env(cache: str) -> dict:
    from jaxrl_async.testing import subprocess_xla_flags

    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=subprocess_xla_flags(), PYTHONUNBUFFERED="1",
               JAXRL_RPC_AUTHKEY=secrets.token_hex(16), JAX_COMPILATION_CACHE_DIR=cache,
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


def launch(tmp: str, tag: str, generators: int, steps: int, reward: str, kill_after: int | None = None,
           timeout: float = 600.0) -> dict:
    run = os.path.join(tmp, tag)
    cmd = [sys.executable, "-m", "jaxrl_async.distributed.launch", "--generators", str(generators),
           "--trainer-cpu-devices", "2", "--generator-cpu-devices", "1", "--grace", "30", "--restart-backoff", "0.5",
           "--replica-timeout", "120", "--config", TINY, f"run_dir={run}", f"trainer.total_steps={steps}",
           "checkpoint.every_steps=null", f"rollout.reward={reward}"]
    lines: list[tuple[float, str]] = []  # (monotonic time the launcher printed it, line)
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, env=_env(os.path.join(tmp, "jax_cache")), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)

    def read() -> None:
        for line in proc.stdout:
            lines.append((time.monotonic(), line.rstrip("\n")))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    t_kill = pid = None
    try:
        if kill_after is not None:
            deadline = time.monotonic() + timeout
            while True:
                assert proc.poll() is None, "\n".join(x for _, x in lines[-40:])
                assert time.monotonic() < deadline, "no step / generator-1 never registered"
                for _, x in list(lines):
                    m = re.search(r"\[generator-1\] \[generator-1 pid (\d+)\] registered", x)
                    pid = int(m.group(1)) if m else pid
                rows = _rows(run)
                if pid is not None and rows and rows[-1]["step"] >= kill_after:
                    break
                time.sleep(0.1)
            os.kill(pid, signal.SIGKILL)
            t_kill = time.monotonic()
        rc = proc.wait(timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(10)
    wall = time.monotonic() - t0
    log = "\n".join(x for _, x in lines)
    assert rc == 0, log[-4000:]
    rows = _rows(run)
    assert len(rows) == steps, (len(rows), steps)
    first, last = rows[0], rows[-1]
    span = last["wall_time"] - first["wall_time"] if "wall_time" in last else None
    tok = lambda r: sum(v for k, v in r.items() if re.fullmatch(r"generator/\d+/generated_tokens", k))  # noqa: E731
    out = {"generators": generators, "steps": steps, "reward": reward, "wall_s": wall}
    if span:
        out.update(steps_per_s=(len(rows) - 1) / span, gen_tokens_per_s=(tok(last) - tok(first)) / span)
    else:  # no timestamp in the rows: the per-step figures the loop logs
        out.update(steps_per_s=1.0 / statistics.median(r["train/seconds"] + r["trainer/wait_s"] for r in rows[1:]),
                   gen_tokens_per_s=statistics.median(r["gen/tokens_per_s"] for r in rows[1:]))
    out["requests"] = [last.get(f"generator/{i}/requests", 0) for i in range(generators)]
    if t_kill is not None:
        def when(pattern: str) -> float | None:
            return next((t - t_kill for t, x in lines if t >= t_kill and re.search(pattern, x)), None)

        out.update(
            killed_after_step=kill_after,
            detect_s=when(r"generator replica lost"),
            restarted_s=when(r"\[launch\] generator-1 restarted"),
            back_in_service_s=when(r"generator-1 .*back in service"),
            recovery_s=last["generator/recovery_s"], lost_s=last["generator/lost_s"],
            requeued=last["generator/requeued"], replica_failures=last["generator/replica_failures"],
            served_after_rejoin=last["generator/1/requests_since_join"])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=2, help="alternating (1 replica, 2 replicas) pairs")
    ap.add_argument("--no-kill", dest="kill", action="store_false", help="skip the killed-replica run")
    ap.add_argument("--kill-after", type=int, default=3, help="SIGKILL generator-1 after this step")
    ap.add_argument("--kill-steps", type=int, default=60, help="steps of the killed-replica run (slow reward)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    res: dict = {"runs": [], "kill": None}
    with tempfile.TemporaryDirectory() as tmp:
        launch(tmp, "warmup", 2, 2, "loop_targets:has_digit")  # fills the shared compilation cache; not counted
        for r in range(args.rounds):
            for g in (1, 2):
                row = launch(tmp, f"r{r}g{g}", g, args.steps, "loop_targets:has_digit")
                res["runs"].append(row)
                print(json.dumps(row), flush=True)
        if args.kill:
            res["kill"] = launch(tmp, "kill", 2, args.kill_steps, "loop_targets:has_digit_slow",
                                 kill_after=args.kill_after)
            print(json.dumps(res["kill"]), flush=True)
    print("\n| replicas | runs | steps/s (median) | generated tokens/s (median) | launcher wall s (median) |")
    print("| --- | --- | --- | --- | --- |")
    for g in (1, 2):
        rows = [x for x in res["runs"] if x["generators"] == g]
        if rows:
            print(f"| {g} | {len(rows)} | {statistics.median(x['steps_per_s'] for x in rows):.2f} | "
                  f"{statistics.median(x['gen_tokens_per_s'] for x in rows):.0f} | "
                  f"{statistics.median(x['wall_s'] for x in rows):.1f} |")
    k = res["kill"]
    if k:
        f = lambda v: "n/a" if v is None else f"{v:.1f}"  # noqa: E731
        print(f"\nkilled generator-1 after step {k['killed_after_step']}: detected {f(k['detect_s'])} s, restarted "
              f"{f(k['restarted_s'])} s, back in service {f(k['back_in_service_s'])} s after the SIGKILL; "
              f"generator/recovery_s {k['recovery_s']:.1f}, generator/lost_s {k['lost_s']:.1f}, requeued "
              f"{k['requeued']}, served after rejoin {k['served_after_rejoin']}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
