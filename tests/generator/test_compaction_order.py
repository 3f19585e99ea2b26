"""`CompactSteps.start_all`'s compile order (an orchestration unit: the jitted steps are fakes that record their
lowering): a job that holds at most `max_live` slots gets the sizes it can use first, the larger ones last."""
from __future__ import annotations

import jax.numpy as jnp

from jaxrl_async.generator.compaction import CompactSteps


class _Step:
    def __init__(self, order: list[int]):
        self.order = order

    def lower(self, params, arrays, new_pages, rows):
        self.order.append(rows.shape[0])
        return self

    def compile(self):
        return None


def _start(max_live):
    order: list[int] = []
    cs = CompactSteps({False: _Step(order)}, (32, 16, 8), 1, 64, None, in_background=False)
    x = jnp.zeros((64,), jnp.int32)
    cs.start_all({"w": jnp.zeros(2)}, {"a": x}, x, (False,), max_live)
    for key in list(cs._programs):
        cs._programs[key].result(timeout=60)
    return order


def test_the_sizes_a_job_can_use_compile_first():
    assert _start(None) == [32, 16, 8]  # a job as large as the slots: the order the steps will need them
    assert _start(64) == [32, 16, 8]
    assert _start(16) == [16, 8, 32]  # 16 live at most: 16 first, then the tail's 8, the 32 for later jobs
    assert _start(3) == [8, 16, 32]
    assert _start(20) == [32, 16, 8]
