"""Multi-process execution: the roles of a run (``loop.RLRun``) in separate processes (hosts).

* ``controller``: controller + trainer process (``DistributedServices``: the same loop given a remote
  generator role (``RemoteGenerators``: ``RemoteGenerator`` + cross-process ``TransferPusher``) and,
  for a trainer over several processes, a ``GroupTrainer``);
* ``trainer_group``: the other processes of a trainer group (``TrainerFollower``: the leader's
  operations on their own ``loop.services.LocalTrainer``);
* ``generator_role``: a generator process (engine + ``Generator`` on its own devices) serving the
  controller over ``rpc``;
* ``rpc`` (+ ``tls``, ``codec``): calls between role processes over mutual TLS keyed by the run's
  secret, messages in msgpack (no pickle);
* ``transfer``: weights device-to-device across processes with ``jax.experimental.transfer``
  (per-shard wire plan, checksums, disk fallback);
* ``launch``: starts and supervises the roles on one host; ``ray_launch`` (+ ``role_host``, the actor that runs a
  role process on a node): the same on a Ray cluster (the ``ray`` extra). SLURM and TPU pods: ``docs/launch.md``.
"""
