"""What the roles of a run promise each other: contracts only (typing Protocols), no JAX at import time.

* ``api.generator``: ``GeneratorService`` (submit / abort / version / stats / error / start / stop),
  ``RequestHandle``, ``WeightPushService`` (push / wait / error / history / close) and
  ``GeneratorRole`` (starts the generator service and its pusher for a run);
* ``api.trainer``: ``TrainerService`` (build, restore or initial state, train a batch, params, save /
  wait / close checkpoints, export).

The loop (``jaxrl_async.loop``) is written against these only. The single-process run
(``loop.services``: a local trainer on the trainer mesh, a local ``Generator`` on the generator mesh)
and the multi-process run (``distributed.controller``: a trainer group whose every operation is sent
to the followers before it runs here, remote generator processes behind the RPC) are two sets of
implementations; the loop is never subclassed. The device engine's contract (one level down, what a
generator service drives) is ``rollout.engine_api``.
"""

from jaxrl_async.api.generator import GeneratorRole, GeneratorService, RequestHandle, WeightPushService
from jaxrl_async.api.trainer import TrainerService

__all__ = ["GeneratorRole", "GeneratorService", "RequestHandle", "TrainerService", "WeightPushService"]
