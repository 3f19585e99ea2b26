"""A packed training row and a timed loop of real train steps, shared by the attention benchmarks (imports only the
trainer and the model, so it runs where the data layer's dependencies are not installed)."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_async.models.transformer import init_params
from jaxrl_async.trainer.packing import DEVICE_FIELDS, PackedBatch
from jaxrl_async.trainer.train_step import Trainer


def real_batch(T: int, seed: int = 0) -> PackedBatch:
    rng = np.random.default_rng(seed)
    n_seg = 4  # a packed row: four sequences, prompt then completion
    seg = np.repeat(np.arange(1, n_seg + 1), T // n_seg)
    seg = np.pad(seg, (0, T - seg.size)).astype(np.int32)
    pos = np.concatenate([np.arange((seg == s).sum()) for s in range(1, n_seg + 1)] + [np.zeros((seg == 0).sum())])
    loss = ((pos > 16) & (seg > 0)).astype(np.float32)
    f = {"tokens": rng.integers(3, 1000, T).astype(np.int32), "segment_ids": seg, "positions": pos.astype(np.int32),
         "loss_mask": loss, "behaviour_logprobs": (-rng.random(T) * loss).astype(np.float32),
         "advantages": (rng.standard_normal(T) * loss).astype(np.float32),
         "versions": np.where(loss > 0, 0, -1).astype(np.int32), "seq_ids": np.where(seg > 0, seg - 1, n_seg)}
    f["proximal_logprobs"] = f["behaviour_logprobs"]
    return PackedBatch(**{k: jnp.asarray(np.asarray(f[k])[None, None]) for k in DEVICE_FIELDS})


def run_steps(tr: Trainer, T: int, n: int) -> list[float]:
    params = jax.device_get(init_params(tr.model_cfg, jax.random.key(0)))
    state = tr.init_state(params)
    batch = real_batch(T)
    fn = tr._step_fn(5)
    times = []
    for _ in range(n + 1):  # the first call compiles
        t0 = time.perf_counter()
        state, m = fn(state, batch, jnp.float32(1000.0), jnp.int32(0))
        jax.block_until_ready(m["loss"])
        times.append(time.perf_counter() - t0)
    return times[1:]
