"""Test instrument: run ``python -m jaxrl_async.main`` and record the training state the loop restored.

    python tests/loop/resume_probe.py OUT_DIR [main arguments ...]

Wraps ``rl_loop._state_from_items`` (the one place a resumed run turns checkpoint items into its
``TrainState``) so that, right after the restore, every parameter leaf is written to
``OUT_DIR/restored_params.npz`` (keyed by ``jax.tree_util.keystr`` of its path) and the device ids and
mesh of each leaf's sharding to ``OUT_DIR/restored_shardings.json``. Then runs ``main`` unchanged and
exits with its status, so a test can compare what a run resumed onto another mesh holds with what
the checkpoint stores.
"""
import json
import os
import sys


def _install(out_dir: str) -> None:
    import jax
    import numpy as np

    from jaxrl_async import rl_loop

    original = rl_loop._state_from_items

    def recording(items):
        state = original(items)
        flat = jax.tree_util.tree_flatten_with_path(state.params)[0]
        arrays, shardings = {}, {}
        for path, leaf in flat:
            key = jax.tree_util.keystr(path)
            arrays[key] = np.asarray(jax.device_get(leaf))
            mesh = getattr(leaf.sharding, "mesh", None)
            shardings[key] = {"devices": sorted(d.id for d in leaf.sharding.device_set),
                              "mesh": dict(mesh.shape) if mesh is not None else None}
        os.makedirs(out_dir, exist_ok=True)
        np.savez(os.path.join(out_dir, "restored_params.npz"), **arrays)
        with open(os.path.join(out_dir, "restored_shardings.json"), "w") as f:
            json.dump(shardings, f)
        return state

    rl_loop._state_from_items = recording


if __name__ == "__main__":
    _install(sys.argv[1])
    from jaxrl_async.main import main

    sys.exit(main(sys.argv[2:]))
