"""Worker of test_trainer_group: RL updates of a tiny model on a trainer mesh fsdp=2, either in one
process with 2 simulated CPU devices (``--single``) or as one SPMD program of 2 processes with 1
device each (``--coordinator ADDR --process-id I``: jax.distributed + gloo). Process 0 writes the
final parameters and the per-update losses to OUT (npz)."""
import argparse
import sys

import numpy as np

ap = argparse.ArgumentParser()
ap.add_argument("out")
ap.add_argument("--single", action="store_true")
ap.add_argument("--coordinator")
ap.add_argument("--process-id", type=int, default=0)
a = ap.parse_args()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 2 if a.single else 1)
jax.config.update("jax_default_matmul_precision", "highest")
if not a.single:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(a.coordinator, 2, a.process_id, heartbeat_timeout_seconds=30)
from jax.experimental import multihost_utils  # noqa: E402

from jaxrl_async.models.config import ModelConfig  # noqa: E402
from jaxrl_async.models.transformer import init_params  # noqa: E402
from jaxrl_async.sharding import make_mesh  # noqa: E402
from jaxrl_async.trainer import OptimizerConfig, PackingConfig, Trainer, TrainStepConfig, TrainSequence  # noqa: E402

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=8, rope_theta=10000.0)
ROW = 16


def trajs(seed, n=8):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        L = int(rng.integers(5, ROW + 1))
        mask = (np.arange(L) >= int(rng.integers(1, 4))).astype(np.int32)
        out.append(TrainSequence(tokens=rng.integers(0, CFG.vocab_size, L), loss_mask=mask,
                              behaviour_logprobs=np.where(mask > 0, -rng.uniform(0.5, 6.0, L), 0.0),
                              advantages=np.where(mask > 0, rng.normal(size=L), 0.0),
                              versions=np.where(mask > 0, seed, -1)))
    return out


mesh = make_mesh({"fsdp": 2}, devices=jax.devices())
cfg = TrainStepConfig(optimizer=OptimizerConfig(lr=1e-2, weight_decay=0.0, max_grad_norm=1.0), ppo_n_minibatches=2,
                    packing=PackingConfig(tokens_per_micro=2 * ROW, row_len_buckets=(ROW,), max_seqs_per_row=4))
trainer = Trainer(CFG, cfg, mesh)
state = trainer.init_state(jax.device_get(init_params(CFG, jax.random.key(0), 0.1)))
losses = []
for k in range(3):
    state, ms = trainer.train_batch(state, trajs(k), policy_version=k)
    losses += [float(m["loss"]) for m in ms]
leaves = jax.tree.leaves(state.params)
host = [np.asarray(x) for x in (jax.device_get(leaves) if a.single else multihost_utils.process_allgather(leaves, tiled=True))]
if jax.process_index() == 0:
    np.savez(a.out, losses=np.asarray(losses), **{f"p{i}": x for i, x in enumerate(host)})
print(f"process {jax.process_index()}: {jax.process_count()} process(es), losses {losses}", file=sys.stderr)
