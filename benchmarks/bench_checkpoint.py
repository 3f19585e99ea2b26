"""Checkpoint save/restore timing on CPU for a mid-size Qwen3-shaped model + adamw state."""
import os
import tempfile
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ["JAX_PLATFORMS"] = "cpu"
import jax  # noqa: E402  (after the device count)
import numpy as np  # noqa: E402
import optax  # noqa: E402

from jaxrl_async.checkpoint import CheckpointConfig, Checkpointer, TrainMeta, abstract_like  # noqa: E402
from jaxrl_async.checkpoint.hf_export import export_checkpoint  # noqa: E402
from jaxrl_async.models import ModelConfig, param_shapes  # noqa: E402
from jaxrl_async.models.shardings import model_shardings  # noqa: E402
from jaxrl_async.sharding import make_mesh  # noqa: E402

cfg = ModelConfig(vocab_size=32768, hidden_size=768, intermediate_size=2048, num_layers=12, num_heads=12, num_kv_heads=4,
                  head_dim=64)
mesh = make_mesh({"fsdp": 4})
sh = model_shardings(cfg, mesh, "trainer")
rng = np.random.default_rng(0)
params = jax.device_put(jax.tree.map(lambda s: rng.standard_normal(s.shape, dtype=np.float32), param_shapes(cfg)), sh)
opt = optax.adamw(1e-4)
os_ = jax.jit(opt.init)(params)
os_ = jax.jit(lambda p, o: opt.update(p, o, p)[1])(params, os_)
nbytes = sum(x.nbytes for x in jax.tree.leaves((params, os_)))
print(f"params {cfg.num_params()/1e6:.1f}M, state {nbytes/2**30:.2f} GiB")
run = os.path.join(tempfile.mkdtemp(prefix="bench_ckpt_"), "run")
trajs = [{"completion_ids": list(range(1024)), "logprobs": [-0.5]*1024, "versions": [3]*1024, "reward": 1.0} for _ in range(256)]
ck = Checkpointer(run, CheckpointConfig(keep_last=2), model_config=cfg)
for step in (1, 2, 3):
    t = time.perf_counter()
    st = ck.save({"params": params, "opt_state": os_}, TrainMeta(step, step), trajectories=trajs)
    ck.wait()
    print(f"step {step}: blocking {st.blocking_s:.2f}s (waited {st.wait_s:.2f}s for previous), total {st.total_s:.2f}s, "
          f"{nbytes/2**30/st.total_s:.2f} GiB/s")
t = time.perf_counter()
r = ck.restore(targets={"params": abstract_like(params), "opt_state": abstract_like(os_)})
jax.block_until_ready(r.arrays)
print(f"restore (same mesh): {time.perf_counter()-t:.2f}s")
ck.close()
t = time.perf_counter()
export_checkpoint(run, os.path.join(os.path.dirname(run), "export"), dtype="bfloat16")
print(f"export bf16: {time.perf_counter()-t:.2f}s")
