"""The generator: the engine contract and the paged continuous-batching engine, driven by scheduler threads.

* ``engine_api``: the small engine contract (``Engine``, ``SamplingParams``, prefill / insert / decode);
* ``engine``: ``PagedEngine`` (paged KV cache, continuous batching, compaction), ``engine_steps`` its
  compiled programs, ``kv_cache`` the host-side page allocators and the pool's sizing, ``sampling`` the
  token sampler;
* ``factory``: the ONE way every caller (the run, ``generate``, ``evaluate``, the SFT warm start, tests,
  benchmarks) sizes and builds an engine;
* ``orchestrator``: ``Generator`` (the decode and stream threads over an engine), ``requests`` its public
  request and result types;
* ``weight_sync``: the trainer -> generator weight push.

Rollout logic (episodes, workflows, agents, admission and the staleness rule) is in ``jaxrl_async.rollout``;
the decode attention kernels behind the engine in ``jaxrl_async.kernels``.
"""
