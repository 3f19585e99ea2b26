"""Weight-push seconds: across processes (jax.experimental.transfer) vs in one process (WeightPusher).

    python benchmarks/bench_weight_push_multiprocess.py --model tiny --repeats 5
    python benchmarks/bench_weight_push_multiprocess.py --model qwen3-0.6b --repeats 3
    python benchmarks/bench_weight_push_multiprocess.py --model qwen3-0.6b --repeats 3 --lora 32

Layout (simulated CPU devices): trainer mesh fsdp=2 (fp32 params, trainer rules), generator mesh
data=1 x tensor=2 (bf16, generator rules).
* cross-process: a trainer process and a generator process (2 devices each); per push the trainer
  casts, reshards (via_trainer leaves), checksums and registers the shards; the generator pulls,
  assembles, reshards and verifies the checksums. Seconds = trainer dispatch -> generator verified
  (the path ``distributed.remote_generator.TransferPusher`` times, without handing the weights to a decode
  thread). Parts: trainer prepare+checksum, generator pull, generator verify.
* trainer group (``--group``): the same trainer mesh fsdp=2 made of TWO trainer processes with one
  device each (jax.distributed, gloo); each runs its own transfer server and registers the shards it
  owns (``WireSender.owners``); the generator pulls from both servers. Same timing points.
* single process: 4 devices (trainer on 2, generator on 2), ``weight_sync.WeightPusher`` to a
  recording generator: dispatch -> copy complete on the generator devices (no checksum).
* ``--lora R``: one trainer process; each round pushes the base (= a full-weight run's push of the same
  model) and then the rank-R adapters only (a LoRA run's push, ``distributed/lora_remote.py``), same
  plan/cast/checksum/pull/verify path; bytes = the wire arrays and what the generator pulled.
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


def _kinds(cfg, tree, lora_rank):
    """What is pushed: {"full": all weights}; with ``--lora R`` {"full": the base (what a full-weight run of
    the same model pushes), "adapters": the LoRA adapters only}."""
    if not lora_rank:
        return {"full": tree}
    from jaxrl_async.models import lora

    adapters, base = lora.split(tree)
    return {"full": base, "adapters": adapters}


def _lora_cfg(cfg, rank):
    from jaxrl_async.models.lora import LoraSpec

    return cfg.replace(lora=LoraSpec(rank=rank, alpha=2.0 * rank)) if rank else cfg


def _params(cfg, mesh, rules, dtype):
    import jax
    import jax.numpy as jnp

    from jaxrl_async.models.transformer import param_shapes
    from jaxrl_async.models.shardings import model_shardings

    shard = model_shardings(cfg, mesh, rules)
    shapes = param_shapes(cfg)
    make = jax.jit(lambda: jax.tree.map(lambda s: jnp.full(s.shape, 0.01, dtype), shapes), out_shardings=shard)
    return make(), shard


def role_trainer(args) -> None:
    import jax

    if args.group_process is not None:  # one of the 2 processes of a trainer group
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(args.coordinator, 2, args.group_process, heartbeat_timeout_seconds=60)
    from jax.experimental import multihost_utils
    from jax.experimental import transfer as jtransfer
    from multiprocessing.connection import Client

    from jaxrl_async.distributed.transfer import WireSender, checksum_fn, layout_of, plan_transfer, tree_keys
    from jaxrl_async.sharding.mesh import make_mesh

    lead = jax.process_index() == 0
    cfg = _lora_cfg(_model_cfg(args.model), args.lora)
    mesh = make_mesh({"fsdp": 2}, devices=jax.devices()[:2])
    params, _ = _params(cfg, mesh, "trainer", "float32")
    kinds = _kinds(cfg, params, args.lora)
    server = jtransfer.start_transfer_server(jax.local_devices()[0].client, "127.0.0.1:0", ["127.0.0.1:0"])
    addr_file = os.path.join(args.scratch, f"addr{jax.process_index()}")
    with open(addr_file + ".tmp", "w") as f:
        f.write(server.address())
    os.replace(addr_file + ".tmp", addr_file)
    if lead:
        conn = Client(("127.0.0.1", args.port), authkey=bytes.fromhex(os.environ["BENCH_KEY"]))
        dst_layouts = conn.recv()
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices("addresses written")
        layouts_file = os.path.join(args.scratch, "dst_layouts.pkl")
        import pickle

        if lead:
            with open(layouts_file, "wb") as f:
                pickle.dump(dst_layouts, f)
        multihost_utils.sync_global_devices("layouts written")
        with open(layouts_file, "rb") as f:
            dst_layouts = pickle.load(f)
    addresses = [open(os.path.join(args.scratch, f"addr{i}")).read() for i in range(jax.process_count())]
    senders, sources = {}, {}
    for kind, tree in kinds.items():
        leaves = jax.tree.leaves(tree)
        src_layouts = [layout_of(x.sharding, x.ndim) for x in leaves]
        plans = plan_transfer(tree_keys(tree), [x.shape for x in leaves], "bfloat16", src_layouts, dst_layouts[kind])
        senders[kind] = (WireSender(plans, [x.sharding for x in leaves]), leaves, plans)
        sources[kind] = (src_layouts, senders[kind][0].owners)
    if lead:
        conn.send(sources)
    cast = jax.jit(lambda xs: [x.astype("bfloat16") for x in xs])
    rows = []
    for r, kind in ((r, k) for r in range(args.repeats + 1) for k in kinds):
        sender, leaves, plans = senders[kind]
        uid = 1000 + 10 * r + list(kinds).index(kind)
        t0 = time.perf_counter()
        wire = sender.prepare(cast(leaves))
        sums = checksum_fn(wire)  # a collective on a trainer group
        shards = sender.shards(wire)  # the shards this process owns
        server.await_pull(uid, shards)
        t1 = time.perf_counter()
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"registered {uid}")
        if lead:
            conn.send((kind, uid, addresses, sums))
            rep = conn.recv()
            t2 = time.perf_counter()
            rows.append({"kind": kind, "total_s": t2 - t0, "prepare_checksum_s": t1 - t0, **rep,
                         "bytes": int(sum(x.size * x.dtype.itemsize for x in wire)),
                         "routes": sorted({p.route for p in plans}), "trainer_processes": jax.process_count()})
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"pulled {uid}")  # keep the shards registered until pulled
    if lead:
        conn.send(None)
        print(json.dumps(rows), flush=True)


def role_generator(args) -> None:
    import jax

    from jax.experimental import transfer as jtransfer
    from multiprocessing.connection import Listener

    from jaxrl_async.distributed.transfer import WireReceiver, layout_of, plan_transfer, tree_keys, verify
    from jaxrl_async.models.transformer import param_shapes
    from jaxrl_async.sharding.mesh import make_mesh
    from jaxrl_async.models.shardings import model_shardings

    cfg = _lora_cfg(_model_cfg(args.model), args.lora)
    mesh = make_mesh({"data": 1, "tensor": 2}, devices=jax.devices()[:2])
    shard_k = _kinds(cfg, model_shardings(cfg, mesh, "generator"), args.lora)
    shape_k = _kinds(cfg, param_shapes(cfg), args.lora)
    lst = Listener(("127.0.0.1", args.port), authkey=bytes.fromhex(os.environ["BENCH_KEY"]))
    conn = lst.accept()
    dst_layouts = {k: [layout_of(s, len(x.shape)) for s, x in zip(jax.tree.leaves(shard_k[k]),
                                                                  jax.tree.leaves(shape_k[k]))] for k in shard_k}
    conn.send(dst_layouts)
    sources = conn.recv()
    recvs = {}
    for k in shard_k:
        src_layouts, owners = sources[k]
        keys = tree_keys(shard_k[k])
        plans = plan_transfer(keys, [x.shape for x in jax.tree.leaves(shape_k[k])], "bfloat16", src_layouts,
                              dst_layouts[k])
        recvs[k] = (WireReceiver(plans, jax.tree.leaves(shard_k[k])), owners, keys)
    server = jtransfer.start_transfer_server(jax.devices()[0].client, "127.0.0.1:0", ["127.0.0.1:0"])
    peers = {}
    while True:
        msg = conn.recv()
        if msg is None:
            return
        kind, uuid, addresses, sums = msg
        recv, owners, keys = recvs[kind]
        for addr in addresses:
            if addr not in peers:
                peers[addr] = server.connect(addr)
        t0 = time.perf_counter()
        out = recv.pull([peers[a] for a in addresses], uuid, 600, owners)
        t1 = time.perf_counter()
        verify(out, sums, keys, uuid)
        conn.send({"pull_s": t1 - t0, "verify_s": time.perf_counter() - t1, "shards": len(recv.specs),
                   "pulled_bytes": recv.nbytes, "sources": len(addresses)})


def role_single(args) -> None:
    import jax

    from jaxrl_async.sharding.mesh import make_mesh
    from jaxrl_async.models.shardings import model_shardings
    from jaxrl_async.generator.weight_sync import WeightPusher

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


def _run_role(role: str, args, devices: int, env: dict, extra: tuple = ()) -> subprocess.Popen:
    e = dict(env)
    e["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    e["JAX_PLATFORMS"] = "cpu"
    return subprocess.Popen([sys.executable, __file__, "--role", role, "--model", args.model, "--repeats",
                             str(args.repeats), "--port", str(args.port), "--scratch", args.scratch,
                             "--lora", str(args.lora), *extra],
                            env=e, stdout=subprocess.PIPE)


def _cross(args, env: dict, group: bool) -> list:
    """One generator process and the trainer (one process with 2 devices, or a group of 2 x 1)."""
    import tempfile

    from jaxrl_async.distributed.launch import free_port

    args.port = free_port()
    args.scratch = tempfile.mkdtemp(prefix="bench_push_")
    gen = _run_role("generator", args, 2, env)
    time.sleep(1.0)
    if group:
        coord = f"127.0.0.1:{free_port()}"
        trs = [_run_role("trainer", args, 1, env, ("--group-process", str(i), "--coordinator", coord))
               for i in range(2)]
    else:
        trs = [_run_role("trainer", args, 2, env)]
    rows = json.loads(trs[0].communicate(timeout=1800)[0].decode().strip().splitlines()[-1])
    for t in trs[1:]:
        t.wait(120)
    gen.wait(120)
    return rows


def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--role", default=None)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--scratch", default="")
    ap.add_argument("--group-process", type=int, default=None)
    ap.add_argument("--coordinator", default=None)
    ap.add_argument("--lora", type=int, default=0, help="rank R: push the base (full weights) and the rank-R "
                    "adapters alternately, one trainer process (no group / single-process modes)")
    args = ap.parse_args()
    if args.role:
        {"trainer": role_trainer, "generator": role_generator, "single": role_single}[args.role](args)
        return
    env = dict(os.environ, BENCH_KEY=secrets.token_hex(16))
    if args.lora:
        rows = _cross(args, env, group=False)
        out = {"model": args.model, "lora_rank": args.lora, "repeats": args.repeats}
        for kind in ("full", "adapters"):
            rs = [r for r in rows if r["kind"] == kind]
            first, rest = rs[0], rs[1:]
            out[kind] = {"bytes_bf16": first["bytes"], "pulled_bytes": first["pulled_bytes"],
                         "total_s": _median([r["total_s"] for r in rest]),
                         "prepare_checksum_s": _median([r["prepare_checksum_s"] for r in rest]),
                         "pull_s": _median([r["pull_s"] for r in rest]),
                         "verify_s": _median([r["verify_s"] for r in rest]), "shards": first["shards"]}
        print(json.dumps(out, indent=1))
        return
    cross = _cross(args, env, group=False)
    group = _cross(args, env, group=True)
    single = json.loads(_run_role("single", args, 4, env).communicate(timeout=1800)[0].decode().strip().splitlines()[-1])
    c, g, s = cross[1:], group[1:], single[1:]
    out = {"model": args.model, "bytes_bf16": cross[0]["bytes"], "routes_cross": cross[0]["routes"],
           "cross_process_s": _median([r["total_s"] for r in c]),
           "cross_prepare_checksum_s": _median([r["prepare_checksum_s"] for r in c]),
           "cross_pull_s": _median([r["pull_s"] for r in c]), "cross_verify_s": _median([r["verify_s"] for r in c]),
           "cross_shards": cross[0]["shards"],
           "group_s": _median([r["total_s"] for r in g]),
           "group_prepare_checksum_s": _median([r["prepare_checksum_s"] for r in g]),
           "group_pull_s": _median([r["pull_s"] for r in g]), "group_verify_s": _median([r["verify_s"] for r in g]),
           "group_sources": group[0]["sources"],
           "single_process_s": _median([r["total_s"] for r in s]),
           "routes_single": single[0]["routes"], "repeats": args.repeats}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
