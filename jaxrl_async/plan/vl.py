"""Will a Qwen2.5-VL run fit its hardware? The planner for vision-language models (issue 29 item 6).

The run config's policy is a Qwen2.5-VL model (``model.model_type=qwen2_5_vl`` with ``model.vision``, or a Qwen2.5-VL
checkpoint in ``model.path``): the text decoder (``VLConfig.text``) with a vision tower in front
(``models/qwen2_5_vl.py``). The plan is the decoder's plan (``planner.make_plan`` on the run config with the
decoder as its policy, `decoder_run_config`: the generator's decode step after a prompt IS the decoder's, with 1-D
positions index + rope delta; the KV pool, the weight push and the text batches are the decoder's) plus what the
images add:

* resident: the vision tower's parameters (trainer: float32 master weights + AdamW moments, sharded by the
  trainer rules; generator: the compute dtype by the generator rules, plus one incoming push of them) and the
  pixel patches of the packed minibatches (float32 [patches, C*Tp*P*P] per image, up to the image budget);
* programs compiled for the target: the VL train step (vision tower over every row's images -> features scattered
  into the image placeholders -> M-RoPE decoder -> token log-probs -> ``rl.losses.policy_loss`` -> gradients ->
  AdamW on every parameter, donated) and the VL prefill of one prompt at the image budget (vision tower + M-RoPE
  decoder over the prompt). Their temporaries replace the decoder's train step / prefill temporaries in the peaks.

The image budget (`ImageBudget`): images per prompt x visual tokens per image (1280 = the Qwen2.5-VL model card's
recommended ``max_pixels = 1280 * 28 * 28``; the tower sees m^2 = 4 patches per token: 5120). Every row of the
train micro-batch holds its sequences' images (rows at the longest bucket hold one sequence each); the tower runs
per row (``vmap``), so its patches split over the trainer's batch axes like the rows.

Seam: ``vl_train_step`` and ``vl_prefill`` below are this module's own thin programs, written while the trainer's
VL loss (branch ``vltrain``) and the generator's VL prefill (branch ``vlgen``) were in progress; the plan takes them
through ``VL_PROGRAMS`` (name -> builder), the one place to swap in ``Trainer``'s and ``PagedEngine``'s own VL
programs once they exist.
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


def pixel_bytes_per_row(vl, budget: ImageBudget, seqs_per_row: int) -> int:
    """float32 pixel patches of one packed row's images."""
    return seqs_per_row * budget.patches_per_prompt(vl.vision.spatial_merge_size) * vl.vision.patch_dim * 4


def vl_memory(vl, budget: ImageBudget, trn_mesh, gen_mesh, *, rows: int, seqs_per_row: int, n_micro: int,
              minibatches: int, push_dtype: str = "bfloat16") -> dict[str, int]:
    """What the images add per device, from shapes and shardings alone: the vision tower's parameters, AdamW
    moments and push staging (trainer), its weights and one incoming push (generator), and the pixel patches of
    the packed minibatches (rows split over the trainer's batch axes)."""
    from jaxrl_async.trainer.train_step import batch_axis_size

    trn_params = vision_bytes(vl, trn_mesh, "trainer", "float32")
    gen_params = vision_bytes(vl, gen_mesh, "generator", vl.text.dtype)
    dp = batch_axis_size(trn_mesh)
    rows_per_device = -(-rows // dp)
    pixels = pixel_bytes_per_row(vl, budget, seqs_per_row) * rows_per_device * n_micro * minibatches
    return {"trainer_vision_params_bytes": trn_params, "trainer_vision_optimizer_bytes": 2 * trn_params,
            "trainer_vision_push_staging_bytes": vision_bytes(vl, trn_mesh, "trainer", push_dtype),
            "trainer_pixel_batches_bytes": pixels,
            "generator_vision_params_bytes": gen_params, "generator_vision_incoming_bytes": gen_params}


# =============================================================================================
# The programs (thin; see the module docstring's seam)
# =============================================================================================
def _row_layout(vl, budget: ImageBudget, seqs_per_row: int):
    """The vision layout of one row's images at the budget (numpy arrays)."""
    from jaxrl_async.models import vision

    grids = [budget.grid(vl.vision.spatial_merge_size)] * (budget.images_per_prompt * seqs_per_row)
    return vision.vision_layout(vl.vision, grids).arrays()


def vl_train_step(vl, loss_cfg, *, lr: float = 1e-5, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                  weight_decay: float = 0.01, chunk: int = 2048):
    """``step(state, batch) -> (state, loss)``: one VL policy-gradient step over a packed minibatch of n_micro
    micro-batches whose rows carry their images, as ``Trainer``'s step (a scan over the micro-batches accumulating
    float32 gradients, then one AdamW update). Every leaf of ``batch`` has a leading [n_micro] axis: tokens /
    segment_ids / loss arrays [n_micro, R, T], positions [n_micro, 3, R, T], ``pixels`` [n_micro, R, N, C*Tp*P*P],
    ``layout`` the rows' `vision.vision_layout` arrays [n_micro, R, ...]. state = (params, mu, nu, count), float32,
    AdamW on every parameter (vision tower included; a frozen tower would drop its moments)."""
    import jax
    import jax.numpy as jnp

    from jaxrl_async.models import qwen2_5_vl, transformer
    from jaxrl_async.rl.losses import policy_loss

    def loss_fn(params, batch):
        tokens, seg = batch["tokens"], batch["segment_ids"]
        feats = jax.vmap(lambda pv, lay: qwen2_5_vl.image_features(params, vl, pv, lay))(batch["pixels"],
                                                                                           batch["layout"])
        embeds = jax.vmap(lambda t, f: qwen2_5_vl.embed_inputs(params, vl, t[None], f)[0])(tokens, feats)
        hidden, _ = transformer.forward(params, vl.text, tokens, batch["positions"],
                                        transformer.model_attention(vl.text, seg), None, embeds=embeds)
        targets = jnp.concatenate([tokens[:, 1:], jnp.zeros_like(tokens[:, :1])], axis=1)
        lp, ent = transformer.token_logprobs_from_hidden(params, hidden, targets, 1.0, chunk)
        mask = batch["loss_mask"]
        loss, _ = policy_loss(lp, batch["proximal_logprobs"], batch["behaviour_logprobs"], batch["advantages"],
                              mask, loss_cfg, normaliser=jnp.maximum(mask.sum(), 1.0), entropy=ent)
        return loss

    def step(state, batch):
        params, mu, nu, count = state

        def micro(acc, mb):
            loss, g = jax.value_and_grad(loss_fn)(params, mb)
            return (jax.tree.map(jnp.add, acc[0], g), acc[1] + loss), None

        zeros = jax.tree.map(jnp.zeros_like, params)
        (g, loss), _ = jax.lax.scan(micro, (zeros, jnp.zeros((), jnp.float32)), batch)
        count = count + 1
        c1, c2 = 1 - b1 ** count.astype(jnp.float32), 1 - b2 ** count.astype(jnp.float32)
        mu = jax.tree.map(lambda m, x: b1 * m + (1 - b1) * x, mu, g)
        nu = jax.tree.map(lambda v, x: b2 * v + (1 - b2) * x * x, nu, g)
        params = jax.tree.map(lambda p, m, v: p - lr * ((m / c1) / (jnp.sqrt(v / c2) + eps) + weight_decay * p),
                              params, mu, nu)
        return (params, mu, nu, count), loss

    return step


def vl_prefill(vl):
    """``prefill(params, tokens [1, T], positions [3, 1, T], pixels [N, C*Tp*P*P], layout) -> logits [1, V]`` of the
    prompt's last position: the vision tower over the prompt's images, the features in the placeholders, the
    M-RoPE decoder over the prompt (KV written by the engine's attend hook in the real prefill)."""
    import jax.numpy as jnp

    from jaxrl_async.models import qwen2_5_vl, transformer

    def prefill(params, tokens, positions, pixels, layout):
        feats = qwen2_5_vl.image_features(params, vl, pixels, layout)
        embeds = qwen2_5_vl.embed_inputs(params, vl, tokens, feats)
        seg = jnp.ones(tokens.shape, jnp.int32)
        hidden, _ = transformer.forward(params, vl.text, tokens, positions, transformer.model_attention(vl.text, seg),
                                        None, embeds=embeds)
        return transformer.logits_from_hidden(params, hidden[:, -1])

    return prefill


VL_PROGRAMS = {"train_step": vl_train_step, "prefill": vl_prefill}


def _abstract_train(vl, mesh, n_micro: int, rows: int, row_len: int, budget: ImageBudget, seqs_per_row: int):
    import jax
    import jax.numpy as jnp

    from jaxrl_async.models import qwen2_5_vl
    from jaxrl_async.models.shardings import model_shardings
    from jaxrl_async.sharding.rules import activation_sharding

    full = vl.replace(param_dtype="float32")
    sh = model_shardings(full, mesh, "trainer")
    params = jax.tree.map(lambda s, x: _sds(s.shape, jnp.float32, x), qwen2_5_vl.param_shapes(full), sh)
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    state = (params, params, params, _sds((), jnp.int32, rep))
    row = activation_sharding(mesh, "trainer", None, "batch", "length")
    pos = activation_sharding(mesh, "trainer", None, None, "batch", "length")
    lay = _row_layout(vl, budget, seqs_per_row)
    n = lay["order"].shape[0]
    by_row = lambda nd: activation_sharding(mesh, "trainer", None, "batch", *([None] * (nd - 2)))  # noqa: E731
    batch = {f: _sds((n_micro, rows, row_len), jnp.int32 if f in ("tokens", "segment_ids") else jnp.float32, row)
             for f in ("tokens", "segment_ids", "loss_mask", "proximal_logprobs", "behaviour_logprobs", "advantages")}
    batch["positions"] = _sds((n_micro, 3, rows, row_len), jnp.int32, pos)
    batch["pixels"] = _sds((n_micro, rows, n, vl.vision.patch_dim), jnp.float32, by_row(4))
    batch["layout"] = {k: _sds((n_micro, rows, *a.shape), a.dtype, by_row(a.ndim + 2)) for k, a in lay.items()}
    return state, batch


def compile_vl_train_step(vl, loss_cfg, mesh, n_micro: int, rows: int, row_len: int, budget: ImageBudget,
                          seqs_per_row: int, options=None, chunk: int = 2048):
    """(compiled, ExecutableMemory) of the VL train step over a minibatch of ``n_micro`` micro-batches of ``rows``
    x ``row_len`` on ``mesh`` (abstract arguments; nothing allocated)."""
    import jax

    from jaxrl_async.sharding.activations import traced_with_activation_rules

    state, batch = _abstract_train(vl, mesh, n_micro, rows, row_len, budget, seqs_per_row)
    step = VL_PROGRAMS["train_step"](vl, loss_cfg, chunk=chunk)
    state_sh = jax.tree.map(lambda a: a.sharding, state)
    fn = jax.jit(traced_with_activation_rules(step, mesh, "trainer"), donate_argnums=(0,),
                 out_shardings=(state_sh, jax.tree.leaves(state)[-1].sharding))
    return compile_executable("vl_train_step", fn, (state, batch), vl.text.dtype, options)


def compile_vl_prefill(vl, mesh, prompt_len: int, budget: ImageBudget, options=None):
    """(compiled, ExecutableMemory) of the VL prefill of one prompt of ``prompt_len`` tokens with the budget's
    images on the generator ``mesh`` (weights in the compute dtype, generator rules)."""
    import jax
    import jax.numpy as jnp

    from jaxrl_async.models import qwen2_5_vl
    from jaxrl_async.models.shardings import model_shardings
    from jaxrl_async.sharding.activations import traced_with_activation_rules

    if prompt_len < budget.image_tokens_per_prompt():
        raise PlanError(f"prompt length {prompt_len} is under the image budget's {budget.image_tokens_per_prompt()} "
                        f"visual tokens: raise data.max_prompt_len / rollout.engine.max_prefill_length")
    gen = vl.replace(param_dtype=vl.text.dtype)
    sh = model_shardings(gen, mesh, "generator")
    params = jax.tree.map(lambda s, x: _sds(s.shape, s.dtype, x), qwen2_5_vl.param_shapes(gen), sh)
    lay = _row_layout(vl, budget, 1)
    args = (params, _sds((1, prompt_len), jnp.int32), _sds((3, 1, prompt_len), jnp.int32),
            _sds((lay["order"].shape[0], vl.vision.patch_dim), jnp.float32),
            {k: _sds(a.shape, a.dtype) for k, a in lay.items()})
    fn = jax.jit(traced_with_activation_rules(VL_PROGRAMS["prefill"](vl), mesh, "generator"))
    return compile_executable("vl_prefill", fn, args, vl.text.dtype, options)


# =============================================================================================
# The plan
# =============================================================================================
def make_vl_plan(cfg, budget: ImageBudget = ImageBudget(), *, num_devices: int | None = None,
                 target: str | None = None, headroom: float = 0.10, compile_for: str = "auto") -> dict[str, Any]:
    """The decoder's plan (``planner.make_plan`` of `decoder_run_config`) with the VL additions of the module
    docstring under ``"vl"``: resident bytes of the vision tower and the pixels, the VL train step and VL prefill
    compiled on the same meshes (for the target when the decoder's programs were), and the VL peaks and verdict
    per side. ``cfg``: a run config whose policy is a Qwen2.5-VL model (`vl_model_config`)."""
    import jax

    from jaxrl_async.config import resolve_device_split, resolve_shape
    from jaxrl_async.plan import aot
    from jaxrl_async.plan.planner import batch_shape, default_num_devices, make_plan
    from jaxrl_async.sharding.mesh import make_mesh
    from jaxrl_async.trainer.factory import build_trainer

    vl = vl_model_config(cfg)
    cfg = decoder_run_config(cfg, vl)
    vl = vl.replace(dtype=cfg.model.dtype, remat=cfg.model.remat, attention=cfg.model.attention,
                    attention_block=cfg.model.attention_block)
    if cfg.data.max_prompt_len is not None and cfg.data.max_prompt_len < budget.image_tokens_per_prompt():
        raise PlanError(f"data.max_prompt_len {cfg.data.max_prompt_len} is under the image budget's "
                        f"{budget.image_tokens_per_prompt()} visual tokens per prompt")
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

    # the largest packed micro-batch, as the decoder's plan (rows of the longest bucket: one sequence a row)
    trainer = build_trainer(cfg, cfg.model.model_config(vocab_size=cfg.model.vocab_size), trn_mesh)
    n_micro, rows, row_len, _ = batch_shape(cfg, trainer)
    seqs_per_row = max(1, min(trainer.cfg.packing.max_seqs_per_row,
                              row_len // cfg.rollout.engine.max_sequence_length))
    mem = vl_memory(vl, budget, trn_mesh, gen_mesh, rows=rows, seqs_per_row=seqs_per_row, n_micro=n_micro,
                    minibatches=cfg.trainer.ppo_n_minibatches)
    _, step_mem = compile_vl_train_step(vl_c, cfg.trainer.loss,
                                        trn_mesh, n_micro, rows, row_len, budget, seqs_per_row, options,
                                        cfg.trainer.logprob_chunk)
    prompt_len = cfg.rollout.engine.max_prefill_length or cfg.data.max_prompt_len
    _, pre_mem = compile_vl_prefill(vl_c, gen_mesh, prompt_len, budget, options)

    t, g, budget_bytes = r["trainer"], r["generator"], r["target"]["budget_bytes"]
    # the VL step's arguments are the decoder's + vision state + one minibatch's pixels (resident: all minibatches');
    # its transient bytes replace the decoder step's (the proximal log-prob pass is bounded by the step: forward only)
    trn_resident = (t["params_bytes"] + t["optimizer_state_bytes"] + t["batches_bytes"] + t["push_staging_bytes"]
                    + mem["trainer_vision_params_bytes"] + mem["trainer_vision_optimizer_bytes"]
                    + mem["trainer_vision_push_staging_bytes"] + mem["trainer_pixel_batches_bytes"])
    trn_peak = trn_resident + max(step_mem.transient_bytes, t["logprobs_transient_bytes"])
    gen_resident = (g["params_bytes"] + g["incoming_weights_bytes"] + g["kv_cache_bytes"] + g["slot_state_bytes"]
                    + mem["generator_vision_params_bytes"] + mem["generator_vision_incoming_bytes"])
    gen_peak = gen_resident + max(g["decode_transient_bytes"], pre_mem.transient_bytes)
    if r["devices"]["colocated"]:
        trn_peak = gen_peak = trn_peak + gen_peak
    from jaxrl_async.models.vl_presets import vl_num_params

    r["vl"] = {
        "params": vl_num_params(vl), "vision_depth": vl.vision.depth,
        "image_budget": {"images_per_prompt": budget.images_per_prompt, "tokens_per_image": budget.tokens_per_image,
                         "grid_thw": list(budget.grid(vl.vision.spatial_merge_size)),
                         "patches_per_prompt": budget.patches_per_prompt(vl.vision.spatial_merge_size),
                         "prompt_len": prompt_len, "rows": rows, "row_len": row_len, "seqs_per_row": seqs_per_row,
                         "n_micro": n_micro},
        **mem,
        "train_step": dataclasses.asdict(step_mem), "prefill": dataclasses.asdict(pre_mem),
        "train_step_transient_bytes": step_mem.transient_bytes, "prefill_transient_bytes": pre_mem.transient_bytes,
        "trainer_peak_bytes": trn_peak, "generator_peak_bytes": gen_peak,
        "trainer_fits": trn_peak <= budget_bytes, "generator_fits": gen_peak <= budget_bytes,
        "compiled_for": r["compiled_for"]["trainer"] if on_target else f"{devices[0].platform} ({vl_c.text.dtype})",
        "programs": "plan.vl thin programs (VL_PROGRAMS)",
    }
    r["vl"]["fits"] = r["vl"]["trainer_fits"] and r["vl"]["generator_fits"]
    return r


def format_vl_plan(r: dict[str, Any]) -> str:
    from jaxrl_async.plan.planner import format_plan

    v, tg = r["vl"], r["target"]
    gib = lambda b: f"{b / GiB:8.2f} GiB"  # noqa: E731
    ib = v["image_budget"]
    lines = [format_plan(r), "",
             f"VL (Qwen2.5-VL, {v['params'] / 1e9:.3f} B params, vision depth {v['vision_depth']}): "
             f"{ib['images_per_prompt']} image(s) x {ib['tokens_per_image']} visual tokens per prompt "
             f"(grid {ib['grid_thw']}, {ib['patches_per_prompt']} patches), prompts of {ib['prompt_len']} tokens; "
             f"train micro-batch {ib['rows']} rows x {ib['row_len']} ({ib['seqs_per_row']} sequence(s) a row); "
             f"compiled for {v['compiled_for']}"]
    row = lambda label, b, extra="": lines.append(f"  {label:<40}{gib(b)}{'   ' + extra if extra else ''}")  # noqa: E731
    lines.append("trainer, added by the images (per device)")
    row("vision parameters (float32)", v["trainer_vision_params_bytes"])
    row("vision AdamW moments", v["trainer_vision_optimizer_bytes"])
    row("vision push staging", v["trainer_vision_push_staging_bytes"])
    row("pixel patches of the minibatches", v["trainer_pixel_batches_bytes"])
    row("VL train step temporaries", v["train_step_transient_bytes"],
        f"compiled in {v['train_step']['compile_s']:.1f} s")
    row("peak", v["trainer_peak_bytes"], "fits" if v["trainer_fits"] else "DOES NOT FIT")
    lines.append("generator, added by the images (per device)")
    row("vision parameters", v["generator_vision_params_bytes"])
    row("incoming vision weights (one push)", v["generator_vision_incoming_bytes"])
    row("VL prefill temporaries", v["prefill_transient_bytes"], f"compiled in {v['prefill']['compile_s']:.1f} s")
    row("peak", v["generator_peak_bytes"], "fits" if v["generator_fits"] else "DOES NOT FIT")
    lines.append(f"VL verdict: {'FITS' if v['fits'] else 'DOES NOT FIT'} ({tg['label']}, budget "
                 f"{tg['budget_bytes'] / GiB:.1f} GiB); programs: {v['programs']}")
    return "\n".join(lines)
