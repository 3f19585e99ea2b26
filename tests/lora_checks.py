"""Checks shared by the LoRA resume tests (tests/loop/test_lora_resume.py, tests/distributed/test_multiprocess_lora.py)."""
from __future__ import annotations

import numpy as np


def assert_adapter_only_training(final: dict, mid: dict, n_adapters: int = 14) -> None:
    """Two checkpoints of one LoRA run, as {keystr: array} of params and opt_state: between them the base stayed
    frozen, the adapters trained, and the checkpointed optimizer state is the adapters' only."""
    adapters = [k for k in final if k.startswith("['params']") and "_lora_" in k]
    base = [k for k in final if k.startswith("['params']") and "_lora_" not in k]
    assert len(adapters) == n_adapters and base
    assert all(np.array_equal(final[k], mid[k]) for k in base)  # frozen
    assert any(not np.array_equal(final[k], mid[k]) for k in adapters)  # trained
    opt = [k for k in final if k.startswith("['opt_state']") and final[k].ndim > 0]
    assert opt and all("_lora_" in k for k in opt)  # AdamW moments of the adapters only
