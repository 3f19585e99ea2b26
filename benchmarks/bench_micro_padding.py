"""Cost of the empty micro-batches that round a minibatch up to its micro-batch bucket (issue #15).

A long-tail batch packs into 5 real micro-batches; the default `n_micro_buckets` (powers of two) pads it
to 8. The script times `Trainer.train_batch` (recompute proximal + one update) on that batch, and on the
same trajectories with `n_micro_buckets=(5,)` (no padding), side by side. With empty micro-batches skipped
(`lax.cond`) the two take the same time; when they ran a full forward/backward, 8/5 of it.

    PYTHONPATH=<tree> python benchmarks/bench_micro_padding.py     # run it against any checkout
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import jax
import numpy as np

from jaxrl_async.models.config import ModelConfig
from jaxrl_async.models.transformer import init_params
from jaxrl_async.trainer.packing import PackingConfig, TrainSequence
from jaxrl_async.trainer.train_step import Trainer, TrainStepConfig


def trajectories(seed: int = 0) -> list[TrainSequence]:
    rng = np.random.default_rng(seed)
    out = []
    for n in [500, 480, 470, 450, 300]:  # 5 rows of 512 tokens, one row per micro-batch
        p = 12
        mask = np.r_[np.zeros(p), np.ones(n - p)].astype(np.int32)
        out.append(TrainSequence(tokens=rng.integers(3, 1000, n).astype(np.int32), loss_mask=mask,
                              behaviour_logprobs=(-rng.random(n) * mask).astype(np.float32),
                              advantages=(rng.standard_normal(n) * mask).astype(np.float32)))
    return out


def main() -> int:
    cfg = ModelConfig(vocab_size=1024, hidden_size=256, intermediate_size=768, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=64, max_position_embeddings=2048)
    params = jax.device_get(init_params(cfg, jax.random.key(0)))
    trajs = trajectories()
    res = {}
    trainers = {name: Trainer(cfg, TrainStepConfig(packing=PackingConfig(tokens_per_micro=512, row_len_buckets=(512,),
                                                                        n_micro_buckets=buckets)))
                for name, buckets in (("padded_to_8", None), ("exact_5", (5,)))}
    states = {k: t.init_state(params) for k, t in trainers.items()}
    for name, t in trainers.items():
        print(name, "micro-batches:", t.pack(trajs).n_micro, "real:", t.pack(trajs).n_real_micro, file=sys.stderr)
    times = {k: [] for k in trainers}
    for rep in range(7):
        for k, t in trainers.items():
            t0 = time.perf_counter()
            states[k], m = t.train_batch(states[k], trajs)
            jax.block_until_ready(m[-1]["loss"])
            if rep:  # the first call compiles
                times[k].append(time.perf_counter() - t0)
    for k, v in times.items():
        res[k] = statistics.median(v)
    res["ratio_padded_over_exact"] = res["padded_to_8"] / res["exact_5"]
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
