"""Per-run overhead of the code sandbox: wall time of ``Sandbox.run`` on a trivial program.

Runs N sandboxed ``pass`` programs (one at a time, after 3 warm-up runs) and prints the median, p90, p99
and max of the wall time seen by the caller.  ``--impl DIR`` benchmarks another copy of ``sandbox.py`` +
``_sandbox_launcher.py`` (e.g. the previous commit's, extracted with ``git show``) so that two versions
can be measured side by side in one session::

    mkdir -p /tmp/sb_old && for f in sandbox.py _sandbox_launcher.py; do
        git show HEAD~1:jaxrl_async/rewards/$f > /tmp/sb_old/$f; done
    python benchmarks/bench_sandbox.py --impl /tmp/sb_old --impl jaxrl_async/rewards --runs 50 --rounds 2

With several ``--impl`` and ``--rounds R`` the versions alternate in R blocks of N/R runs each, so that
background load on a shared machine falls on all of them alike.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time


def _load(impl_dir: str, tag: int):
    path = os.path.join(os.path.abspath(impl_dir), "sandbox.py")
    spec = importlib.util.spec_from_file_location(f"_bench_sandbox_{tag}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, int(round(q / 100 * (len(xs) - 1)))))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--impl", action="append", default=None,
                    help="directory holding sandbox.py + _sandbox_launcher.py (repeatable; default: the package's)")
    ap.add_argument("--runs", type=int, default=50, help="timed runs per implementation")
    ap.add_argument("--rounds", type=int, default=1, help="alternate implementations in this many blocks")
    ap.add_argument("--code", default="pass", help="program to run")
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args()
    impls = args.impl or [os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                       "jaxrl_async", "rewards")]
    boxes = []
    for i, d in enumerate(impls):
        mod = _load(d, i)
        sb = mod.Sandbox(mod.SandboxConfig(wall_timeout_s=10, cpu_time_s=5))
        for _ in range(3):
            res = sb.run(args.code)
            assert res.ok, (d, res)
        boxes.append((d, sb, []))
    per_round = max(1, args.runs // args.rounds)
    for _round in range(args.rounds):
        for d, sb, times in boxes:
            for _ in range(per_round):
                t0 = time.perf_counter()
                res = sb.run(args.code)
                times.append(time.perf_counter() - t0)
                assert res.ok, (d, res)
    out = []
    for d, sb, times in boxes:
        row = {"impl": d, "isolation": sb.isolation, "runs": len(times),
               "median_ms": 1e3 * statistics.median(times), "p90_ms": 1e3 * _pct(times, 90),
               "p99_ms": 1e3 * _pct(times, 99), "max_ms": 1e3 * max(times)}
        out.append(row)
        print(f"{d}: isolation={row['isolation']} runs={row['runs']} median={row['median_ms']:.1f} ms "
              f"p90={row['p90_ms']:.1f} ms p99={row['p99_ms']:.1f} ms max={row['max_ms']:.1f} ms", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
