"""`CompactSteps.start_all`'s compile order (an orchestration unit: the jitted steps are fakes that record their
lowering): a job that holds at most `max_live` slots gets the sizes it can use first, the larger ones last; with
multi-step decode, the K-step programs (the generator's usual dispatch) before the single-step ones."""
from __future__ import annotations

import jax.numpy as jnp

from jaxrl_async.generator.compaction import CompactSteps


class _Step:
    def __init__(self, order: list, k: int = 1):
        self.order, self.k = order, k

    def lower(self, params, arrays, new_pages, *rest):
        assert len(rest) == (2 if self.k > 1 else 1)  # (new_index,) rows
        self.order.append(rest[-1].shape[0] if self.k == 1 else (rest[-1].shape[0], self.k))
        return self

    def compile(self):
        return None


def _start(max_live, steps=(1,)):
    order: list = []
    cs = CompactSteps(lambda trunc, k: _Step(order, k), (32, 16, 8), 1, 64, None, in_background=False)
    x = jnp.zeros((64,), jnp.int32)
    cs.start_all({"w": jnp.zeros(2)}, {"a": x}, x, (False,), max_live, steps)
    for key in list(cs._programs):
        cs._programs[key].result(timeout=60)
    return order


def test_the_sizes_a_job_can_use_compile_first():
    assert _start(None) == [32, 16, 8]  # a job as large as the slots: the order the steps will need them
    assert _start(64) == [32, 16, 8]
    assert _start(16) == [16, 8, 32]  # 16 live at most: 16 first, then the tail's 8, the 32 for later jobs
    assert _start(3) == [8, 16, 32]
    assert _start(20) == [32, 16, 8]


def test_multi_step_programs_compile_before_the_single_step_ones():
    assert _start(16, steps=(8, 1)) == [(16, 8), (8, 8), (32, 8), 16, 8, 32]
