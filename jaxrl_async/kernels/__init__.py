"""Implementation switches and the kernels behind them, importing nothing from ``models/``:

* ``attention``: training / scoring / prefill attention (``model.attention``: xla, blockwise, splash,
  gpu_flash, auto; rows split over ``context``) and its ``resolve_attention``; the portable
  implementations in ``flash``, the Pallas TPU / Pallas-Triton kernels and context parallelism in
  ``attention_pallas``;
* ``platform``: ``kernel_platform`` (the one copy) and ``at_precision``.

The decode attention over the paged KV cache is switched in ``rollout/paged_attention.py`` (its layouts are
the KV cache's) and the grouped matmul of mixture-of-experts layers in ``models/moe.py``.
"""
