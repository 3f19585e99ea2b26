"""Implementation switches and the kernels behind them, importing nothing from ``models/``:

* ``attention``: training / scoring / prefill attention (``model.attention``: xla, blockwise, splash,
  gpu_flash, auto; rows split over ``context``) and its ``resolve_attention``; the portable
  implementations in ``flash``, the Pallas TPU / Pallas-Triton kernels and context parallelism in
  ``attention_pallas``;
* ``platform``: ``kernel_platform`` (the one copy) and ``at_precision``.

* ``paged_attention``: decode attention over the paged KV pool (``PagedEngine(attention=...)``: gather, blocked,
  cpu_paged, tpu_ragged, gpu_paged, auto) and its ``resolve``, with the pool layout each implementation reads; the
  portable implementations, the pool's spec and the prefill attention that fills the pool in ``paged``; the CPU
  kernels (C++ behind XLA FFI calls, built on first use: the decode attention and the few-row layer matmul) in
  ``cpu_kernels`` and ``cpu/*.cc``;
* ``grouped_matmul``: the mixture-of-experts grouped matmul (``model.moe_kernel``: ragged, tiled, megablox,
  auto) and its ``grouped_matmul_impl``.
"""
