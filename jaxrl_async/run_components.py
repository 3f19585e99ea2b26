"""The run's components, built by ``RLLoop`` (``rl_loop.py``) before it trains: devices and meshes, tokenizer
and data, the model and its initial parameters, and the builders the loop calls (trainer, engine, workflow,
generator, weight pusher, checkpointer), plus the held-out evaluation. Each builder is one method, so that
the multi-process controller (``distributed/controller.py``) overrides exactly the step it runs elsewhere.
"""

from __future__ import annotations

import concurrent.futures as cf
import importlib
import inspect
import logging
import os
import time
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_async.config import resolve_device_split
from jaxrl_async.run_state import (
    base_reference, build_checkpointer, initial_params,
    restore_train_state,
)

log = logging.getLogger("jaxrl_async")


def _import_string(spec: str, what: str) -> Any:
    mod, _, attr = spec.partition(":")
    try:
        return getattr(importlib.import_module(mod), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{what}: cannot import {spec!r}: {e}") from e


class RunComponentsMixin:
    """``RLLoop``'s setup and builders (see the module docstring)."""

    # -- setup ------------------------------------------------------------------------------
    def _setup_devices(self) -> None:
        from jaxrl_async.config import _resolve_shape
        from jaxrl_async.sharding.mesh import make_mesh

        m = self.cfg.mesh
        devs = jax.devices()
        self.gen_ids, self.trainer_ids = resolve_device_split(m, len(devs))
        self.colocated = set(self.gen_ids) & set(self.trainer_ids) != set()
        g_shape = _resolve_shape(m.generator.shape, len(self.gen_ids), "mesh.generator.shape")
        t_shape = _resolve_shape(m.trainer.shape, len(self.trainer_ids), "mesh.trainer.shape")
        self.gen_mesh = make_mesh(g_shape, m.generator.axis_names, devices=[devs[i] for i in self.gen_ids])
        self.trainer_mesh = make_mesh(t_shape, m.trainer.axis_names, devices=[devs[i] for i in self.trainer_ids])
        self._say(f"devices: {len(devs)} x {devs[0].platform}; generator mesh {dict(self.gen_mesh.shape)} on "
                  f"{list(self.gen_ids)}, trainer mesh {dict(self.trainer_mesh.shape)} on {list(self.trainer_ids)}"
                  + (" (colocated: time-shared)" if self.colocated else ""))

    def _attention_choice(self) -> dict[str, str]:
        """What ``model.attention`` resolves to on the trainer's platform, per packing row bucket
        (logged and recorded in ``config.json``)."""
        from jaxrl_async.models.attention import resolve_attention

        platform = self.trainer_mesh.devices.flat[0].platform
        impl = self.model_cfg.attention
        choice = {str(T): resolve_attention(impl, T, platform) for T in self.cfg.trainer.packing.row_len_buckets}
        log.info(f"attention: model.attention={impl} on {platform}: "
                  + ", ".join(f"{name} for {T}-token rows" for T, name in choice.items()))
        return choice

    def _setup_tokenizer_and_data(self) -> None:
        from transformers import AutoTokenizer

        from jaxrl_async.data import DatasetConfig, build_tokenizer, load_prompt_dataset, write_arithmetic_dataset

        c = self.cfg
        tok_dir = c.model.tokenizer_path or c.model.path
        if tok_dir is None:
            tok_dir = os.path.join(self.run_dir, "tokenizer_src")
            if not os.path.isfile(os.path.join(tok_dir, "tokenizer.json")):
                build_tokenizer(tok_dir, kind=c.data.tokenizer_kind)
        from jaxrl_async.cli import has_tokenizer_files
        from jaxrl_async.config import ConfigError

        if not has_tokenizer_files(tok_dir):  # AutoTokenizer would invent an empty one (EOS id 0)
            field = "model.tokenizer_path" if c.model.tokenizer_path else "model.path"
            raise ConfigError(field, f"{tok_dir} has no tokenizer files (tokenizer.json / tokenizer_config.json / "
                                     "vocabulary); set model.tokenizer_path to a directory that has them")
        self.tokenizer_dir = tok_dir
        self.tokenizer = AutoTokenizer.from_pretrained(tok_dir)
        if c.data.task == "arithmetic":
            paths = write_arithmetic_dataset(os.path.join(self.run_dir, "data"), c.data.arithmetic)
            train_path, eval_path, fmt = paths["train"], paths["eval"], "generic"
        else:
            train_path, eval_path, fmt = c.data.train_path, c.data.eval_path, c.data.format
        common = dict(format=fmt, max_prompt_len=c.data.max_prompt_len, apply_chat_template=c.data.apply_chat_template,
                      system_prompt=c.data.system_prompt, prompt_suffix=c.data.prompt_suffix,
                      skip_bad_rows=c.data.skip_bad_rows)
        self.train_ds = load_prompt_dataset(DatasetConfig(path=train_path, **common), self.tokenizer)
        if len(self.train_ds) == 0:
            raise ValueError(f"data.train_path: {train_path} has no usable prompt (all filtered or empty)")
        self.eval_records = []
        if eval_path is not None:
            self.eval_records = load_prompt_dataset(DatasetConfig(path=eval_path, **common), self.tokenizer).records
            if c.eval.max_items is not None:
                self.eval_records = self.eval_records[: c.eval.max_items]
        self._say(f"data: {len(self.train_ds)} train prompts ({train_path}), {len(self.eval_records)} held-out")

    def _setup_model(self) -> None:
        c = self.cfg
        tok = self.tokenizer
        if c.model.path is not None:
            self.model_cfg, params = initial_params(c, mesh=self.trainer_mesh)
        else:
            self.model_cfg = c.model.model_config(len(tok), bos_token_id=tok.bos_token_id,
                                                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
            _, params = initial_params(c, self.model_cfg)
        if self.model_cfg.vocab_size < len(tok):
            raise ValueError(f"model.path: vocabulary {self.model_cfg.vocab_size} is smaller than the tokenizer's "
                             f"{len(tok)}")
        self.init_params = params
        # LoRA on an unchanged model.path: checkpoints hold the adapters and refer to the base
        self._base_ref = base_reference(c, self.model_cfg)
        from jaxrl_async.generate import stop_token_ids

        self.eos_ids = stop_token_ids(self.model_cfg, tok, model_dir=c.model.path)
        if not self.eos_ids:
            raise ValueError("model/tokenizer define no EOS token: generation could never stop before max_new_tokens")

    # -- components -------------------------------------------------------------------------
    def _sft_examples(self) -> list[Any]:
        from jaxrl_async.trainer.sft import SFTExample

        ex = []
        for r in self.train_ds.records:
            comp = (r.metadata or {}).get("completion")
            if comp is None:
                raise ValueError(f"trainer.sft.steps > 0 needs gold completions: row {r.metadata.get('source')} of the "
                                 "train data has no 'completion' column")
            ids = self.tokenizer.encode(comp + (self.tokenizer.eos_token or ""), add_special_tokens=False)
            ex.append(SFTExample(prompt_ids=list(r.prompt_ids), completion_ids=ids))
        return ex

    def _build_trainer(self):
        from jaxrl_async.components import build_trainer  # shared with `plan`: it compiles this trainer

        return build_trainer(self.cfg, self.model_cfg, self.trainer_mesh)

    def _build_engine(self):
        from jaxrl_async.components import build_engine  # shared with `plan`: it compiles this engine

        return build_engine(self.cfg, self.model_cfg, self.gen_mesh)

    def _build_workflow(self, reward_fn):
        from jaxrl_async.rollout.workflow import RLVRWorkflow, RolloutWorkflow

        spec = self.cfg.rollout.workflow
        if spec == "rlvr":
            return RLVRWorkflow(reward_fn, self.tokenizer)
        cls = _import_string(spec, "rollout.workflow")
        if not (isinstance(cls, type) and issubclass(cls, RolloutWorkflow)):
            raise ValueError(f"rollout.workflow: {spec!r} is not a RolloutWorkflow subclass")
        params = inspect.signature(cls).parameters
        kw = {k: v for k, v in (("tokenizer", self.tokenizer), ("reward_fn", reward_fn)) if k in params}
        return cls(**kw)

    # -- the generator role (hooks: ``jaxrl_async.distributed.controller`` runs it in other processes) --
    def _start_generator(self, params: Any, version: int) -> Any:
        """The generator for ``params`` (trainer layout, policy ``version``): engine on the generator
        mesh, weights copied device-to-device, compiled; returns an unstarted ``Generator``. A
        multi-process run overrides this (and ``_build_pusher``) with a remote generator; the rest of
        the loop only uses the ``Generator`` interface (submit/stats/error/start/stop)."""
        from jaxrl_async.rollout.orchestrator import Generator

        ro = self.cfg.rollout
        engine = self._build_engine()
        gen_dtype = jnp.dtype(self.model_cfg.dtype)
        if self.model_cfg.lora is not None:
            gen_params = self._place_lora_generator_params(params, engine)
        else:
            gen_params = jax.device_put(jax.tree.map(lambda x: x.astype(gen_dtype), params), engine.param_shardings,
                                        may_alias=False)
        t0 = time.monotonic()
        sa = ro.sampling  # the lean sampling programs only, unless the run's sampling truncates
        engine.warmup(gen_params, max_samples=ro.n_samples, truncation=sa.top_k > 0 or sa.top_p < 1.0)
        self._say(f"engine: {engine.max_concurrent_decodes} slots, {engine.num_pages} KV pages of "
                  f"{engine.page_size}; compiled in {time.monotonic() - t0:.1f} s")
        self._engine = engine
        return Generator(engine, gen_params, version=version, tokenizer=self.tokenizer,
                         kv_update_policy=ro.kv_update_policy, max_prefills_per_step=ro.engine.max_prefills_per_step)

    def _place_lora_generator_params(self, params: Any, engine: Any) -> Any:
        """LoRA: the base (once) and the adapters on the generator devices; the engine gets them unmerged,
        or merged into a generator-side copy (``model.lora.decode``). Keeps the base for the pusher."""
        from jaxrl_async.models import lora
        from jaxrl_async.sharding.rules import model_shardings

        gen_cfg = self.model_cfg.replace(param_dtype=self.model_cfg.dtype)  # base + adapters, generator dtype
        self._lora_shardings = model_shardings(gen_cfg, self.gen_mesh, "generator")  # base + adapters
        full = jax.device_put(jax.tree.map(lambda x: x.astype(jnp.dtype(gen_cfg.dtype)), params),
                              self._lora_shardings, may_alias=False)
        self._lora_base = lora.split(full)[1]
        if self.model_cfg.lora.decode == "unmerged":
            return full
        return jax.jit(lambda p: lora.merge(p, gen_cfg.lora), out_shardings=engine.param_shardings)(full)

    def _build_pusher(self, generator: Any, *, on_applied: Callable[[int], None], timeout_s: float,
                      initial_version: int) -> Any:
        """The weight pusher onto the generator of ``_start_generator`` (``weight_sync.WeightPusher``;
        LoRA: adapters only, onto the generator's base)."""
        from jaxrl_async.weight_sync import LoraPush, WeightPusher

        if self.model_cfg.lora is not None:
            return WeightPusher(generator, self._lora_shardings, dtype=jnp.dtype(self.model_cfg.dtype),
                                on_applied=on_applied, timeout_s=timeout_s, initial_version=initial_version,
                                lora=LoraPush(self.model_cfg.lora, self._lora_base, self.model_cfg.lora.decode))
        return WeightPusher(generator, self._engine.param_shardings, dtype=jnp.dtype(self.model_cfg.dtype),
                            on_applied=on_applied, timeout_s=timeout_s, initial_version=initial_version)

    # -- trainer-side operations (hooks: a multi-process trainer group runs each on every process) --
    def _initial_state(self, trainer: Any) -> Any:
        """Fresh training state: ``init_params`` (+ the SFT warm start when ``trainer.sft.steps > 0``)."""
        params = self.init_params
        if self.cfg.trainer.sft.steps > 0 and self.model_cfg.lora is not None:
            # LoRA: the warm start trains the base (all weights, the stand-in for a pretrained checkpoint);
            # RL then trains adapters on it (B = 0: the same function at the start of RL)
            from jaxrl_async.models import lora

            adapters, base = lora.split(params)
            params = lora.join(adapters, self._warm_start(base, self._sft_examples(),
                                                          model_cfg=self.model_cfg.replace(lora=None)))
        elif self.cfg.trainer.sft.steps > 0:
            params = self._warm_start(params, self._sft_examples())
        return self._init_state(trainer, params)

    def _init_state(self, trainer: Any, params: Any) -> Any:
        return trainer.init_state(params)

    def _restore_checkpoint(self, ckpt: Any, trainer: Any) -> Any:
        """The newest usable checkpoint restored onto the trainer's shardings (``Restored``)."""
        return restore_train_state(ckpt, trainer, self.init_params, base_ref=getattr(self, "_base_ref", None))

    def _train_batch(self, trainer: Any, state: Any, trajs: Sequence[Any], version: int) -> tuple[Any, list]:
        return trainer.train_batch(state, trajs, policy_version=version)

    def _save_checkpoint(self, ckpt: Any, arrays: Mapping[str, Any], meta: Any, buffered: list) -> Any:
        return ckpt.save(arrays, meta, trajectories=buffered)

    def _build_checkpointer(self) -> Any:
        return build_checkpointer(self.cfg, self.run_dir, self.model_cfg, self.tokenizer_dir)

    def _wait_checkpoint(self, ckpt: Any) -> None:
        ckpt.wait()

    def _close_checkpoint(self, ckpt: Any) -> None:
        ckpt.close()

    def _export(self, ckpt: Any, step: int) -> Any:
        from jaxrl_async.export import export_checkpoint

        return export_checkpoint(ckpt, os.path.join(self.run_dir, "hf"), step=step)

    # -- evaluation ---------------------------------------------------------------------------
    def evaluate(self, generator: Any, reward_fn: Any, pool: cf.Executor, version: int,
                 stop: Callable[[], bool] | None = None) -> dict[str, Any]:
        """Greedy (eval.temperature) pass@1 on the held-out records with the generator's current weights
        ({} when there are none, or when ``stop()`` became true while waiting: the evaluation is abandoned)."""
        ev, sa = self.cfg.eval, self.cfg.rollout.sampling
        if not self.eval_records:
            return {}
        t0 = time.monotonic()
        sp = sa.params(n=1, seed=self.cfg.seed, stop_token_ids=self.eos_ids, temperature=ev.temperature,
                       max_new_tokens=ev.max_new_tokens or sa.max_new_tokens)
        handles = [generator.submit(r.prompt_ids, sp, request_id=f"eval-v{version}-{i}")
                   for i, r in enumerate(self.eval_records)]
        timeout = self.cfg.rollout.group_timeout_s or 600.0
        rewards, lengths, versions = [], [], set()
        futures = []
        for r, h in zip(self.eval_records, handles):
            deadline = time.monotonic() + timeout
            while True:
                try:
                    s = h.result(min(1.0, max(deadline - time.monotonic(), 0.01))).samples[0]
                    break
                except TimeoutError:
                    if stop is not None and stop():
                        return {}
                    if time.monotonic() > deadline:
                        raise
            text = s.text if s.text is not None else self.tokenizer.decode(s.completion_ids, skip_special_tokens=True)
            futures.append(pool.submit(reward_fn, r.prompt, text, r.answer))
            lengths.append(len(s.completion_ids))
            versions.update(s.versions)
        rewards = [f.result(timeout) for f in futures]
        acc = float(np.mean(np.asarray(rewards) > 0.5))
        return {"eval/accuracy": acc, "eval/reward_mean": float(np.mean(rewards)), "eval/n": len(rewards),
                "eval/length_mean": float(np.mean(lengths)), "eval/seconds": time.monotonic() - t0,
                "eval/version_min": min(versions) if versions else version}
