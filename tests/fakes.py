"""Generator results for workflow / agent / evaluate unit tests that script the generator instead of
running an engine: the real ``SampleOutput`` / ``RequestOutput`` types, and a request handle that is
already done (or never finishes). ``tests/`` is on ``sys.path`` (its conftest), so any test imports
``from fakes import ...``."""
from __future__ import annotations

import time
from collections.abc import Sequence

from jaxrl_async.generator.orchestrator import RequestOutput, SampleOutput


def sample(sample_index: int, prompt_ids: Sequence[int], completion_ids: Sequence[int],
           logprobs: Sequence[float] | None = None, versions: Sequence[int] | None = None,
           finish_reason: str = "stop", text: str | None = None) -> SampleOutput:
    """A finished sample; log-probs default to -0.5 and versions to 0 per completion token."""
    n = len(completion_ids)
    return SampleOutput(sample_index, list(prompt_ids), list(completion_ids),
                        list(logprobs) if logprobs is not None else [-0.5] * n,
                        list(versions) if versions is not None else [0] * n,
                        finish_reason, text, submit_time=0.0, first_token_time=0.0, finish_time=0.0)


def request(samples: Sequence[SampleOutput], request_id: str = "r") -> RequestOutput:
    return RequestOutput(request_id, list(samples[0].prompt_ids) if samples else [], list(samples))


class DoneHandle:
    """A generator request handle: ``result`` returns ``out`` at once; ``never=True`` waits out the
    timeout and raises ``TimeoutError`` (a request that never finishes)."""

    def __init__(self, out: RequestOutput | None = None, never: bool = False):
        self.out, self.never, self.aborted = out, never, False

    def done(self) -> bool:
        return not self.never

    def result(self, timeout: float | None = None) -> RequestOutput:
        if self.never:
            time.sleep(timeout or 0)
            raise TimeoutError("not done")
        return self.out

    def abort(self) -> None:
        self.aborted = True
