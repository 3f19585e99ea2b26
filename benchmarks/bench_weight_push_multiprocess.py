"""Weight-push seconds: across processes (jax.experimental.transfer) vs in one process (WeightPusher).

    python benchmarks/bench_weight_push_multiprocess.py --model tiny --repeats 5
    python benchmarks/bench_weight_push_multiprocess.py --model qwen3-0.6b --repeats 3

Layout (simulated CPU devices): trainer mesh fsdp=2 (fp32 params, trainer rules), generator mesh
data=1 x tensor=2 (bf16, generator rules).
* cross-process: a trainer process and a generator process (2 devices each); per push the trainer
  casts, reshards (via_trainer leaves), checksums and registers the shards; the generator pulls,
  assembles, reshards and verifies the checksums. Seconds = trainer dispatch -> generator verified
  (the path ``distributed.controller.TransferPusher`` times, without handing the weights to a decode
  thread). Parts: trainer prepare+checksum, generator pull, generator verify.
* single process: 4 devices (trainer on 2, generator on 2), ``weight_sync.WeightPusher`` to a
  recording generator: dispatch -> copy complete on the generator devices (no checksum).
The first push (compilation) is excluded; the median of the rest is reported.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import time


def _model_cfg(name: str):
    from jaxrl_async.models.config import ModelConfig, preset

    if name == "tiny":  # tests/loop/tiny_config.py's model (vocab of the local tokenizer ~ 4k)
        return ModelConfig(vocab_size=4096, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                           num_kv_heads=1, head_dim=16, max_position_embeddings=128)
    return preset(name)


def _params(cfg, mesh, rules, dtype):
    import jax
    import jax.numpy as jnp

    from jaxrl_async.models.transformer import param_shapes
    from jaxrl_async.sharding.rules import model_shardings

    shard = model_shardings(cfg, mesh, rules)
    shapes = param_shapes(cfg)
    make = jax.jit(lambda: jax.tree.map(lambda s: jnp.full(s.shape, 0.01, dtype), shapes), out_shardings=shard)
    return make(), shard


def role_trainer(args) -> None:
    import jax

    from jax.experimental import transfer as jtransfer
    from multiprocessing.connection import Client

    from jaxrl_async.distributed.transfer import WireSender, checksum_fn, layout_of, plan_transfer, tree_keys
    from jaxrl_async.sharding.mesh import make_mesh

    cfg = _model_cfg(args.model)
    mesh = make_mesh({"fsdp": 2}, devices=jax.devices()[:2])
    params, _ = _params(cfg, mesh, "trainer", "float32")
    leaves = jax.tree.leaves(params)
    conn = Client(("127.0.0.1", args.port), authkey=bytes.fromhex(os.environ["BENCH_KEY"]))
    dst_layouts = conn.recv()
    src_layouts = [layout_of(x.sharding, x.ndim) for x in leaves]
    plans = plan_transfer(tree_keys(params), [x.shape for x in leaves], "bfloat16", src_layouts, dst_layouts)
    conn.send(src_layouts)
    sender = WireSender(plans, [x.sharding for x in leaves])
    server = jtransfer.start_transfer_server(jax.devices()[0].client, "127.0.0.1:0", ["127.0.0.1:0"])
    cast = jax.jit(lambda xs: [x.astype("bfloat16") for x in xs])
    rows = []
    for r in range(args.repeats + 1):
        t0 = time.perf_counter()
        wire = sender.prepare(cast(leaves))
        sums = checksum_fn(wire)
        shards = sender.shards(wire)
        server.await_pull(1000 + r, shards)
        t1 = time.perf_counter()
        conn.send((1000 + r, server.address(), sums))
        rep = conn.recv()
        t2 = time.perf_counter()
        rows.append({"total_s": t2 - t0, "prepare_checksum_s": t1 - t0, **rep,
                     "bytes": int(sum(x.size * x.dtype.itemsize for x in wire)),
                     "routes": sorted({p.route for p in plans})})
    conn.send(None)
    print(json.dumps(rows), flush=True)


def role_generator(args) -> None:
    import jax

    from jax.experimental import transfer as jtransfer
    from multiprocessing.connection import Listener

    from jaxrl_async.distributed.transfer import WireReceiver, layout_of, plan_transfer, tree_keys, verify
    from jaxrl_async.models.transformer import param_shapes
    from jaxrl_async.sharding.mesh import make_mesh
    from jaxrl_async.sharding.rules import model_shardings

    cfg = _model_cfg(args.model)
    mesh = make_mesh({"data": 1, "tensor": 2}, devices=jax.devices()[:2])
    shard = model_shardings(cfg, mesh, "generator")
    shapes = jax.tree.leaves(param_shapes(cfg))
    dst = jax.tree.leaves(shard)
    keys = tree_keys(shard)
    lst = Listener(("127.0.0.1", args.port), authkey=bytes.fromhex(os.environ["BENCH_KEY"]))
    conn = lst.accept()
    conn.send([layout_of(s, len(x.shape)) for s, x in zip(dst, shapes)])
    src_layouts = conn.recv()
    plans = plan_transfer(keys, [x.shape for x in shapes], "bfloat16", src_layouts,
                          [layout_of(s, len(x.shape)) for s, x in zip(dst, shapes)])
    recv = WireReceiver(plans, dst)
    server = jtransfer.start_transfer_server(jax.devices()[0].client, "127.0.0.1:0", ["127.0.0.1:0"])
    peers = {}
    while True:
        msg = conn.recv()
        if msg is None:
            return
        uuid, addr, sums = msg
        if addr not in peers:
            peers[addr] = server.connect(addr)
        c = peers[addr]
        t0 = time.perf_counter()
        out = recv.pull(c, uuid, 600)
        t1 = time.perf_counter()
        verify(out, sums, keys, uuid)
        conn.send({"pull_s": t1 - t0, "verify_s": time.perf_counter() - t1, "shards": len(recv.specs)})


def role_single(args) -> None:
    import jax

    from jaxrl_async.sharding.mesh import make_mesh
    from jaxrl_async.sharding.rules import model_shardings
    from jaxrl_async.weight_sync import WeightPusher

    class Recording:
        def update_params(self, params, version, wait=True, timeout=None):
            pass

    cfg = _model_cfg(args.model)
    d = jax.devices()
    tm = make_mesh({"fsdp": 2}, devices=d[2:4])
    gm = make_mesh({"data": 1, "tensor": 2}, devices=d[:2])
    params, _ = _params(cfg, tm, "trainer", "float32")
    pusher = WeightPusher(Recording(), model_shardings(cfg, gm, "generator"), dtype="bfloat16")
    rows = []
    try:
        for v in range(1, args.repeats + 2):
            st = pusher.push(params, v)
            pusher.wait(v, timeout=600)
            rows.append({"total_s": pusher.history[-1].total_s, "dispatch_s": st.dispatch_s, "bytes": st.bytes,
                         "routes": dict(pusher.routes)})
    finally:
        pusher.close()
    print(json.dumps(rows), flush=True)


def _run_role(role: str, args, devices: int, env: dict) -> subprocess.Popen:
    e = dict(env)
    e["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    e["JAX_PLATFORMS"] = "cpu"
    return subprocess.Popen([sys.executable, __file__, "--role", role, "--model", args.model, "--repeats",
                             str(args.repeats), "--port", str(args.port)], env=e, stdout=subprocess.PIPE)


def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--role", default=None)
    ap.add_argument("--port", type=int, default=0)
    args = ap.parse_args()
    if args.role:
        {"trainer": role_trainer, "generator": role_generator, "single": role_single}[args.role](args)
        return
    from jaxrl_async.distributed.launch import free_port

    args.port = free_port()
    env = dict(os.environ, BENCH_KEY=secrets.token_hex(16))
    gen = _run_role("generator", args, 2, env)
    time.sleep(1.0)
    tr = _run_role("trainer", args, 2, env)
    cross = json.loads(tr.communicate(timeout=1800)[0].decode().strip().splitlines()[-1])
    gen.wait(120)
    single = json.loads(_run_role("single", args, 4, env).communicate(timeout=1800)[0].decode().strip().splitlines()[-1])
    c, s = cross[1:], single[1:]
    out = {"model": args.model, "bytes_bf16": cross[0]["bytes"], "routes_cross": cross[0]["routes"],
           "cross_process_s": _median([r["total_s"] for r in c]),
           "cross_prepare_checksum_s": _median([r["prepare_checksum_s"] for r in c]),
           "cross_pull_s": _median([r["pull_s"] for r in c]), "cross_verify_s": _median([r["verify_s"] for r in c]),
           "cross_shards": cross[0]["shards"], "single_process_s": _median([r["total_s"] for r in s]),
           "routes_single": single[0]["routes"], "repeats": args.repeats}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
