"""Supervised warm start (SFT) on gold completions, and the greedy held-out evaluation.

The SFT objective is the token-mean negative log-likelihood of the completion tokens given the
prompt (teacher forcing), over a minibatch of B (prompt, completion) pairs:

    L(theta) = -(1 / N) sum_i sum_{t in completion_i} log p_theta(x_{i,t} | x_{i,<t}),
    N = sum_i |completion_i|            (the global number of loss tokens of the minibatch)

Prompt tokens are context only (loss_mask 0): they receive no loss term. The completion
includes the end-of-sequence token, so the model learns to stop.

It reuses the RL `Trainer` unchanged (packing, sharded micro-batched step, global normaliser,
AdamW, non-finite guard, donation) with `nll_loss` as its loss function and the
"given" proximal mode (the loss ignores proximal log-probs, so no extra forward pass).

Batches: a seeded stream of epoch permutations of the examples (`batch_schedule`), B consecutive
indices per step (a batch may straddle two epochs). Shapes: unless a `PackingConfig` is given,
`sft_packing` plans ONE shape for the whole run from the planned batches (row length = the
longest example rounded up to 8, rows = the most first-fit-decreasing rows any planned batch
needs, rounded up to the data-parallel size), so the step compiles exactly once.

Images (a `qwen2_5_vl.VLConfig` model): an example may carry its prompt's images (`SFTExample.images`, a
`data.images.ImageInputs`; the prompt holds their placeholder tokens); the trainer packs their pixels and M-RoPE
positions (`trainer/vl_batch.py`) and `sft_packing` plans the patch count too, so the step still compiles once.

Interruption: `SFTRun` is the same training step by step: it stops between steps when asked and
continues from a saved (state, step) exactly where it stopped, since the batch schedule is seeded and
the learning rate follows the optimizer's step count (the RL loop checkpoints the warm start this way).

Evaluation: `greedy_completions` / `greedy_accuracy` decode the prompts (rendered by the
tokenizer's chat template) at temperature 0 with the paged engine and the continuous-batching
generator, stopping on the EOS ids, and score them with a reward function.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxrl_async.models.config import ModelConfig
from jaxrl_async.models.qwen2_5_vl import is_vl
from jaxrl_async.models.transformer import Params
from jaxrl_async.trainer.optimizer import OptimizerConfig
from jaxrl_async.trainer.packing import PackingConfig, TrainSequence, check_image_tokens, ffd_rows
from jaxrl_async.trainer.train_step import Trainer, TrainStepConfig, batch_axis_size, text_config

__all__ = [
    "nll_loss", "SFTExample", "encode_examples", "batch_schedule", "sft_packing", "sft_trainer_config", "run_sft", "SFTRun",
    "generate_completions", "greedy_completions", "greedy_accuracy",
]

LogFn = Callable[[dict[str, Any]], None]


# ---------------------------------------------------------------------------------------------
# Loss
# ---------------------------------------------------------------------------------------------
def nll_loss(logprobs, proximal_logprobs=None, behaviour_logprobs=None, advantages=None, loss_mask=None, *,
             seq_ids=None, num_seqs=None, normaliser=None, entropy=None, **_) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Token-mean negative log-likelihood with the Trainer's `LossFn` signature.

        L = -(1 / N) sum_t m_t lp_t,    N = normaliser, or max(sum_t m_t, 1) when None

    `logprobs` lp [rows, T] are log p_theta(token t | < t) (aligned with the tokens), m the
    0/1 loss mask. With N the GLOBAL count of loss tokens of the minibatch (the Trainer's
    token-mean normaliser), the losses of its micro-batches add up to the minibatch mean. Only
    lp is differentiated: dL/dlp_t = -m_t / N, so tokens off the mask (prompt, padding) get no
    gradient. Proximal/behaviour log-probs, advantages and sequence ids are ignored.

    Stats (stop-gradiented, micro-batch additive per the `rl.losses` convention): n_tokens = sum m,
    nll_sum = -sum m lp (combined `nll` = nll_sum / n_tokens, the exact token-mean NLL) and, when
    `entropy` is given, entropy_sum / entropy (mean over loss tokens).
    """
    if loss_mask is None:
        raise ValueError("nll_loss: loss_mask is required")
    lp = jnp.asarray(logprobs, jnp.float32)
    m = jnp.asarray(loss_mask, jnp.float32)
    n_tokens = m.sum()
    denom = jnp.maximum(n_tokens, 1.0) if normaliser is None else jnp.asarray(normaliser, jnp.float32)
    nll_sum = -(m * lp).sum()
    loss = nll_sum / denom
    sg = jax.lax.stop_gradient
    local = jnp.maximum(n_tokens, 1.0)
    stats = {"n_tokens": n_tokens, "nll_sum": sg(nll_sum), "nll": sg(nll_sum) / local}
    if entropy is not None:
        ent_sum = (m * sg(jnp.asarray(entropy, jnp.float32))).sum()
        stats.update(entropy_sum=ent_sum, entropy=ent_sum / local)
    return loss, stats


# ---------------------------------------------------------------------------------------------
# Examples
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class SFTExample:
    """One tokenised pair. The loss covers the completion tokens only (incl. the EOS token). `images`: the prompt's
    images (`data.images.ImageInputs`, whose placeholder tokens `prompt_ids` holds; a VL model), or None."""

    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    images: Any = None

    def __post_init__(self):
        object.__setattr__(self, "prompt_ids", tuple(int(t) for t in self.prompt_ids))
        object.__setattr__(self, "completion_ids", tuple(int(t) for t in self.completion_ids))
        if not self.prompt_ids:
            raise ValueError("SFTExample.prompt_ids is empty (the first token is never predicted: a prompt of "
                             ">= 1 token is required)")
        if not self.completion_ids:
            raise ValueError("SFTExample.completion_ids is empty (no token to train on)")

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)

    def trajectory(self) -> TrainSequence:
        """tokens = prompt + completion; loss_mask 1 on the completion; zero log-probs/advantages."""
        n, p = len(self), len(self.prompt_ids)
        zeros = np.zeros(n, np.float32)
        return TrainSequence(tokens=np.asarray(self.prompt_ids + self.completion_ids, np.int32),
                             loss_mask=(np.arange(n) >= p).astype(np.int32), behaviour_logprobs=zeros,
                             advantages=zeros, versions=None, proximal_logprobs=zeros, images=self.images)


def encode_examples(pairs: Sequence[tuple[str, str]], tokenizer: Any) -> list[SFTExample]:
    """Tokenise (prompt_text, completion_text) pairs without adding special tokens.

    Prompt and completion are tokenised separately: the prompt tokens are exactly what the
    generator is given at evaluation/RL time, and the completion tokens are what it must
    produce (the completion text should end with the EOS token, as `arithmetic.sft_example`'s).
    Raises ValueError naming the pair for an empty prompt or completion.
    """
    out = []
    for i, pair in enumerate(pairs):
        try:
            prompt, completion = pair
        except (TypeError, ValueError):
            raise ValueError(f"example {i}: expected a (prompt_text, completion_text) pair, got {type(pair).__name__}"
                             ) from None
        p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        c = tokenizer(completion, add_special_tokens=False)["input_ids"]
        if not p:
            raise ValueError(f"example {i}: empty prompt {prompt!r} (at least one prompt token is required)")
        if not c:
            raise ValueError(f"example {i}: empty completion {completion!r} (no token to train on)")
        out.append(SFTExample(p, c))
    return out


# ---------------------------------------------------------------------------------------------
# Batches and shapes
# ---------------------------------------------------------------------------------------------
def batch_schedule(n_examples: int, batch_size: int, steps: int, seed: int = 0) -> list[np.ndarray]:
    """Indices of the examples of each step: a stream of seeded epoch permutations, cut in blocks.

    stream = perm_0 ++ perm_1 ++ ...,  perm_e = default_rng(seed) permutation number e of
    range(n_examples); batch k = stream[k B : (k + 1) B]. Every example is seen once per epoch;
    a batch may straddle two epochs (and holds repeats when B > n_examples).
    """
    if n_examples < 1:
        raise ValueError("batch_schedule: no examples")
    if batch_size < 1 or steps < 0:
        raise ValueError(f"batch_schedule: need batch_size >= 1 and steps >= 0, got {batch_size}, {steps}")
    rng = np.random.default_rng(seed)
    need = steps * batch_size
    n_epochs = -(-need // n_examples)
    stream = np.concatenate([rng.permutation(n_examples) for _ in range(n_epochs)]) if n_epochs else np.zeros(0, int)
    return [stream[k * batch_size:(k + 1) * batch_size] for k in range(steps)]


def sft_packing(lengths: Sequence[int], batches: Sequence[Sequence[int]], *, data_parallel: int = 1,
                row_align: int = 8, max_seqs_per_row: int = 16, images: Sequence[Any] | None = None,
                merge_unit: int = 4) -> PackingConfig:
    """One packed shape that holds every planned batch (so the step compiles once).

    row_len = round_up(max(lengths), row_align); rows = max over batches of the first-fit-decreasing
    rows the batch needs (the rule `pack` applies), rounded up to a multiple of `data_parallel`;
    one micro-batch of rows x row_len tokens. `images` (per example, `ImageInputs` or None): the one patch bucket
    = the most patches of the distinct image sets of any planned batch, rounded up to `merge_unit`.
    """
    if not batches:
        raise ValueError("sft_packing: no batches")
    row_len = -(-max(lengths) // row_align) * row_align
    rows = max(len(ffd_rows([lengths[i] for i in b], row_len, max_seqs_per_row)) for b in batches)
    rows = -(-rows // data_parallel) * data_parallel
    patch_buckets = None
    if images is not None and any(im is not None for im in images):
        need = max(sum(im.num_patches for im in {id(images[i]): images[i] for i in b if images[i] is not None}.values())
                   for b in batches)
        patch_buckets = (max(merge_unit, -(-need // merge_unit) * merge_unit),)
    return PackingConfig(tokens_per_micro=rows * row_len, row_len_buckets=(row_len,), n_micro_buckets=(1,),
                         max_seqs_per_row=max_seqs_per_row, row_multiple=data_parallel, patch_buckets=patch_buckets)


_REQUIRED = object()


def _field(cfg: Any, name: str, default: Any = _REQUIRED) -> Any:
    if hasattr(cfg, name):
        return getattr(cfg, name)
    if default is _REQUIRED:
        raise ValueError(f"SFT config {type(cfg).__name__} has no field {name!r}")
    return default


def sft_trainer_config(cfg: Any, packing: PackingConfig) -> TrainStepConfig:
    """TrainStepConfig of an SFT run: AdamW, linear warmup then cosine decay over cfg.steps.

    `cfg` is SFTConfig-like: steps, batch_size, lr, warmup_steps, weight_decay (optional:
    min_lr_ratio = 0, max_grad_norm = 1).
    """
    steps, bs, lr = _field(cfg, "steps"), _field(cfg, "batch_size"), _field(cfg, "lr")
    warmup, wd = _field(cfg, "warmup_steps"), _field(cfg, "weight_decay")
    if steps < 1:
        raise ValueError(f"SFTConfig.steps: must be >= 1 to run SFT, got {steps}")
    if bs < 1:
        raise ValueError(f"SFTConfig.batch_size: must be >= 1, got {bs}")
    if not (lr > 0 and math.isfinite(lr)):
        raise ValueError(f"SFTConfig.lr: must be a positive finite float, got {lr}")
    if not 0 <= warmup < steps:
        raise ValueError(f"SFTConfig.warmup_steps: must be in [0, steps={steps}), got {warmup}")
    opt = OptimizerConfig(lr=lr, schedule="cosine", warmup_steps=warmup, total_steps=steps,
                          min_lr_ratio=_field(cfg, "min_lr_ratio", 0.0), weight_decay=wd,
                          max_grad_norm=_field(cfg, "max_grad_norm", 1.0))
    return TrainStepConfig(optimizer=opt, packing=packing, proximal="given")


# ---------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------
def _record(step: int, metrics: Mapping[str, Any], compilations: int, t0: float) -> dict[str, Any]:
    return {"step": step, "loss": float(metrics["loss"]), "grad_norm": float(metrics["grad_norm"]),
            "lr": float(metrics["lr"]), "tokens": int(metrics["tokens"]), "loss_tokens": int(metrics["loss_tokens"]),
            "skipped": int(metrics["skipped"]), "compilations": compilations, "time_s": time.perf_counter() - t0}


class SFTRun:
    """The warm start step by step: `run_sft` that can stop between steps and continue from a saved state.

    ``state`` (the trainer's ``TrainState``: fp32 params, AdamW state, counters) and ``step`` (steps done)
    are everything a continuation needs: the batches come from the seeded `batch_schedule` and the
    learning rate from the optimizer's step count, so ``load(state, k)`` then ``run()`` trains exactly
    what the uninterrupted run trains after step k (bit for bit on the same device layout). Arguments
    as `run_sft`; the trainer (``self.trainer``) is built and the step planned in ``__init__``.
    """

    def __init__(self, params: Params, model_cfg: ModelConfig, examples: Sequence[SFTExample], cfg: Any,
                 mesh: Mesh | None = None, *, seed: int = 0, packing: PackingConfig | None = None):
        if not examples:
            raise ValueError("run_sft: no examples")
        for i, ex in enumerate(examples):
            if not isinstance(ex, SFTExample):
                raise TypeError(f"run_sft: example {i} is a {type(ex).__name__}, expected SFTExample "
                                "(see encode_examples)")
        lengths = [len(ex) for ex in examples]
        longest = int(np.argmax(lengths))
        text_cfg = text_config(model_cfg)
        if lengths[longest] > text_cfg.max_position_embeddings:
            raise ValueError(f"run_sft: example {longest} has {lengths[longest]} tokens > the model's "
                             f"max_position_embeddings {text_cfg.max_position_embeddings}")
        images = [ex.images for ex in examples]
        if is_vl(model_cfg):  # placeholders vs grids, before any planning (the error names the example)
            for i, ex in enumerate(examples):
                check_image_tokens(ex, i, model_cfg, what="example")
        elif any(im is not None for im in images):
            i = next(i for i, im in enumerate(images) if im is not None)
            raise ValueError(f"run_sft: example {i} carries images but the model is not a vision-language model")
        sft_trainer_config(cfg, PackingConfig())  # validates cfg before any planning
        self.cfg = cfg
        self.batches = batch_schedule(len(examples), cfg.batch_size, cfg.steps, seed)
        dp = batch_axis_size(mesh) if mesh is not None else 1
        if packing is None:
            merge = model_cfg.vision.merge_unit if is_vl(model_cfg) else 4
            packing = sft_packing(lengths, self.batches, data_parallel=dp, images=images, merge_unit=merge)
        self.trainer = Trainer(model_cfg, sft_trainer_config(cfg, packing), mesh, loss_fn=nll_loss,
                               normaliser_fn=lambda n_loss_tokens, n_loss_seqs: float(n_loss_tokens))
        self._trajs = [ex.trajectory() for ex in examples]
        self.state = self.trainer.init_state(params)
        self.step = 0
        self.history: list[dict[str, Any]] = []

    @property
    def total_steps(self) -> int:
        return len(self.batches)

    @property
    def done(self) -> bool:
        return self.step >= len(self.batches)

    def load(self, state: Any, step: int) -> None:
        """Continue from ``state`` after ``step`` steps (a state saved by an earlier, interrupted run)."""
        if not 0 <= int(step) <= len(self.batches):
            raise ValueError(f"SFTRun.load: step {step} is outside 0..{len(self.batches)} (trainer.sft.steps changed?)")
        self.state, self.step = state, int(step)

    def run(self, *, progress: bool | str = True, log_fn: LogFn | None = None,
            should_stop: Callable[[], bool] | None = None, after_step: Callable[[int], None] | None = None) -> bool:
        """Train from ``step`` to the end. True when done; False when ``should_stop()`` (asked before every
        step) stopped it, with ``state`` / ``step`` those after the last completed step. ``after_step(k)``
        runs once step k's state is ``self.state`` (a hook for periodic saves). ``progress``: True or
        ``"bar"``, a tqdm bar; ``"lines"``, a line every 5 % of the steps and at the last
        (``console.ProgressLines``); False, none."""
        from tqdm import tqdm

        from jaxrl_async.console import ProgressLines, progress_style

        style, N = progress_style(progress), len(self.batches)
        bar = tqdm(total=N, initial=self.step, desc="sft", unit="step", disable=style != "bar", dynamic_ncols=True)
        lines = ProgressLines("sft", N, initial=self.step, every=max(1, N // 20)) if style == "lines" else None
        t0 = time.perf_counter()
        trainer = self.trainer

        def flush(step: int, metrics: Mapping[str, Any], compilations: int) -> None:
            rec = _record(step, metrics, compilations, t0)
            self.history.append(rec)
            shown = {"loss": f"{rec['loss']:.4f}", "lr": f"{rec['lr']:.2e}"}
            bar.update(1)
            bar.set_postfix(shown, refresh=False)
            if lines is not None:
                lines.update(1, shown)
            if log_fn is not None:
                log_fn(rec)

        pending = None
        try:
            while self.step < len(self.batches):
                if should_stop is not None and should_stop():
                    break
                idx = self.batches[self.step]
                packed = trainer.pack([self._trajs[i] for i in idx], [int(i) for i in idx])
                self.state, metrics = trainer.step(self.state, packed)
                self.step += 1
                if pending is not None:
                    flush(*pending)
                pending = (self.step, metrics, trainer.n_compilations["step"])
                if after_step is not None:
                    after_step(self.step)
            if pending is not None:
                flush(*pending)
        finally:
            bar.close()
        return self.done


def run_sft(params: Params, model_cfg: ModelConfig, examples: Sequence[SFTExample], cfg: Any,
            mesh: Mesh | None = None, *, seed: int = 0, packing: PackingConfig | None = None, progress: bool | str = True,
            log_fn: LogFn | None = None) -> tuple[Params, list[dict[str, Any]]]:
    """`cfg.steps` AdamW steps of `nll_loss` on minibatches of `cfg.batch_size` examples (`SFTRun`
    whole; use `SFTRun` directly to stop part-way and continue later).

    Args:
      params: initial weights (any dtype; trained as fp32 master copies).
      model_cfg: the architecture.
      examples: the training pairs (`encode_examples`).
      cfg: SFTConfig-like (steps, batch_size, lr, warmup_steps, weight_decay): linear warmup
        to lr, then cosine decay to 0 at `steps` (`sft_trainer_config`).
      mesh: trainer mesh (fsdp, tensor[, data]); None = first device.
      seed: seed of the batch order (`batch_schedule`).
      packing: fixed packing; None plans one shape for the run (`sft_packing`).
      progress: tqdm bar (stderr) with the loss (``SFTRun.run``: or ``"lines"``).
      log_fn: called with every history record.

    Returns (params, history): the trained fp32 params on the trainer's shardings and one record
    per step: step (1-based), loss (token-mean NLL of the batch before the update), grad_norm
    (before clipping), lr (of the update), tokens (real tokens of the batch), loss_tokens,
    skipped (non-finite guard), compilations (step traces so far), time_s (since the start).
    Metrics are read back one step late, so the host packs batch k + 1 while the device runs k.
    """
    sft = SFTRun(params, model_cfg, examples, cfg, mesh, seed=seed, packing=packing)
    sft.run(progress=progress, log_fn=log_fn)
    return sft.state.params, sft.history


# ---------------------------------------------------------------------------------------------
# Greedy evaluation
# ---------------------------------------------------------------------------------------------
def _stop_ids(model_cfg: ModelConfig, tokenizer: Any) -> tuple[int, ...]:
    from jaxrl_async.data.tokenizer import stop_token_ids

    ids = stop_token_ids(model_cfg, tokenizer)
    if not ids:
        raise ValueError("greedy evaluation needs an EOS id (model_cfg.eos_token_id or tokenizer.eos_token_id)")
    return ids


def generate_completions(params: Params, model_cfg: ModelConfig, tokenizer: Any, prompts: Sequence[str], *,
                         max_new_tokens: int, temperature: float = 0.0, n: int = 1, seed: int = 0,
                         mesh: Mesh | None = None, max_concurrent: int = 64, page_size: int = 16) -> list[list[str]]:
    """`n` completions per rendered prompt text (temperature 0: greedy), stopping on the EOS ids.

    Runs the engine `generator.factory.for_prompts` sizes for these prompts under a `Generator` (the one-shot
    engine of `generate` and `evaluate`).
    Request i samples with seed `seed + i`. Returns, in prompt order, the decoded completions
    (special tokens, incl. the EOS, skipped). `mesh`: generator mesh (data, tensor), None = first
    device.
    """
    from jaxrl_async.generator.engine_api import SamplingParams
    from jaxrl_async.generator.factory import build_engine, for_prompts
    from jaxrl_async.generator.orchestrator import Generator

    if not prompts:
        raise ValueError("generate_completions: no prompts")
    if max_new_tokens < 1:
        raise ValueError(f"generate_completions: max_new_tokens must be >= 1, got {max_new_tokens}")
    if n < 1:
        raise ValueError(f"generate_completions: n must be >= 1, got {n}")
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    for i, x in enumerate(ids):
        if not x:
            raise ValueError(f"generate_completions: prompt {i} is empty after tokenisation")
    longest = max(len(x) for x in ids)
    if longest + max_new_tokens > model_cfg.max_position_embeddings:
        raise ValueError(f"generate_completions: a prompt of {longest} tokens + max_new_tokens {max_new_tokens} > the "
                         f"model's max_position_embeddings {model_cfg.max_position_embeddings}")
    spec = for_prompts([len(x) for x in ids], max_new_tokens, model_cfg, max_concurrent=max_concurrent,
                       samples_per_prompt=n, page_size=page_size)
    engine = build_engine(spec, model_cfg, mesh)
    stops = _stop_ids(model_cfg, tokenizer)
    with Generator(engine, engine.place_params(params), tokenizer=tokenizer) as gen:
        handles = [gen.submit(x, SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens,
                                                stop_token_ids=stops, seed=(seed + i) % 2 ** 32, n=n),
                              request_id=str(i)) for i, x in enumerate(ids)]
        outputs = [h.result(timeout=None) for h in handles]
    return [[tokenizer.decode(s.completion_ids, skip_special_tokens=True) for s in o.samples] for o in outputs]


def greedy_completions(params: Params, model_cfg: ModelConfig, tokenizer: Any, prompts: Sequence[str], *,
                       max_new_tokens: int, mesh: Mesh | None = None, max_concurrent: int = 64) -> list[str]:
    """The greedy (temperature 0) completion of each rendered prompt text (`generate_completions`)."""
    return [c[0] for c in generate_completions(params, model_cfg, tokenizer, prompts, max_new_tokens=max_new_tokens,
                                               mesh=mesh, max_concurrent=max_concurrent)]


def greedy_accuracy(params: Params, model_cfg: ModelConfig, tokenizer: Any, problems: Sequence[Any],
                    reward_fn: Callable[..., float], *, max_new_tokens: int, mesh: Mesh | None = None,
                    max_concurrent: int = 64) -> float:
    """Mean reward of the greedy completions of `problems` (the accuracy for a 0/1 reward).

        acc = (1 / n) sum_i reward_fn(prompt_i, greedy completion_i, problem_i.answer)

    Prompts are `arithmetic.sft_example(problem, tokenizer)[0]` (the user message `problem.prompt`
    rendered by the tokenizer's chat template with the generation prompt).
    """
    from jaxrl_async.data.arithmetic import sft_example

    if not problems:
        raise ValueError("greedy_accuracy: no problems")
    prompts = [sft_example(p, tokenizer)[0] for p in problems]
    completions = greedy_completions(params, model_cfg, tokenizer, prompts, max_new_tokens=max_new_tokens, mesh=mesh,
                                     max_concurrent=max_concurrent)
    rewards = [float(reward_fn(p, c, prob.answer)) for p, c, prob in zip(prompts, completions, problems)]
    return float(np.mean(rewards))
