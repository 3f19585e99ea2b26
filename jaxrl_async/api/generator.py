"""The generator side's contracts: what the loop, the dispatcher, workflows and evaluation call.

Implementations: ``rollout.orchestrator.Generator`` (this process, continuous batching on the generator
mesh) and ``distributed.remote_generator.RemoteGenerator`` (generator processes over RPC); weight pushers
``weight_sync.WeightPusher`` and ``distributed.remote_generator.TransferPusher``.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence, runtime_checkable

__all__ = ["GeneratorRole", "GeneratorService", "RequestHandle", "WeightPushService"]


@runtime_checkable
class RequestHandle(Protocol):
    """One submitted request (all its samples)."""

    request_id: str

    def done(self) -> bool: ...

    def result(self, timeout: float | None = None) -> Any:
        """The request's result (``rollout.requests.RequestResult``: one sample per n, each with its
        completion ids, behaviour log-probs and the policy version of every token). Raises
        ``TimeoutError`` after ``timeout`` and ``GeneratorError`` when the generator failed."""

    def abort(self) -> None: ...


@runtime_checkable
class GeneratorService(Protocol):
    """Generation for the rollout: a request is submitted, runs under the newest weights the service
    holds, and reports per-token policy versions (a request that spans a weight update carries both)."""

    @property
    def version(self) -> int:
        """The policy version of the weights new tokens are decoded with."""

    @property
    def error(self) -> BaseException | None:
        """The first fatal failure (a dead decode thread, a lost generator process), else None."""

    def submit(self, prompt_ids: Sequence[int], sampling: Any = None, request_id: str | None = None,
               metadata: Any = None, *, images: Any = None) -> RequestHandle:
        """``images``: the prompt's images (`data.images.ImageInputs`) for a vision-language policy, else None."""

    def abort(self, request_id: str) -> None: ...

    def stats(self) -> Any:
        """Cumulative ``GeneratorStats`` (tokens, steps, slot utilisation, busy time, preemptions, version)."""

    def start(self) -> Any: ...

    def stop(self) -> None: ...


@runtime_checkable
class WeightPushService(Protocol):
    """Moves the trainer's weights to the generator(s), off the trainer thread.

    ``push(params, version)`` dispatches (the trainer may donate ``params`` right after) and returns
    the push's stats; the copy completes on the pusher's own thread, which then calls
    ``on_applied(version)`` once EVERY generator decodes with it (the staleness bound rests on that).
    A failed push is raised by the next ``push``/``wait`` and shown in ``error``."""

    history: list

    @property
    def error(self) -> BaseException | None: ...

    def push(self, params: Any, version: int) -> Any: ...

    def wait(self, version: int | None = None, timeout: float | None = None) -> None: ...

    def close(self, timeout: float = 30.0) -> None: ...


class GeneratorRole(Protocol):
    """How a run gets its generator service and pusher (local engine, or generator processes)."""

    def start(self, params: Any, version: int) -> GeneratorService:
        """The generator service for the trainer's ``params`` at policy ``version``: weights placed,
        engine compiled; not yet started (``start()`` is the loop's)."""

    def pusher(self, generator: GeneratorService, *, on_applied: Callable[[int], None], timeout_s: float,
               initial_version: int) -> WeightPushService: ...

    def close(self) -> None:
        """Release what ``start`` acquired beyond the generator service (called once, at the end)."""
