"""RPC message latency and throughput: the current ``distributed/rpc.py`` vs an older one from git.

``python benchmarks/bench_rpc.py [--baseline COMMIT] [--calls N] [--rounds R]``

Two processes on this host (a server that echoes and a client that measures), over loopback, for
each implementation in turn: the baseline (the ``jaxrl_async`` package as of ``COMMIT``, extracted
with ``git archive``, so its ``rpc.py`` runs with its own ``tls.py`` / ``codec.py``; the default
581dfc3 is ``multiprocessing.connection`` + pickle, HMAC on the handshake only) and the working
tree's. Each implementation's client and server run in processes of their own. ``--rounds R``
alternates the two R times (one JSON line per round and implementation), so that the load of a
shared machine falls on both. Workloads, the traffic of a run:

* ``ping``: a call with a small argument, reply = the argument (heartbeats, ``abort``, ``stats``):
  round-trip latency, median and p99 over ``--calls`` sequential calls;
* ``pipelined``: ``--calls`` small calls in flight at once (``call_async``): messages per second;
* ``request_output``: the reply of a generation request, a ``RequestOutput`` of 8 samples x 512
  tokens (token ids, log-probs, versions as lists): round trip median;
* ``train_batch``: the leader -> follower ``train`` message, 64 packed trajectories of 1024 tokens
  (numpy int32/float32 arrays, ~1.8 MB): round trip median and MB/s.
Prints one JSON object per implementation.
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _root(impl: str) -> str:
    """The directory holding the ``jaxrl_async`` package of ``impl`` (a commit: extracted once)."""
    if impl == "current":
        return ROOT
    commit = subprocess.run(["git", "rev-parse", "--short=12", impl], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout.strip()
    path = os.path.join(tempfile.gettempdir(), f"bench_rpc_{commit}")
    if not os.path.isdir(os.path.join(path, "jaxrl_async")):
        tmp = tempfile.mkdtemp(prefix="bench_rpc_")
        tar = subprocess.run(["git", "archive", commit, "jaxrl_async"], cwd=ROOT, capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=tar, check=True)
        os.replace(tmp, path) if not os.path.exists(path) else None
    return path


def _load(impl: str):
    sys.path.insert(0, _root(impl))
    from jaxrl_async.distributed import rpc

    assert os.path.dirname(rpc.__file__).startswith(_root(impl)), rpc.__file__
    return rpc


def serve(impl: str, port_file: str) -> None:
    rpc = _load(impl)
    key = bytes.fromhex(os.environ["BENCH_RPC_KEY"])
    lst = rpc.listen("127.0.0.1:0", key)
    with open(port_file, "w") as f:
        f.write(str(lst.address[1]))
    conn = rpc.accept(lst, 60, "bench client")
    done = []

    def handle(m, a, reply):
        if m == "quit":
            done.append(m)
        reply(True, a[0] if m == "echo" else len(a) if m == "quit" else len(a[0]))

    peer = rpc.Peer(conn, "client", handler=handle, on_lost=done.append)
    while not done:
        time.sleep(0.1)
    peer.close()


def _request_output():
    from jaxrl_async.generator.orchestrator import RequestOutput, SampleOutput

    T = 512
    samples = [SampleOutput(i, list(range(100, 164)), list(range(T)), [-0.25] * T, [3] * T, "stop", None, 1.0, 1.1, 2.0)
               for i in range(8)]
    return RequestOutput("req-1", list(range(100, 164)), samples, None)


def _train_batch():
    import numpy as np

    from jaxrl_async.trainer.packing import TrainSequence

    rng = np.random.default_rng(0)
    return [TrainSequence(tokens=rng.integers(0, 150000, 1024, dtype=np.int32), loss_mask=np.ones(1024, np.int32),
                       behaviour_logprobs=rng.standard_normal(1024).astype(np.float32),
                       advantages=rng.standard_normal(1024).astype(np.float32),
                       versions=np.full(1024, 3, np.int32)) for _ in range(64)]


def client(impl: str, calls: int) -> dict:
    rpc = _load(impl)
    env = dict(os.environ, BENCH_RPC_KEY=secrets.token_hex(32))
    os.environ["BENCH_RPC_KEY"] = env["BENCH_RPC_KEY"]
    port_file = tempfile.mktemp(prefix="bench_rpc_port_")
    srv = subprocess.Popen([sys.executable, __file__, "--serve", impl, "--port-file", port_file], env=env)
    try:
        deadline = time.monotonic() + 60
        while not (os.path.exists(port_file) and open(port_file).read()):
            assert time.monotonic() < deadline and srv.poll() is None, "server did not start"
            time.sleep(0.05)
        t0 = time.perf_counter()
        conn = rpc.connect(f"127.0.0.1:{open(port_file).read()}", bytes.fromhex(env["BENCH_RPC_KEY"]), 30, "server")
        connect_ms = (time.perf_counter() - t0) * 1e3
        peer = rpc.Peer(conn, "server")
        for _ in range(200):  # warm up
            peer.call("echo", {"x": 1}, timeout=30)
        lat = []
        for i in range(calls):
            t = time.perf_counter()
            peer.call("echo", {"request_id": f"r{i}", "n": i}, timeout=30)
            lat.append(time.perf_counter() - t)
        lat.sort()
        t = time.perf_counter()
        futs = [peer.call_async("echo", i) for i in range(calls)]
        for f in futs:
            f.result(60)
        pipelined = calls / (time.perf_counter() - t)
        out = _request_output()
        ro = []
        for _ in range(50):
            t = time.perf_counter()
            peer.call("echo", out, timeout=30)
            ro.append(time.perf_counter() - t)
        batch = _train_batch()
        nbytes = sum(x.nbytes for tr in batch for x in (tr.tokens, tr.loss_mask, tr.behaviour_logprobs, tr.advantages,
                                                         tr.versions))
        tb = []
        for _ in range(20):
            t = time.perf_counter()
            peer.call("len", batch, timeout=60)  # one way with the batch, a small reply
            tb.append(time.perf_counter() - t)
        peer.call("quit", timeout=30)
        peer.close()
        srv.wait(30)
        return {"impl": impl, "connect_ms": round(connect_ms, 2),
                "ping_median_us": round(lat[len(lat) // 2] * 1e6, 1), "ping_p99_us": round(lat[int(len(lat) * 0.99)] * 1e6, 1),
                "pipelined_msgs_per_s": round(pipelined), "request_output_median_ms": round(statistics.median(ro) * 1e3, 3),
                "train_batch_median_ms": round(statistics.median(tb) * 1e3, 2),
                "train_batch_MB_per_s": round(nbytes / statistics.median(tb) / 1e6, 1), "train_batch_bytes": nbytes,
                "calls": calls}
    finally:
        if srv.poll() is None:
            srv.kill()
        if os.path.exists(port_file):
            os.remove(port_file)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", default="581dfc3", help="git commit of the baseline rpc.py")
    ap.add_argument("--calls", type=int, default=5000)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--serve", default=None)
    ap.add_argument("--client", default=None)
    ap.add_argument("--port-file", default=None)
    a = ap.parse_args()
    if a.serve:
        serve(a.serve, a.port_file)
        return
    if a.client:
        print(json.dumps(client(a.client, a.calls)), flush=True)
        return
    for r in range(a.rounds):
        for impl in (a.baseline, "current"):
            out = subprocess.run([sys.executable, __file__, "--client", impl, "--calls", str(a.calls)], check=True,
                                 capture_output=True, text=True).stdout.strip().splitlines()[-1]
            print(json.dumps({"round": r, **json.loads(out)}), flush=True)


if __name__ == "__main__":
    main()
