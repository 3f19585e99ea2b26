"""Will a Qwen2.5-VL run fit its hardware? The planner for vision-language models (issue 29 item 6).

The run config's policy is a Qwen2.5-VL model (``model.model_type=qwen2_5_vl`` with ``model.vision``, or a Qwen2.5-VL
checkpoint in ``model.path``): the text decoder (``VLConfig.text``) with a vision tower in front
(``models/qwen2_5_vl.py``). The plan is the decoder's plan (``planner.make_plan`` on the run config with the
decoder as its policy, `decoder_run_config`: the generator's decode step after a prompt IS the decoder's, with 1-D
positions index + rope delta; the KV pool, the weight push and the text batches are the decoder's) plus what the
images add:

* resident: the vision tower's parameters (trainer: float32 master weights + AdamW moments, sharded by the
  trainer rules; generator: the compute dtype by the generator rules, plus one incoming push of them) and the
  packed minibatches with images (`trainer.vl_batch`: per micro-batch the float32 pixel patches of its distinct
  image sets, one temporal copy a patch, bucketed, replicated on every trainer device, plus M-RoPE positions and
  placeholder indices);
* the run's own VL programs compiled with abstract arguments (for the target when the decoder's were): the
  Trainer's step and proximal log-prob pass of a minibatch with images (``Trainer._step_fn`` / ``_logprobs_fn``:
  vision tower over each micro-batch's patches -> features into the placeholders -> M-RoPE decoder -> the policy
  loss of ``rl/losses.py`` -> AdamW) and the engine's vision tower and VL prefill of the largest prefill bucket
  (``generator/vision_prefill.py``). Their temporaries replace the decoder's in the peaks; the decode step is the
  decoder's.

The image budget (`ImageBudget`): images per prompt x visual tokens per image (1280 = the Qwen2.5-VL model card's
recommended ``max_pixels = 1280 * 28 * 28``; the tower sees m^2 = 4 patches per token: 5120). A micro-batch holds
one image set per distinct prompt among its sequences (the samples of a prompt share one copy), at most the
minibatch's prompts; its patch count is bucketed by ``trainer.packing.patch_buckets`` (powers of two by default).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from jaxrl_async.plan.planner import GiB, PlanError, compile_executable, device_bytes


@dataclasses.dataclass(frozen=True)
class ImageBudget:
    """Images per prompt and visual (merged) tokens per image that the plan provisions for."""

    images_per_prompt: int = 1
    tokens_per_image: int = 1280

    def __post_init__(self):
        for f in ("images_per_prompt", "tokens_per_image"):
            v = getattr(self, f)
            if not isinstance(v, int) or v < 1:
                raise PlanError(f"ImageBudget.{f}: must be a positive int, got {v!r}")

    def grid(self, spatial_merge_size: int) -> tuple[int, int, int]:
        """(t, h, w) patch grid of one image at the budget: merged grid gh x gw = tokens with gh <= gw the
        most square factorisation (1280 -> 32 x 40 merge units = 64 x 80 patches)."""
        n = self.tokens_per_image
        gh = max(d for d in range(1, int(math.isqrt(n)) + 1) if n % d == 0)
        return (1, gh * spatial_merge_size, (n // gh) * spatial_merge_size)

    def patches_per_prompt(self, spatial_merge_size: int) -> int:
        return self.images_per_prompt * self.tokens_per_image * spatial_merge_size ** 2

    def image_tokens_per_prompt(self) -> int:
        return self.images_per_prompt * self.tokens_per_image


def vl_model_config(cfg):
    """The run's Qwen2.5-VL model config (``model.path``'s config.json, or the section's architecture with
    Qwen2.5-VL's vision token ids); PlanError when the policy is not a VL model."""
    from jaxrl_async.config import ConfigError
    from jaxrl_async.models.qwen2_5_vl import VLConfig, is_vl

    if cfg.model.path is None:
        if cfg.model.model_type != "qwen2_5_vl":
            raise PlanError(f"model.model_type {cfg.model.model_type!r}: the VL planner needs a Qwen2.5-VL policy "
                            "(model.model_type=qwen2_5_vl, or model.path to a Qwen2.5-VL checkpoint); text models: "
                            "python -m jaxrl_async.plan")
        if cfg.model.vocab_size is None:
            raise ConfigError("model.vocab_size", "the plan needs the vocabulary size: set model.vocab_size (or "
                              "model.path to a Hugging Face directory whose config.json gives it)")
        ids = {f: getattr(VLConfig, f) for f in ("image_token_id", "video_token_id", "vision_start_token_id",
                                                 "vision_end_token_id")}
        vl = cfg.model.model_config(vocab_size=cfg.model.vocab_size, vision_token_ids=ids)
    else:
        vl = cfg.model.model_config(vocab_size=0)
    if not is_vl(vl):
        raise PlanError(f"model.path {cfg.model.path!r} is not a Qwen2.5-VL checkpoint; text models: "
                        "python -m jaxrl_async.plan")
    return vl


def decoder_run_config(cfg, vl):
    """``cfg`` with the VL model's text decoder as its policy (random init of the same architecture, 1-D RoPE =
    M-RoPE with equal rows, what decoding after a prompt uses): the run config of the decoder's plan."""
    t = vl.text
    model = dataclasses.replace(
        cfg.model, path=None, model_type="qwen2", vocab_size=t.vocab_size, hidden_size=t.hidden_size,
        intermediate_size=t.intermediate_size, num_layers=t.num_layers, num_heads=t.num_heads,
        num_kv_heads=t.num_kv_heads, head_dim=t.head_dim, max_position_embeddings=t.max_position_embeddings,
        tie_word_embeddings=t.tie_word_embeddings, rope_theta=t.rope_theta, mrope_section=())
    data = cfg.data
    if data.task == "visual_arithmetic":  # the image task's text twin: same lengths (the plan reads no rows)
        data = dataclasses.replace(data, task="arithmetic")
    return dataclasses.replace(cfg, model=model, data=data)


def reduced_run_depth(cfg, num_layers: int | None = None, vision_depth: int | None = None):
    """``cfg`` with fewer decoder layers / vision blocks in its ``model`` section (compile checks at the full widths;
    not a memory plan of the model): the full-attention blocks kept are those below the new depth, else the last."""
    m = cfg.model
    if num_layers is not None:
        m = dataclasses.replace(m, num_layers=int(num_layers))
    if vision_depth is not None:
        d = int(vision_depth)
        if d < 1:
            raise PlanError(f"--vision-depth: must be >= 1, got {d}")
        full = tuple(i for i in m.vision.fullatt_block_indexes if i < d) or (d - 1,)
        m = dataclasses.replace(m, vision=dataclasses.replace(m.vision, depth=d, fullatt_block_indexes=full))
    return dataclasses.replace(cfg, model=m)


def _sds(shape, dtype, sharding=None):
    import jax

    return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding)


# =============================================================================================
# Memory arithmetic (no compile)
# =============================================================================================
def vision_bytes(vl, mesh, rules: str, dtype: str) -> int:
    """Per-device bytes of the vision tower's parameters in ``dtype`` under ``rules`` (``trainer`` / ``generator``)
    on ``mesh``."""
    import jax

    from jaxrl_async.models import qwen2_5_vl
    from jaxrl_async.models.shardings import model_shardings

    full = vl.replace(param_dtype=dtype)
    shapes = qwen2_5_vl.param_shapes(full)["vision"]
    shardings = model_shardings(full, mesh, rules)["vision"]
    return device_bytes(jax.tree.leaves(shapes), jax.tree.leaves(shardings))


def pixel_frame_dim(vl) -> int:
    """Values of one patch as the trainer ships it: one of its ``temporal_patch_size`` equal copies (C * P * P; an
    image repeats its frame, the device broadcasts it back: `trainer.vl_batch`)."""
    return vl.vision.in_channels * vl.vision.patch_size ** 2


def vision_batch_bytes(vl, n_micro: int, patches: int) -> int:
    """Bytes of the vision inputs of one packed minibatch (`trainer.vl_batch.VisionBatch`: per micro-batch the float32
    pixel patches of its distinct image sets, one temporal copy each, bucketed to ``patches``, and their int32
    layout: order, frame and window ids, 2D coordinates, the merge units' order). The trainer replicates them
    (every device runs its micro-batch's tower), so this is per device too."""
    mu = vl.vision.merge_unit
    return n_micro * (patches * pixel_frame_dim(vl) * 4 + patches * 5 * 4 + patches // mu * 4)


def micro_batch_patches(budget: ImageBudget, vl, *, sequences_per_micro: int, prompts_per_minibatch: int,
                        packing) -> tuple[int, int]:
    """(distinct image sets, bucketed patch count) of the largest micro-batch: one set per distinct prompt (the
    samples of a prompt share one copy), at most the micro-batch's sequences and the minibatch's prompts."""
    sets = max(1, min(sequences_per_micro, prompts_per_minibatch))
    return sets, packing.patches_for(sets * budget.patches_per_prompt(vl.vision.spatial_merge_size))


def vl_memory(vl, trn_mesh, gen_mesh, push_dtype: str = "bfloat16") -> dict[str, int]:
    """What the vision tower adds per device, from shapes and shardings alone: its parameters, AdamW moments and
    push staging (trainer rules), its weights and one incoming push (generator rules)."""
    trn_params = vision_bytes(vl, trn_mesh, "trainer", "float32")
    gen_params = vision_bytes(vl, gen_mesh, "generator", vl.text.dtype)
    return {"trainer_vision_params_bytes": trn_params, "trainer_vision_optimizer_bytes": 2 * trn_params,
            "trainer_vision_push_staging_bytes": vision_bytes(vl, trn_mesh, "trainer", push_dtype),
            "generator_vision_params_bytes": gen_params, "generator_vision_incoming_bytes": gen_params}


# =============================================================================================
# The run's VL programs with abstract arguments (Trainer: trainer/vl_batch.py; engine: generator/vision_prefill.py)
# =============================================================================================
def _with_shardings(abstract, shardings):
    import jax

    return jax.tree.map(lambda a, s: _sds(a.shape, a.dtype, s), abstract, shardings)


def abstract_vl_state(trainer):
    """The VL trainer's `TrainState` as ShapeDtypeStructs with its shardings (fp32 master weights, AdamW state of
    the trainable subtree: all of it, or all but a frozen tower)."""
    import jax
    import jax.numpy as jnp

    from jaxrl_async.models import qwen2_5_vl
    from jaxrl_async.trainer.train_step import TrainState

    ps = jax.tree.map(lambda s, dt: jax.ShapeDtypeStruct(s.shape, dt), qwen2_5_vl.param_shapes(trainer.model_cfg),
                      trainer.param_dtypes)
    st = jax.eval_shape(lambda p: TrainState(p, trainer.tx.init(trainer._trainable(p)), jnp.zeros((), jnp.int32),
                                             jnp.zeros((), jnp.int32)), ps)
    return _with_shardings(st, trainer.state_shardings)


def abstract_vl_batch(trainer, shape: tuple[int, int, int], patches: int):
    """A packed minibatch with images (`PackedBatch` with ``mrope_positions``, ``image_index`` and ``vision``) of
    ``shape`` (n_micro, rows, row_len) and ``patches`` pixel patches per micro-batch, on the trainer's shardings."""
    import jax.numpy as jnp

    from jaxrl_async.trainer.packing import DEVICE_FIELDS, PackedBatch
    from jaxrl_async.trainer.vl_batch import VisionBatch

    v = trainer.model_cfg.vision
    n = shape[0]
    ints = {"tokens", "segment_ids", "positions", "versions", "seq_ids"}
    fields = {f: _sds(shape, jnp.int32 if f in ints else jnp.float32) for f in DEVICE_FIELDS}
    i32 = lambda *s: _sds((n, *s), jnp.int32)  # noqa: E731
    vision = VisionBatch(pixel_values=_sds((n, patches, pixel_frame_dim(trainer.model_cfg)), jnp.float32),
                         order=i32(patches),
                         unorder=i32(patches // v.merge_unit), hw=i32(patches, 2), frame_ids=i32(patches),
                         window_ids=i32(patches))
    b = PackedBatch(**fields, mrope_positions=_sds((*shape, 3), jnp.int32), image_index=_sds(shape, jnp.int32),
                    vision=vision)
    return _with_shardings(b, trainer.batch_shardings(b))


def compile_trainer_vl(trainer, shape, patches: int, num_seqs: int, options=None):
    """(train step, proximal log-prob pass) ExecutableMemory of the Trainer's own VL programs (``Trainer._step_fn``
    and ``_logprobs_fn`` of a batch with images) for a minibatch of ``shape`` with ``patches`` per micro-batch."""
    import jax.numpy as jnp

    state, batch = abstract_vl_state(trainer), abstract_vl_batch(trainer, shape, patches)
    rep = lambda dt: _sds((), dt, trainer.replicated)  # noqa: E731
    dt = trainer.model_cfg.text.dtype
    _, step = compile_executable("vl_train_step", trainer._step_fn(num_seqs, batch),
                                 (state, batch, rep(jnp.float32), rep(jnp.int32)), dt, options)
    _, lp = compile_executable("vl_proximal_logprobs", trainer._logprobs_fn(batch), (state.params, batch), dt, options)
    return step, lp, batch


def prefill_patches(budget: ImageBudget, vl, bucket: int) -> tuple[int, int]:
    """(image prompts a prefill row of ``bucket`` tokens can hold, the tower's padded patch count for them)."""
    from jaxrl_async.generator.vision_prefill import patch_bucket

    prompts = max(1, bucket // budget.image_tokens_per_prompt())
    return prompts, patch_bucket(prompts * budget.patches_per_prompt(vl.vision.spatial_merge_size))


def compile_engine_vl(engine, params, budget: ImageBudget, options=None):
    """(vision tower, VL prefill) ExecutableMemory of the engine's own VL prefill programs
    (`generator.vision_prefill`: the tower over a prefill row's images, then the decoder over the row with the
    features and M-RoPE positions) for the largest prefill bucket at the image budget."""
    import functools

    import jax
    import jax.numpy as jnp

    from jaxrl_async.generator.vision_prefill import tower_fn

    vl = engine.vl_cfg
    bucket = engine.buckets[-1]
    _, nb = prefill_patches(budget, vl, bucket)
    mu, dt, rep = vl.vision.merge_unit, vl.text.dtype, engine.replicated
    i32 = lambda *s: _sds(s, jnp.int32, rep)  # noqa: E731  (host inputs: placed replicated, as the engine's calls)
    layout = {"order": i32(nb), "unorder": i32(nb // mu), "hw": i32(nb, 2), "frame_ids": i32(nb),
              "window_ids": i32(nb)}
    tower = jax.jit(functools.partial(tower_fn, cfg=vl, rows=bucket), out_shardings=rep)
    # the tower reads the ``vision`` subtree only (a whole tree's unused leaves would be pruned from the executable)
    _, tower_mem = compile_executable("vision_tower", tower, ({"vision": params["vision"]},
                                      _sds((nb, vl.vision.patch_dim), jnp.float32, rep), layout), dt, options)
    text_params = {k: v for k, v in params.items() if k != "vision"}  # the prefill reads the decoder's only
    args = (text_params, i32(1, bucket), i32(engine.max_prefill_pack), i32(3, 1, bucket),
            _sds((bucket, vl.text.hidden_size), jnp.dtype(dt), rep), i32(1, bucket))
    _, pre_mem = compile_executable("vl_prefill", engine.vision._prefill, args, dt, options)
    return tower_mem, pre_mem, nb


# =============================================================================================
# The plan
# =============================================================================================
def make_vl_plan(cfg, budget: ImageBudget = ImageBudget(), *, num_devices: int | None = None,
                 target: str | None = None, headroom: float = 0.10, compile_for: str = "auto") -> dict[str, Any]:
    """The decoder's plan (``planner.make_plan`` of `decoder_run_config`) with the VL additions of the module
    docstring under ``"vl"``: resident bytes of the vision tower and the pixels, the Trainer's VL step and proximal
    pass and the engine's vision tower and VL prefill compiled on the same meshes (for the target when the
    decoder's programs were), and the VL peaks and verdict per side. ``cfg``: a run config whose policy is a
    Qwen2.5-VL model (`vl_model_config`)."""
    import jax

    from jaxrl_async.config import resolve_device_split, resolve_shape
    from jaxrl_async.generator.factory import generator_model_config, run_engine
    from jaxrl_async.models import qwen2_5_vl
    from jaxrl_async.models.vl_presets import vl_num_params
    from jaxrl_async.plan import aot
    from jaxrl_async.plan.planner import batch_shape, default_num_devices, make_plan
    from jaxrl_async.sharding.mesh import make_mesh
    from jaxrl_async.trainer.factory import build_trainer

    vl = vl_model_config(cfg)
    vl_cfg_run = cfg
    if cfg.data.max_prompt_len is not None and cfg.data.max_prompt_len < budget.image_tokens_per_prompt():
        raise PlanError(f"data.max_prompt_len {cfg.data.max_prompt_len} is under the image budget's "
                        f"{budget.image_tokens_per_prompt()} visual tokens per prompt")
    cfg = decoder_run_config(cfg, vl)
    r = make_plan(cfg, num_devices=num_devices, target=target, headroom=headroom, compile_for=compile_for)
    n = num_devices if num_devices is not None else default_num_devices(cfg)
    devices = jax.devices()[:n]
    on_target = "deviceless" in r["compiled_for"]["trainer"]
    if on_target:
        devices, _ = aot.target_devices(r["target"]["kind"], n)
    vl_c = vl  # the compiled programs' config (resident bytes always in the configured dtypes: ``vl``)
    if not on_target and devices[0].platform == "cpu" and vl.text.dtype != "float32":
        vl_c = vl.replace(dtype="float32")  # XLA:CPU bound, as the decoder's plan (planner docstring)
    m = cfg.mesh
    gen_ids, trn_ids = resolve_device_split(m, n)
    trn_mesh = make_mesh(resolve_shape(m.trainer.shape, len(trn_ids), "mesh.trainer.shape"), m.trainer.axis_names,
                         devices=[devices[i] for i in trn_ids])
    gen_mesh = make_mesh(resolve_shape(m.generator.shape, len(gen_ids), "mesh.generator.shape"),
                         m.generator.axis_names, devices=[devices[i] for i in gen_ids])
    options = aot.compiler_options(devices) if on_target else None

    # trainer: the largest packed minibatch (as the decoder's plan) with every micro-batch's images
    trainer = build_trainer(vl_cfg_run, vl_c, trn_mesh)
    n_micro, rows, row_len, num_seqs = batch_shape(cfg, trainer)
    seqs_per_row = max(1, min(trainer.cfg.packing.max_seqs_per_row, row_len // cfg.rollout.engine.max_sequence_length))
    seqs = cfg.trainer.batch_size * cfg.rollout.n_samples // cfg.trainer.ppo_n_minibatches
    sets, patches = micro_batch_patches(budget, vl, sequences_per_micro=rows * seqs_per_row,
                                        prompts_per_minibatch=max(1, seqs // cfg.rollout.n_samples),
                                        packing=trainer.cfg.packing)
    step_mem, lp_mem, batch = compile_trainer_vl(trainer, (n_micro, rows, row_len), patches, num_seqs, options)
    mem = vl_memory(vl, trn_mesh, gen_mesh)
    batch_sh = jax.tree.leaves(trainer.batch_shardings(batch))
    vl_batch_bytes = device_bytes(jax.tree.leaves(batch), batch_sh) * cfg.trainer.ppo_n_minibatches
    # generator: the run's engine on the generator mesh (for the target when the decoder's was)
    e = cfg.rollout.engine
    num_pages = r["generator"]["num_pages"]
    engine = run_engine(vl_cfg_run, vl_c, gen_mesh, num_pages=num_pages, check_fit=False)
    gen_params = _with_shardings(qwen2_5_vl.param_shapes(generator_model_config(vl_c)), engine.param_shardings)
    tower_mem, pre_mem, nb = compile_engine_vl(engine, gen_params, budget, options)
    prompts_per_row, _ = prefill_patches(budget, vl, engine.buckets[-1])

    t, g, budget_bytes = r["trainer"], r["generator"], r["target"]["budget_bytes"]
    # the VL programs' transient bytes replace the decoder's; the minibatches with images replace the text ones
    trn_resident = (t["params_bytes"] + t["optimizer_state_bytes"] + t["push_staging_bytes"] + vl_batch_bytes
                    + mem["trainer_vision_params_bytes"] + mem["trainer_vision_optimizer_bytes"]
                    + mem["trainer_vision_push_staging_bytes"])
    trn_transient = max(step_mem.transient_bytes, lp_mem.transient_bytes)
    trn_peak = trn_resident + trn_transient
    gen_resident = (g["params_bytes"] + g["incoming_weights_bytes"] + g["kv_cache_bytes"] + g["slot_state_bytes"]
                    + mem["generator_vision_params_bytes"] + mem["generator_vision_incoming_bytes"])
    # (the tower's [bucket, D] features, live into the prefill, are a few MB: within the headroom)
    gen_transient = max(g["decode_transient_bytes"], tower_mem.transient_bytes, pre_mem.transient_bytes)
    gen_peak = gen_resident + gen_transient
    if r["devices"]["colocated"]:
        trn_peak = gen_peak = trn_peak + gen_peak
    r["vl"] = {
        "params": vl_num_params(vl), "vision_depth": vl.vision.depth, "freeze_vision": trainer.freeze_vision,
        "image_budget": {"images_per_prompt": budget.images_per_prompt, "tokens_per_image": budget.tokens_per_image,
                         "grid_thw": list(budget.grid(vl.vision.spatial_merge_size)),
                         "patches_per_prompt": budget.patches_per_prompt(vl.vision.spatial_merge_size),
                         "prompt_len": e.max_prefill_length or cfg.data.max_prompt_len, "rows": rows,
                         "row_len": row_len, "seqs_per_row": seqs_per_row, "n_micro": n_micro,
                         "image_sets_per_micro": sets, "patches_per_micro": patches,
                         "prefill_bucket": engine.buckets[-1], "prefill_image_prompts": prompts_per_row,
                         "prefill_patches": nb},
        **mem, "trainer_batches_bytes": vl_batch_bytes,
        "train_step": dataclasses.asdict(step_mem), "proximal_logprobs": dataclasses.asdict(lp_mem),
        "vision_tower": dataclasses.asdict(tower_mem), "prefill": dataclasses.asdict(pre_mem),
        "train_step_transient_bytes": step_mem.transient_bytes, "logprobs_transient_bytes": lp_mem.transient_bytes,
        "tower_transient_bytes": tower_mem.transient_bytes, "prefill_transient_bytes": pre_mem.transient_bytes,
        "trainer_peak_bytes": trn_peak, "generator_peak_bytes": gen_peak,
        "trainer_fits": trn_peak <= budget_bytes, "generator_fits": gen_peak <= budget_bytes,
        "compiled_for": r["compiled_for"]["trainer"] if on_target else f"{devices[0].platform} ({vl_c.text.dtype})",
        "programs": "Trainer._step_fn / _logprobs_fn of a batch with images; PagedEngine vision tower + VL prefill",
    }
    r["vl"]["fits"] = r["vl"]["trainer_fits"] and r["vl"]["generator_fits"]
    return r


def format_vl_plan(r: dict[str, Any]) -> str:
    from jaxrl_async.plan.planner import format_plan

    v, tg = r["vl"], r["target"]
    gib = lambda b: f"{b / GiB:8.2f} GiB"  # noqa: E731
    ib = v["image_budget"]
    lines = [format_plan(r), "",
             f"VL (Qwen2.5-VL, {v['params'] / 1e9:.3f} B params, vision depth {v['vision_depth']}"
             f"{', tower frozen' if v['freeze_vision'] else ''}): {ib['images_per_prompt']} image(s) x "
             f"{ib['tokens_per_image']} visual tokens per prompt (grid {ib['grid_thw']}, {ib['patches_per_prompt']} "
             f"patches), prompts up to {ib['prompt_len']} tokens; compiled for {v['compiled_for']}"]
    row = lambda label, b, extra="": lines.append(f"  {label:<40}{gib(b)}{'   ' + extra if extra else ''}")  # noqa: E731
    lines.append(f"trainer with images (per device; micro-batch {ib['rows']} rows x {ib['row_len']}, "
                 f"{ib['image_sets_per_micro']} image set(s) = {ib['patches_per_micro']} patches per micro-batch, "
                 f"{ib['n_micro']} micro-batches)")
    row("vision parameters (float32)", v["trainer_vision_params_bytes"])
    row("vision AdamW moments", v["trainer_vision_optimizer_bytes"])
    row("vision push staging", v["trainer_vision_push_staging_bytes"])
    row("packed minibatches with images", v["trainer_batches_bytes"], "replaces the text batches")
    row("VL train step temporaries", v["train_step_transient_bytes"],
        f"compiled in {v['train_step']['compile_s']:.1f} s")
    row("VL proximal log-prob temporaries", v["logprobs_transient_bytes"],
        f"compiled in {v['proximal_logprobs']['compile_s']:.1f} s")
    row("peak", v["trainer_peak_bytes"], "fits" if v["trainer_fits"] else "DOES NOT FIT")
    lines.append(f"generator with images (per device; prefill row of {ib['prefill_bucket']} tokens: "
                 f"{ib['prefill_image_prompts']} image prompt(s), tower over {ib['prefill_patches']} patches)")
    row("vision parameters", v["generator_vision_params_bytes"])
    row("incoming vision weights (one push)", v["generator_vision_incoming_bytes"])
    row("vision tower temporaries", v["tower_transient_bytes"], f"compiled in {v['vision_tower']['compile_s']:.1f} s")
    row("VL prefill temporaries", v["prefill_transient_bytes"], f"compiled in {v['prefill']['compile_s']:.1f} s")
    row("peak", v["generator_peak_bytes"], "fits" if v["generator_fits"] else "DOES NOT FIT")
    lines.append(f"VL verdict: {'FITS' if v['fits'] else 'DOES NOT FIT'} ({tg['label']}, budget "
                 f"{tg['budget_bytes'] / GiB:.1f} GiB); programs: {v['programs']}")
    return "\n".join(lines)
