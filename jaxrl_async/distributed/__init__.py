"""Multi-process execution: the roles of ``rl_loop.RLLoop`` in separate processes (hosts).

* ``controller``: controller + trainer process (``DistributedRLLoop``: the single-process loop with
  its generator hooks replaced by a remote generator and a cross-process pusher);
* ``generator_role``: a generator process (engine + ``Generator`` on its own devices) serving the
  controller over ``rpc``;
* ``rpc`` (+ ``tls``, ``codec``): calls between role processes over mutual TLS keyed by the run's
  secret, messages in msgpack (no pickle);
* ``transfer``: weights device-to-device across processes with ``jax.experimental.transfer``
  (per-shard wire plan, checksums, disk fallback);
* ``launch``: starts and supervises the roles on one host. Multi-host launch: ``docs/launch.md``.
"""
