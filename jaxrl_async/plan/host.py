"""What a run needs on THIS machine (a laptop CPU above all): memory per role and a rough time per RL step.

``main --dry-run`` prints it on a CPU-only machine, before a user waits minutes for a first step:

* memory: the trainer holds fp32 master weights, their gradients and Adam's two moments (16 bytes per trained
  parameter; a LoRA run's frozen base in ``model.lora.base_dtype``), the generator its weights in the compute
  dtype, room for one weight push and a KV pool of every slot at full length (the auto-sizing cap); on one host
  the two add up, against the RAM available now;
* time: the model FLOPs of one step (``trainer/flops.py``, MaxText's count) at the matmul rate measured here in
  the compute dtype (a [256, D] x [D, D] product, best of a few), plus decode's memory traffic (every decode step
  reads all weights once) at the copy bandwidth measured here. Generation: ``batch_size x n_samples`` sequences
  of up to ``max_sequence_length`` tokens (an upper bound: sequences that stop early cost less); training: a
  forward and backward pass over the same tokens, plus the proximal log-prob pass. A rough figure (decode with
  few slots, Python overhead and compilation are not in it): the order of magnitude a user needs.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

GIB = 1 << 30

__all__ = ["host_estimate", "format_host_estimate", "measure_rates"]


def measure_rates(dtype: str, width: int) -> tuple[float, float]:
    """(matmul FLOP/s in ``dtype`` for a [256, width] x [width, width] product, host copy bytes/s), measured here."""
    import jax
    import jax.numpy as jnp

    n = max(256, min(int(width), 2048))
    a = jnp.ones((256, n), dtype)
    b = jnp.ones((n, n), dtype)
    f = jax.jit(lambda x, y: x @ y)
    f(a, b).block_until_ready()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        f(a, b).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    rate = 2.0 * 256 * n * n / best
    buf = np.ones(32 << 20, np.uint8)
    best_copy = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        buf.copy()
        best_copy = min(best_copy, time.perf_counter() - t0)
    return rate, 2.0 * buf.nbytes / best_copy  # a copy reads and writes


def host_estimate(cfg: Any, model_cfg: Any, *, rates: tuple[float, float] | None = None) -> dict[str, Any]:
    """Memory (bytes) per role and seconds per RL step of ``cfg`` (a RunConfig) with ``model_cfg`` on this host."""
    from jaxrl_async.generator.kv_cache import host_available_bytes
    from jaxrl_async.trainer.flops import forward_flops, train_step_flops

    item = np.dtype(model_cfg.dtype).itemsize if model_cfg.dtype != "bfloat16" else 2
    n_params = model_cfg.num_params()
    lora = model_cfg.lora
    if lora is not None:
        import jax

        from jaxrl_async.models import lora as lora_lib
        from jaxrl_async.models.transformer import param_shapes

        adapters, _ = lora_lib.split(param_shapes(model_cfg))
        trained = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(adapters))
        base_item = 2 if lora.base_dtype == "bfloat16" else 4
        trainer = (n_params - trained) * base_item + 16 * trained
        push = trained * item
    else:
        trainer = 16 * n_params
        push = n_params * item
    e = cfg.rollout.engine
    kv_per_token = 2 * model_cfg.num_layers * model_cfg.num_kv_heads * model_cfg.head_dim * item
    kv = e.max_concurrent_decodes * e.max_sequence_length * kv_per_token
    available = host_available_bytes()
    auto_sized = False
    if e.num_pages is not None:
        kv = e.num_pages * e.page_size * kv_per_token
    else:  # sized at start (generator.kv_cache on CPU): the generator device's share of the RAM after its weights
        devices = max(1, cfg.mesh.cpu_devices or 1)
        room = int((available // devices - n_params * item - push) * e.cache_memory_fraction)
        if room < kv:
            kv, auto_sized = max(room, e.max_sequence_length * kv_per_token), True
    generator = n_params * item + push + kv
    seqs = cfg.trainer.batch_size * cfg.rollout.n_samples
    seq = e.max_sequence_length
    rate, bandwidth = rates or measure_rates(model_cfg.dtype, model_cfg.hidden_size)
    gen_flops = forward_flops(model_cfg, seqs, seq)
    # decode: one step per new token, each reading every weight once (slots decode together)
    steps = -(-seqs // e.max_concurrent_decodes) * cfg.rollout.sampling.max_new_tokens
    gen_s = max(gen_flops / rate, steps * n_params * item / bandwidth)
    train_flops = train_step_flops(model_cfg, seqs, seq)["total"] + forward_flops(model_cfg, seqs, seq)
    train_s = train_flops / rate
    sft = cfg.trainer.sft
    sft_s = (train_step_flops(model_cfg, sft.batch_size, seq)["total"] / rate * sft.steps) if sft.steps > 0 else 0.0
    return {"available_bytes": available, "kv_auto_sized": auto_sized, "trainer_bytes": int(trainer),
            "generator_bytes": int(generator),
            "kv_bytes": int(kv), "params": int(n_params), "dtype": model_cfg.dtype, "matmul_flops_per_s": rate,
            "copy_bytes_per_s": bandwidth, "generation_s": gen_s, "training_s": train_s,
            "step_s": gen_s + train_s, "sft_s": sft_s, "sequences": seqs, "sequence_length": seq,
            "slots": e.max_concurrent_decodes}


def _size(b: float) -> str:
    return f"{b / GIB:.2f} GiB" if b >= GIB else f"{b / (1 << 20):.0f} MiB"


def _secs(t: float) -> str:
    return f"~{t:.0f} s" if t >= 10 else f"~{t:.1f} s" if t >= 0.1 else "< 0.1 s"


def format_host_estimate(r: dict[str, Any], *, cores: int | None = None) -> str:
    """Two or three lines for a person."""
    need = r["trainer_bytes"] + r["generator_bytes"]
    fits = need <= r["available_bytes"]
    head = f"on this machine (CPU{f', {cores} cores' if cores else ''}, {_size(r['available_bytes'])} available)"
    lines = [
        f"{head}: trainer ~{_size(r['trainer_bytes'])} (fp32 weights, gradients, Adam), generator "
        f"~{_size(r['generator_bytes'])} ({r['dtype']} weights, a push's room, KV {_size(r['kv_bytes'])} "
        + (f"sized to the RAM left, less than {r['slots']} slots x {r['sequence_length']} tokens: pages are taken "
           "as sequences grow, and sequences wait when they run out" if r.get("kv_auto_sized") else
           f"for {r['slots']} slots x {r['sequence_length']} tokens") + f"): {_size(need)} together, "
        + ("fits" if fits else "DOES NOT FIT: lower rollout.engine.max_concurrent_decodes / max_sequence_length, "
           "use LoRA (model.lora.rank) or a smaller model"),
        f"rough time per RL step: {_secs(r['step_s'])} (generation {_secs(r['generation_s'])} for "
        f"{r['sequences']} sequences of up to {r['sequence_length']} tokens, training {_secs(r['training_s'])}) at "
        f"{r['matmul_flops_per_s'] / 1e9:.0f} GFLOP/s ({r['dtype']} matmul) and {r['copy_bytes_per_s'] / 1e9:.1f} GB/s "
        "measured here; a lower bound of the order of magnitude (no Python overhead, no compilation)"]
    if r["sft_s"] > 0:
        lines.append(f"the SFT warm start: {_secs(r['sft_s'])} at the same rate")
    return "\n".join(lines)
