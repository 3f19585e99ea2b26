"""Test instrument: ``python -m jaxrl_async.main`` with hooks that record or inject what a test needs.

    python tests/loop/instrumented_main.py [--record-restore DIR] [--nan-advantages-from-batch K] -- [main args]

``--record-restore DIR`` wraps ``run_state.state_from_items`` (the one place a resumed run turns checkpoint
items into its ``TrainState``): right after the restore, every parameter leaf is written to
``DIR/restored_params.npz`` (keyed by ``jax.tree_util.keystr`` of its path) and the device ids and mesh
of each leaf's sharding to ``DIR/restored_shardings.json``, so a test can compare what a run resumed
onto another mesh holds with what the checkpoint stores.

``--nan-advantages-from-batch K`` makes the advantage of one token NaN in the K-th and every later
training batch (1-based), as a numerical blow-up would; run it with
``trainer.packing.check_finite=False`` so the batch reaches the train step's non-finite guard.

Everything else is ``main`` unchanged; the process exits with its status.
"""
import argparse
import json
import os
import sys


def _record_restore(out_dir: str) -> None:
    import jax
    import numpy as np

    from jaxrl_async.loop import state as run_state

    original = run_state.state_from_items

    def recording(items):
        state = original(items)
        arrays, shardings = {}, {}
        for path, leaf in jax.tree_util.tree_flatten_with_path(state.params)[0]:
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

    run_state.state_from_items = recording


def _nan_advantages(first_batch: int) -> None:
    import numpy as np

    from jaxrl_async.trainer.train_step import Trainer

    original = Trainer.train_batch
    calls = {"n": 0}

    def poisoned(self, state, trajectories, policy_version=0):
        calls["n"] += 1
        if calls["n"] >= first_batch:
            t = trajectories[0]
            adv = np.array(t.advantages, copy=True)
            adv[-1] = np.nan
            t.advantages = adv
        return original(self, state, trajectories, policy_version)

    Trainer.train_batch = poisoned


if __name__ == "__main__":
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(prog="instrumented_main.py")
    p.add_argument("--record-restore", default=None)
    p.add_argument("--nan-advantages-from-batch", type=int, default=None)
    args = p.parse_args(argv[:split])
    if args.record_restore:
        _record_restore(args.record_restore)
    if args.nan_advantages_from_batch:
        _nan_advantages(args.nan_advantages_from_batch)
    from jaxrl_async.cli.main import main

    sys.exit(main(argv[split + 1:]))
