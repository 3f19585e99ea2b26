"""A run's prompt recipe: how a dataset row becomes the prompt a policy is given, and how the run's held-out
evaluation generates and scores it.

One recipe renders every prompt of a run (train and held-out: ``loop.setup``) and of ``evaluate`` on the run's
export: :meth:`PromptRecipe.dataset_config` is the ``DatasetConfig`` that both load with ``load_prompt_dataset``
(the problem + ``prompt_suffix`` as one user turn of the tokenizer's chat template, an optional system turn;
prompts over ``max_prompt_len`` tokens dropped). :func:`run_recipe` reads it from a run config (a ``RunConfig`` or
its ``to_dict``); an export of a run (``checkpoint.hf_export``: the run's own ``RUN/hf`` and ``python -m
jaxrl_async.export``) writes it beside the weights as :data:`RECIPE_FILE`, from the config saved with the exported
checkpoint, and :func:`find_run_recipe` reads it back::

    {"run_dir": "/abs/RUN", "step": 40,
     "prompt": {"format": "gsm8k", "apply_chat_template": true, "system_prompt": null,
                "prompt_suffix": "\\nPlease put your final answer within \\\\boxed{}.", "max_prompt_len": 1024},
     "reward": "math",
     "eval": {"n": 1, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "max_new_tokens": 1024, "stop_strings": [],
              "seed": 0, "max_items": null}}

``format`` is ``generic`` for the synthetic arithmetic task (the files it writes), else ``data.format``;
``eval`` is what the in-run evaluation used (``loop.evaluation``: one sample per record at ``eval.temperature``,
``eval.max_new_tokens`` or ``rollout.sampling.max_new_tokens``, the sampling's top-p/top-k and stop strings,
the run's seed, the first ``eval.max_items`` records).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["RECIPE_FILE", "PromptRecipe", "RunRecipe", "find_run_recipe", "read_run_recipe", "run_recipe",
           "write_run_recipe"]

RECIPE_FILE = "jaxrl_async_run.json"


@dataclasses.dataclass(frozen=True)
class PromptRecipe:
    """How a row's problem becomes prompt tokens (``data.DatasetConfig``'s fields of the same names)."""

    format: str = "generic"
    apply_chat_template: bool = True
    system_prompt: str | None = None
    prompt_suffix: str = ""
    max_prompt_len: int | None = None

    def dataset_config(self, path: str | Sequence[str], *, apply_chat_template: bool | None = None,
                       format: str | None = None, skip_bad_rows: bool = False, max_rows: int | None = None) -> Any:
        """The ``DatasetConfig`` of ``path`` rendered with this recipe; ``apply_chat_template`` / ``format``:
        what the caller decided instead (``data.tokenizer.chat_template_wanted``: a tokenizer without a template
        means raw text; ``evaluate``'s format told from the file's columns)."""
        from jaxrl_async.data.datasets import DatasetConfig

        return DatasetConfig(path=path, format=format or self.format, max_prompt_len=self.max_prompt_len,
                             apply_chat_template=self.apply_chat_template if apply_chat_template is None
                             else apply_chat_template, system_prompt=self.system_prompt,
                             prompt_suffix=self.prompt_suffix, skip_bad_rows=skip_bad_rows, max_rows=max_rows)


@dataclasses.dataclass(frozen=True)
class RunRecipe:
    """A run's prompt recipe, reward and in-run evaluation settings (the module docstring's file)."""

    prompt: PromptRecipe
    reward: str = "math"
    n: int = 1
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 256
    stop_strings: tuple[str, ...] = ()
    seed: int = 0
    max_items: int | None = None  # eval.max_items: the run evaluated the first max_items records
    run_dir: str | None = None
    step: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {"run_dir": self.run_dir, "step": self.step, "prompt": dataclasses.asdict(self.prompt),
                "reward": self.reward,
                "eval": {"n": self.n, "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                         "max_new_tokens": self.max_new_tokens, "stop_strings": list(self.stop_strings),
                         "seed": self.seed, "max_items": self.max_items}}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> RunRecipe:
        """Inverse of :meth:`to_json`; ValueError naming the key of a missing or mistyped field."""
        p, e = _field(d, "prompt", (Mapping,), ""), _field(d, "eval", (Mapping,), "")
        opt_str, opt_int, num = (str, type(None)), (int, type(None)), (int, float)
        prompt = PromptRecipe(format=_field(p, "format", (str,), "prompt."),
                              apply_chat_template=_field(p, "apply_chat_template", (bool,), "prompt."),
                              system_prompt=_field(p, "system_prompt", opt_str, "prompt."),
                              prompt_suffix=_field(p, "prompt_suffix", (str,), "prompt."),
                              max_prompt_len=_field(p, "max_prompt_len", opt_int, "prompt."))
        stops = _field(e, "stop_strings", (list,), "eval.")
        if not all(isinstance(s, str) for s in stops):
            raise ValueError(f"eval.stop_strings is {stops!r}, not a list of strings")
        return cls(prompt=prompt, reward=_field(d, "reward", (str,), ""), n=_field(e, "n", (int,), "eval."),
                   temperature=float(_field(e, "temperature", num, "eval.")),
                   top_p=float(_field(e, "top_p", num, "eval.")), top_k=_field(e, "top_k", (int,), "eval."),
                   max_new_tokens=_field(e, "max_new_tokens", (int,), "eval."), stop_strings=tuple(stops),
                   seed=_field(e, "seed", (int,), "eval."), max_items=_field(e, "max_items", opt_int, "eval."),
                   run_dir=d.get("run_dir"), step=d.get("step"))


def _field(m: Any, key: str, types: tuple[type, ...], where: str) -> Any:
    if not isinstance(m, Mapping) or key not in m:
        raise ValueError(f"{where}{key} missing")
    v = m[key]
    if not isinstance(v, types) or (isinstance(v, bool) and bool not in types):
        raise ValueError(f"{where}{key} is {v!r}")
    return v


def _at(cfg: Any, dotted: str, default: Any = None) -> Any:
    """``cfg``'s field ``a.b.c`` (attributes of a ``RunConfig`` or keys of its ``to_dict``), else ``default``."""
    for part in dotted.split("."):
        cfg = cfg.get(part, None) if isinstance(cfg, Mapping) else getattr(cfg, part, None)
        if cfg is None:
            return default
    return cfg


def run_recipe(cfg: Any, *, run_dir: str | None = None, step: int | None = None) -> RunRecipe:
    """The recipe of a run config: a ``RunConfig`` or its ``to_dict`` (a checkpoint's saved config, a run's
    ``config.json``); missing fields take ``DataConfig`` / ``EvalConfig`` / ``SamplingConfig``'s defaults."""
    fmt = ("generic" if _at(cfg, "data.task", "arithmetic") in ("arithmetic", "visual_arithmetic")
           else _at(cfg, "data.format", "gsm8k"))
    prompt = PromptRecipe(format=fmt, apply_chat_template=bool(_at(cfg, "data.apply_chat_template", True)),
                          system_prompt=_at(cfg, "data.system_prompt"), prompt_suffix=_at(cfg, "data.prompt_suffix", ""),
                          max_prompt_len=_at(cfg, "data.max_prompt_len"))
    return RunRecipe(prompt=prompt, reward=_at(cfg, "rollout.reward", "math"),
                     temperature=float(_at(cfg, "eval.temperature", 0.0)),
                     top_p=float(_at(cfg, "rollout.sampling.top_p", 1.0)), top_k=int(_at(cfg, "rollout.sampling.top_k", 0)),
                     max_new_tokens=int(_at(cfg, "eval.max_new_tokens") or _at(cfg, "rollout.sampling.max_new_tokens", 256)),
                     stop_strings=tuple(_at(cfg, "rollout.sampling.stop_strings", ())), seed=int(_at(cfg, "seed", 0)),
                     max_items=_at(cfg, "eval.max_items"),
                     run_dir=run_dir if run_dir is None else os.path.abspath(run_dir), step=step)


def write_run_recipe(out_dir: str, cfg: Any, *, run_dir: str | None = None, step: int | None = None) -> str | None:
    """Write ``out_dir/RECIPE_FILE`` from run config ``cfg`` (a ``RunConfig`` or its ``to_dict``); None (nothing
    written) when ``cfg`` is None or a mapping without the run config's sections: a checkpoint saved without it."""
    if cfg is None or isinstance(cfg, Mapping) and not _is_run_config(cfg):
        return None
    path = os.path.join(out_dir, RECIPE_FILE)
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(run_recipe(cfg, run_dir=run_dir, step=step).to_json(), fh, indent=2)
    return path


def read_run_recipe(path: str) -> RunRecipe:
    """The recipe in ``path`` (a :data:`RECIPE_FILE`); ValueError naming the file on an unreadable one."""
    try:
        with open(path, encoding="utf-8") as fh:
            return RunRecipe.from_json(json.load(fh))
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not a readable jaxrl_async run recipe: {e}") from None


def _is_run_config(d: Any) -> bool:
    return isinstance(d, Mapping) and all(isinstance(d.get(k), Mapping) for k in ("data", "rollout", "eval"))


def find_run_recipe(model_dir: str) -> tuple[RunRecipe, str] | None:
    """(recipe, the file it came from) of a model directory that is a run's export, else None.

    ``model_dir/RECIPE_FILE`` (every export writes it); else, for an export written before exports carried it,
    the run's ``config.json`` one directory up (the run's own export is ``RUN/hf``) when it is a run config. A
    malformed :data:`RECIPE_FILE` is a ValueError naming it."""
    own = os.path.join(model_dir, RECIPE_FILE)
    if os.path.isfile(own):
        return read_run_recipe(own), own
    parent = os.path.dirname(os.path.abspath(model_dir))
    cfg_path = os.path.join(parent, "config.json")
    try:
        with open(cfg_path, encoding="utf-8") as fh:
            d = json.load(fh)
    except (OSError, ValueError):
        return None
    if not _is_run_config(d):
        return None
    return run_recipe(d, run_dir=parent), cfg_path
