"""The single-process run's services: ``LocalTrainer`` (``api.trainer.TrainerService`` on this process's
trainer mesh; also what every follower of a trainer group runs), ``LocalGenerators``
(``api.generator.GeneratorRole``: the continuous-batching ``Generator`` on this process's generator
mesh and the device-to-device ``WeightPusher``), and ``LocalServices``, which places both meshes and
builds the two. The multi-process set is ``distributed.controller.DistributedServices``."""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp

from jaxrl_async.loop import state as run_state
from jaxrl_async.config import RunConfig
from jaxrl_async.loop.control import RunControl
from jaxrl_async.loop.setup import Placement, RunSetup, local_placement
from jaxrl_async.loop.warm_start import WarmStart

__all__ = ["LocalTrainer", "LocalGenerators", "LocalServices"]


class LocalTrainer:
    """``TrainerService`` on ``mesh`` of this process: holds the ``TrainState``.

    ``writes_files``: the leader (or the only process) writes the Hugging Face export; a follower of a
    trainer group runs only the collective half (the restore)."""

    def __init__(self, cfg: RunConfig, run_dir: str, model_cfg: Any, mesh: Any, init_params: Any, *,
                 base_ref: Mapping[str, Any] | None, tokenizer_dir: str | None,
                 warm_start: Callable[[Any, Sequence[Any], Any], Any], writes_files: bool = True):
        self.cfg, self.run_dir, self.model_cfg, self.mesh = cfg, run_dir, model_cfg, mesh
        self.init_params, self.base_ref, self.tokenizer_dir = init_params, base_ref, tokenizer_dir
        self.warm_start, self.writes_files = warm_start, writes_files
        self.trainer = self.ckpt = self.state = None

    @classmethod
    def of_setup(cls, setup: RunSetup, warm_start: Callable[[Any, Sequence[Any], Any], Any]) -> "LocalTrainer":
        """The leader's (or only) trainer of a run's ``setup``."""
        return cls(setup.cfg, setup.run_dir, setup.model_cfg, setup.trainer_mesh, setup.init_params,
                   base_ref=setup.base_ref, tokenizer_dir=setup.tokenizer_dir, warm_start=warm_start)

    # -- build, restore, initial state ------------------------------------------------------------
    def build(self) -> None:
        from jaxrl_async.trainer.factory import build_trainer  # shared with `plan`: it compiles this trainer

        self.trainer = build_trainer(self.cfg, self.model_cfg, self.mesh)
        self.ckpt = run_state.build_checkpointer(self.cfg, self.run_dir, self.model_cfg, self.tokenizer_dir)

    @property
    def checkpointer(self) -> Any:
        return self.ckpt

    def latest_checkpoint(self) -> int | None:
        return self.ckpt.latest_committed_step()

    def restore(self) -> Any:
        r = run_state.restore_train_state(self.ckpt, self.trainer, self.init_params, base_ref=self.base_ref)
        self.state = run_state.state_from_items(r.arrays)  # (looked up here: a test instrument wraps it)
        self.init_params = None
        return r

    def initial_state(self, sft_examples: Sequence[Any] | None) -> None:
        params = self.init_params
        if sft_examples is not None and self.model_cfg.lora is not None:
            # LoRA: the warm start trains the base (all weights, the stand-in for a pretrained checkpoint);
            # RL then trains adapters on it (B = 0: the same function at the start of RL)
            from jaxrl_async.models import lora

            adapters, base = lora.split(params)
            params = lora.join(adapters, self.warm_start(base, sft_examples, self.model_cfg.replace(lora=None)))
        elif sft_examples is not None:
            params = self.warm_start(params, sft_examples, self.model_cfg)
        self.state = self.trainer.init_state(params)
        self.init_params = None

    # -- steps --------------------------------------------------------------------------------------
    @property
    def params(self) -> Any:
        return self.state.params

    def train(self, trajectories: Sequence[Any], policy_version: int) -> list[dict[str, Any]]:
        self.state, stats = self.trainer.train_batch(self.state, trajectories, policy_version=policy_version)
        return stats

    def state_consumed(self) -> bool:
        """True when a failed step left the held state's buffers donated (nothing left to save)."""
        return any(getattr(x, "is_deleted", lambda: False)() for x in jax.tree.leaves(self.state))

    # -- checkpoints and export -----------------------------------------------------------------------
    def save(self, meta: Any, buffered: Sequence[Mapping[str, Any]]) -> Any:
        if self.base_ref is not None:  # LoRA: the adapters are saved, the base is referenced
            meta.extra["lora_base"] = self.base_ref
        return self.ckpt.save(run_state.state_items(self.state, self.base_ref), meta, trajectories=list(buffered))

    def wait_checkpoint(self) -> None:
        self.ckpt.wait()

    def close_checkpoint(self) -> None:
        if self.ckpt is not None:
            self.ckpt.close()

    def export(self, step: int) -> Any:
        from jaxrl_async.checkpoint.hf_export import export_checkpoint, restore_for_export

        if not self.writes_files:
            return restore_for_export(self.ckpt, step)  # Orbax restores are collective; only the leader writes
        return export_checkpoint(self.ckpt, os.path.join(self.run_dir, "hf"), step=step)


class LocalGenerators:
    """``GeneratorRole``: the engine on this process's generator mesh (``generator.factory.run_engine``), the
    weights copied device-to-device, the ``Generator`` threads, and the ``WeightPusher`` onto it (LoRA:
    adapters only, onto the generator's base)."""

    def __init__(self, setup: RunSetup, say: Callable[[str], None]):
        self.setup, self.say = setup, say
        self.engine = self.lora_shardings = self.lora_base = None

    def start(self, params: Any, version: int) -> Any:
        from jaxrl_async.generator.factory import run_engine  # shared with `plan`: it compiles this engine
        from jaxrl_async.generator.orchestrator import Generator

        s, ro = self.setup, self.setup.cfg.rollout
        engine = run_engine(s.cfg, s.model_cfg, s.gen_mesh)
        gen_dtype = jnp.dtype(s.model_cfg.dtype)
        if s.model_cfg.lora is not None:
            gen_params = self._place_lora(params, engine)
        else:
            gen_params = jax.device_put(jax.tree.map(lambda x: x.astype(gen_dtype), params), engine.param_shardings,
                                        may_alias=False)
        t0 = time.monotonic()
        sa = ro.sampling  # the lean sampling programs only, unless the run's sampling truncates
        engine.warmup(gen_params, max_samples=ro.n_samples, truncation=sa.top_k > 0 or sa.top_p < 1.0)
        self.say(f"engine: {engine.max_concurrent_decodes} slots, {engine.num_pages} KV pages of "
                 f"{engine.page_size}; compiled in {time.monotonic() - t0:.1f} s")
        self.engine = engine
        return Generator(engine, gen_params, version=version, tokenizer=s.tokenizer,
                         kv_update_policy=ro.kv_update_policy, max_prefills_per_step=ro.engine.max_prefills_per_step)

    def _place_lora(self, params: Any, engine: Any) -> Any:
        """LoRA: the base (once) and the adapters on the generator devices; the engine gets them unmerged,
        or merged into a generator-side copy (``model.lora.decode``). Keeps the base for the pusher."""
        from jaxrl_async.models import lora
        from jaxrl_async.models.shardings import model_shardings

        model_cfg = self.setup.model_cfg
        gen_cfg = model_cfg.replace(param_dtype=model_cfg.dtype)  # base + adapters, generator dtype
        self.lora_shardings = model_shardings(gen_cfg, self.setup.gen_mesh, "generator")
        full = jax.device_put(jax.tree.map(lambda x: x.astype(jnp.dtype(gen_cfg.dtype)), params),
                              self.lora_shardings, may_alias=False)
        self.lora_base = lora.split(full)[1]
        if model_cfg.lora.decode == "unmerged":
            return full
        return jax.jit(lambda p: lora.merge(p, gen_cfg.lora), out_shardings=engine.param_shardings)(full)

    def pusher(self, generator: Any, *, on_applied: Callable[[int], None], timeout_s: float,
               initial_version: int) -> Any:
        from jaxrl_async.generator.weight_sync import LoraPush, WeightPusher

        model_cfg = self.setup.model_cfg
        dtype = jnp.dtype(model_cfg.dtype)
        if model_cfg.lora is not None:
            return WeightPusher(generator, self.lora_shardings, dtype=dtype, on_applied=on_applied,
                                timeout_s=timeout_s, initial_version=initial_version,
                                lora=LoraPush(model_cfg.lora, self.lora_base, model_cfg.lora.decode))
        return WeightPusher(generator, self.engine.param_shardings, dtype=dtype, on_applied=on_applied,
                            timeout_s=timeout_s, initial_version=initial_version)

    def close(self) -> None:
        pass


class LocalServices:
    """Both roles in this process (the default of ``RLRun``)."""

    def place(self, cfg: RunConfig, control: RunControl) -> Placement:
        return local_placement(cfg, control.say)

    def after_setup(self, setup: RunSetup, control: RunControl) -> None:
        """Fail fast: an engine whose KV pool cannot fit even now (before the trainer's state, the SFT warm start
        and the compilations) is one line naming ``rollout.engine.*`` (``EngineSizingError``, exit 2) here, not
        minutes later. The engine is built again, sized from the memory left then, when the generator starts."""
        from jaxrl_async.generator.factory import run_engine

        run_engine(setup.cfg, setup.model_cfg, setup.gen_mesh)

    def trainer(self, setup: RunSetup, control: RunControl) -> LocalTrainer:
        return LocalTrainer.of_setup(setup, WarmStart(setup.cfg, setup.trainer_mesh, control))

    def generators(self, setup: RunSetup, control: RunControl) -> LocalGenerators:
        return LocalGenerators(setup, control.say)

    def close(self) -> None:
        pass
