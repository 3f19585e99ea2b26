"""The trainer with images (issue 29 item 4, Qwen2.5-VL): packed log-probs of minibatches that mix sequences with
one image, several images of different sizes and aspect ratios and text-only sequences, several per row, with
micro-batch padding, equal each sequence's reference forward (`qwen2_5_vl.apply` with its own images) in fp32; the
proximal recompute too; a frozen tower stays bitwise unchanged (no optimizer state), a trained one moves; RL steps
move log-probs in the advantage's direction; SFT with images learns; text-only minibatches on a VL model; compile
counts over patch buckets; images shared by the samples of a prompt travel and are put on the device once;
placeholder/grid mismatches name the trajectory.

Real components throughout: the tiny random checkpoint (`testing.make_tiny_vl_model`), encoded PNG images through
`data.images.ImageInputs` (the processor at the tiny tower's 4 x 4 patches), the `Trainer`, `pack`, `run_sft`."""
from __future__ import annotations

import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_async.data.images import ImageInputs, ImageProcessorConfig
from jaxrl_async.models import load_hf, qwen2_5_vl
from jaxrl_async.testing import TINY_VL_TOKENS, make_tiny_vl_model
from jaxrl_async.trainer import PackingConfig, Trainer, TrainStepConfig, TrainSequence, pack, unpack
from jaxrl_async.trainer.packing import PackingError
from jaxrl_async.trainer.train_step import step_metrics

IMG, VS, VE = TINY_VL_TOKENS["image_token_id"], TINY_VL_TOKENS["vision_start_token_id"], TINY_VL_TOKENS["vision_end_token_id"]
PROC = ImageProcessorConfig(min_pixels=8 * 8 * 2, max_pixels=8 * 8 * 24, patch_size=4)
TOL = 1e-5
PACKING = PackingConfig(tokens_per_micro=256, row_len_buckets=(64, 128), n_micro_buckets=(4,), max_seqs_per_row=4)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    cfg, params = load_hf(make_tiny_vl_model(str(tmp_path_factory.mktemp("tiny_vl"))))
    return cfg, params


def _png(rng, h, w) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def _images(rng, sizes) -> ImageInputs:
    data = [_png(rng, h, w) for h, w in sizes]
    grids = [PROC.grid(h, w) for h, w in sizes]
    return ImageInputs(tuple(data), np.asarray(grids), PROC)


def _prompt(rng, images: ImageInputs | None, text=(4, 3)) -> list[int]:
    ids = list(rng.integers(3, 240, text[0]))
    for g in ([] if images is None else images.grid_thw):
        ids += [VS] + [IMG] * PROC.num_tokens(g) + [VE] + list(rng.integers(3, 240, text[1]))
    return ids


def _seq(rng, images, gen_len, adv=None) -> TrainSequence:
    prompt = _prompt(rng, images)
    n = len(prompt) + gen_len
    mask = (np.arange(n) >= len(prompt)).astype(np.int32)
    tokens = np.asarray(prompt + list(rng.integers(3, 240, gen_len)), np.int32)
    adv = rng.standard_normal() if adv is None else adv
    return TrainSequence(tokens=tokens, loss_mask=mask, behaviour_logprobs=np.where(mask > 0, -1.0, 0.0).astype(np.float32),
                         advantages=np.where(mask > 0, adv, 0.0).astype(np.float32), versions=np.where(mask > 0, 0, -1),
                         images=images)


def _mixed(rng) -> list[TrainSequence]:
    """One image (shared by two samples of a prompt), three images of different sizes/aspect ratios (a wide
    one, a tall one, a square one: windows cut short), another tall one, text-only sequences."""
    one = _images(rng, [(24, 32)])
    many = _images(rng, [(16, 48), (40, 12), (20, 20)])
    tall = _images(rng, [(48, 16)])
    return [_seq(rng, one, 9), _seq(rng, one, 6), _seq(rng, many, 7), _seq(rng, None, 11), _seq(rng, tall, 5),
            _seq(rng, None, 4), _seq(rng, many, 3), _seq(rng, None, 50)]


def _reference_logprobs(params, cfg, seq: TrainSequence) -> np.ndarray:
    """log p(token t | < t) of one sequence by the reference forward with its own images (0 at t = 0)."""
    tokens = np.asarray(seq.tokens)[None]
    im = seq.images
    logits = qwen2_5_vl.apply(params, cfg, tokens, None if im is None else im.pixel_values(),
                              None if im is None else im.grid_thw)
    lsm = np.asarray(jax.nn.log_softmax(logits[0].astype(jnp.float32), axis=-1))
    return np.r_[0.0, lsm[np.arange(len(seq) - 1), tokens[0, 1:]]]


def _max_diff(trainer, params, trajs, packed, lp) -> float:
    got = unpack(np.asarray(lp), packed)
    return max(float(np.abs(g[1:] - _reference_logprobs(params, trainer.model_cfg, trajs[i])[1:]).max())
               for g, i in zip(got, packed.indices))


def test_packed_logprobs_equal_reference_forward(model):
    cfg, params = model
    rng = np.random.default_rng(0)
    trajs = _mixed(rng)
    trainer = Trainer(cfg, TrainStepConfig(packing=PACKING))
    packed = trainer.pack(trajs)
    b = packed.batch
    assert b.vision is not None and b.mrope_positions.shape == b.tokens.shape + (3,)
    # several sequences per row, micro-batch padding (4 micro-batches, fewer hold sequences)
    assert packed.n_real_micro < packed.n_micro
    rows_of: dict[tuple[int, int], list[bool]] = {}
    for (m, r, _, _), t in zip(packed.placement, trajs):
        rows_of.setdefault((m, r), []).append(t.images is not None)
    assert any(len(v) > 1 and any(v) and not all(v) for v in rows_of.values())  # images and text share a row
    assert any(sum(v) > 1 for v in rows_of.values())  # rows with several image sequences
    # the two samples of one prompt placed in one micro-batch share one copy of its pixels
    st = packed.image_stats
    assert st["image_sets"] == 3 and st["images"] == 5
    assert st["encoded_bytes"] == sum(o.nbytes for o in {id(t.images): t.images for t in trajs if t.images}.values())
    state = trainer.init_state(params)
    batch = trainer.put_batch(packed)
    lp, _ = trainer.compute_logprobs(state.params, batch)
    diff = _max_diff(trainer, params, trajs, packed, lp)
    assert diff <= TOL, diff
    # the proximal recompute holds the same values on the loss tokens
    prox = np.asarray(trainer.with_recomputed_proximal(state.params, batch).proximal_logprobs)
    np.testing.assert_array_equal(prox, np.where(b.loss_mask > 0, np.asarray(lp), 0.0))
    # one row per micro-batch: a micro-batch of text sequences only (its tower pass sees only padding patches)
    # beside ones with images, and a larger patch bucket (padding patches never reach a real feature): the same
    # reference
    one_row = PackingConfig(tokens_per_micro=64, row_len_buckets=(64, 128), n_micro_buckets=(8,), max_seqs_per_row=4,
                            patch_buckets=(1024,))
    big = pack(trajs, one_row, None, cfg)
    assert big.batch.vision.pixel_values.shape[1] == 1024 > b.vision.pixel_values.shape[1]
    has_seq, has_img = (big.batch.segment_ids > 0).any(axis=(1, 2)), (big.batch.image_index >= 0).any(axis=(1, 2))
    assert (has_seq & ~has_img).any() and (has_seq & has_img).sum() > 1
    lp_big, _ = trainer.compute_logprobs(state.params, trainer.put_batch(big))
    diff = _max_diff(trainer, params, trajs, big, lp_big)
    assert diff <= TOL, diff
    # a text-only minibatch on the VL model: no vision inputs, the text programs, same reference
    text = [t for t in trajs if t.images is None]
    tp = trainer.pack(text)
    assert tp.batch.vision is None and tp.batch.mrope_positions is None and tp.image_stats is None
    tlp, _ = trainer.compute_logprobs(state.params, trainer.put_batch(tp))
    diff = max(float(np.abs(g[1:] - _reference_logprobs(params, cfg, t)[1:]).max())
               for g, t in zip(unpack(np.asarray(tlp), tp), text))
    assert diff <= TOL, diff
    assert trainer.n_compilations["logprobs"] == 3  # VL bucket, larger patch bucket, text


def _vision_leaves(params):
    return [np.asarray(x) for x in jax.tree.leaves(params["vision"])]


@pytest.mark.parametrize("freeze", [True, pytest.param(False, marks=pytest.mark.slow)])  # trained: ~30 s, slow
def test_frozen_or_trained_tower(model, freeze):
    """Frozen: features are constants, no optimizer state for `vision`, the tower bitwise unchanged after steps.
    Trained: its gradient is finite and non-zero and it moves. Either way the RL steps move the log-probs of the
    trained tokens in their advantage's direction, and a text-only minibatch trains on the VL model too."""
    cfg, params = model
    rng = np.random.default_rng(1)
    trajs = _mixed(rng)
    for k, t in enumerate(trajs):  # alternate signs: some sequences up, some down
        t.advantages = np.where(t.loss_mask > 0, 1.0 if k % 2 == 0 else -1.0, 0.0).astype(np.float32)
    opt = TrainStepConfig(packing=PACKING, freeze_vision=freeze).optimizer
    tcfg = TrainStepConfig(packing=PACKING, freeze_vision=freeze,
                           optimizer=type(opt)(lr=3e-3, weight_decay=0.0, max_grad_norm=None))
    trainer = Trainer(cfg, tcfg)
    state = trainer.init_state(params)
    before = _vision_leaves(state.params)
    packed = trainer.pack(trajs)
    lp0, _ = trainer.compute_logprobs(state.params, trainer.put_batch(packed))
    lp0 = np.asarray(lp0)
    opt_paths = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(state.opt_state)}
    assert any("embed" in p for p in opt_paths) and any("vision" in p for p in opt_paths) is not freeze
    for t in trajs:
        if t.images is not None:
            t.images.drop_pixels()  # as they arrive from the rollout: encoded bytes only
    metrics = []
    for _ in range(2):
        state, ms = trainer.train_batch(state, trajs)
        metrics += ms
    assert all(int(m["skipped"]) == 0 and np.isfinite(float(m["grad_norm"])) for m in metrics)  # finite gradients
    after = _vision_leaves(state.params)
    same = [np.array_equal(a, b) for a, b in zip(before, after)]
    assert all(same) if freeze else not any(same)
    lp1 = np.asarray(trainer.compute_logprobs(state.params, trainer.put_batch(packed))[0])
    # every sequence's mean log-prob moved in its advantage's direction
    moved = [float(np.mean((a - b)[t.loss_mask > 0]) * np.sign(t.advantages.sum()))
             for a, b, t in zip(unpack(lp1, packed), unpack(lp0, packed), [trajs[i] for i in packed.indices])]
    assert min(moved) > 0, moved
    # image bytes per step: encoded bytes carried, pixels put on the device once per minibatch
    sm = step_metrics(metrics[:1])
    assert sm["images/encoded_bytes"] == packed.image_stats["encoded_bytes"] > 0
    assert sm["images/device_pixel_bytes"] == packed.batch.vision.pixel_values.nbytes
    # pixels this trainer decoded are dropped again once on the device
    assert all(t.images is None or t.images.__dict__["_pixels"] is None for t in trajs)
    # a text-only minibatch on the VL model trains too (gradient zero for the tower)
    text = [t for t in trajs if t.images is None]
    state, ms = trainer.train_batch(state, text)
    assert int(ms[0]["skipped"]) == 0 and "images/count" not in ms[0]
    assert trainer.n_compilations["step"] == 2  # the VL bucket and the text one


def test_compile_counts_over_patch_buckets(model):
    cfg, params = model
    rng = np.random.default_rng(2)
    pk = PackingConfig(tokens_per_micro=128, row_len_buckets=(128,), n_micro_buckets=(2,), max_seqs_per_row=4,
                       patch_buckets=(128, 512))
    trainer = Trainer(cfg, TrainStepConfig(packing=pk))
    state = trainer.init_state(params)
    small = [[_seq(rng, _images(rng, [(24, 16)]), 4), _seq(rng, None, 5)],
             [_seq(rng, _images(rng, [(16, 24)]), 6)],
             [_seq(rng, _images(rng, [(16, 16), (8, 24)]), 3)]]
    for trajs in small:
        p = trainer.pack(trajs)
        assert p.batch.vision.pixel_values.shape[1] == 128
        state, _ = trainer.step(state, p)
    assert trainer.n_compilations == {"step": 1, "logprobs": 0}
    big = trainer.pack([_seq(rng, _images(rng, [(48, 32)] * 3), 4)])  # 288 patches: the next bucket
    assert big.batch.vision.pixel_values.shape[1] == 512
    state, _ = trainer.step(state, big)
    assert trainer.n_compilations["step"] == 2


def test_sft_with_images_learns(model):
    """SFT examples carry images: the answer depends on the image (its mean brightness), so only a model that
    sees it can fit both classes; the token-mean NLL falls, the step compiles once."""
    from jaxrl_async.config import SFTConfig
    from jaxrl_async.trainer.sft import SFTExample, run_sft

    cfg, params = model
    rng = np.random.default_rng(3)
    examples = []
    for k in range(8):
        from PIL import Image

        buf = io.BytesIO()
        level = 30 if k % 2 else 220
        Image.fromarray(np.full((24, 24, 3), level, np.uint8)).save(buf, format="PNG")
        im = ImageInputs((buf.getvalue(),), np.asarray([PROC.grid(24, 24)]), PROC)
        answer = [40, 41, 2] if k % 2 else [50, 51, 2]
        examples.append(SFTExample(_prompt(rng, im), answer, images=im))
    sft = SFTConfig(steps=12, batch_size=4, lr=1e-2, warmup_steps=1, weight_decay=0.0)
    _, hist = run_sft(params, cfg, examples, sft, progress=False)
    assert hist[-1]["loss"] < 0.5 * hist[0]["loss"], [h["loss"] for h in hist]
    assert hist[-1]["compilations"] == 1


def test_image_token_mismatch_names_the_trajectory(model):
    cfg, _ = model
    rng = np.random.default_rng(4)
    good = [_seq(rng, _images(rng, [(24, 32)]), 4) for _ in range(3)]
    bad = _seq(rng, _images(rng, [(24, 32)]), 4)
    bad.images = _images(rng, [(16, 16)])  # 4 features for 12 placeholders
    with pytest.raises(PackingError, match=r"trajectory 3: 12 image placeholder tokens but field images .* gives 4"):
        pack(good + [bad], PACKING, None, cfg)
    stray = _seq(rng, None, 4)
    stray.tokens = stray.tokens.copy()
    stray.tokens[1] = IMG
    with pytest.raises(PackingError, match="trajectory 1: 1 image placeholder tokens .* no images"):
        pack([_seq(rng, None, 3), stray], PACKING, None, cfg)
    with pytest.raises(PackingError, match="trajectory 0 carries images but the model is not a vision-language"):
        pack(good, PACKING, None, cfg.text)
    other = ImageInputs(good[0].images.images, good[0].images.grid_thw,
                        ImageProcessorConfig(min_pixels=8 * 8 * 2, max_pixels=8 * 8 * 24, patch_size=4, merge_size=1))
    good[1].images = other
    with pytest.raises(PackingError, match="trajectory 1: field images was processed with .* merge 1"):
        pack(good, PACKING, None, cfg)
    video = _images(rng, [(24, 32)])
    px = video.pixel_values().reshape(-1, 3, 2, 16).copy()
    px[:, :, 1] += 1.0  # a second frame that differs from the first
    object.__setattr__(video, "_pixels", px.reshape(-1, 96))
    good[1].images = video
    with pytest.raises(PackingError, match="trajectory 1: field images holds frames that differ .*videos are not supported"):
        pack(good, PACKING, None, cfg)
    with pytest.raises(ValueError, match="TrainStepConfig.freeze_vision: needs a vision-language model"):
        Trainer(cfg.text, TrainStepConfig(packing=PACKING, freeze_vision=True))


def test_trajectories_carry_images_to_the_trainer(model):
    """rollout Trajectory -> rl.build_training_batch -> TrainSequence keeps the one ImageInputs object of a prompt
    (no copy per sample); a pickle of the batch carries the encoded bytes once and no pixels."""
    import dataclasses
    import pickle

    from jaxrl_async.rl.advantages import AdvantageConfig
    from jaxrl_async.rl.batch import build_training_batch
    from jaxrl_async.rollout.staleness import ConsumedGroup, Ticket
    from jaxrl_async.rollout.workflow import Trajectory, TrajectoryGroup

    rng = np.random.default_rng(5)
    im = _images(rng, [(24, 32), (16, 16)])
    prompt = _prompt(rng, im)
    trajs = [Trajectory.from_completion(prompt, [7, 8, 2], [-0.5] * 3, [0] * 3, float(k), "stop", images=im)
             for k in range(4)]
    text = Trajectory.from_completion([5, 6, 7], [8, 2], [-0.5] * 2, [0] * 2, 1.0, "stop")
    groups = [ConsumedGroup(ticket=Ticket(0, 0, 0.0), item=TrajectoryGroup({"id": 0}, trajs, 0), head_version=0,
                            finish_time=0.0, lag=0),
              ConsumedGroup(ticket=Ticket(1, 0, 0.0), item=TrajectoryGroup({"id": 1}, [text], 1), head_version=0,
                            finish_time=0.0, lag=0)]
    seqs, _ = build_training_batch(groups, AdvantageConfig(), group_size=4)
    assert all(s.images is im for s in seqs[:4]) and seqs[4].images is None
    im.pixel_values()  # decoded here: never pickled
    blob = pickle.dumps(seqs)
    without = pickle.dumps([dataclasses.replace(s, images=None) for s in seqs])
    assert len(blob) - len(without) < im.nbytes + 1024 < im.pixel_values().nbytes // 4  # one copy, bytes only
    back = pickle.loads(blob)
    assert back[0].images is back[3].images and back[0].images.__dict__["_pixels"] is None
    with pytest.raises(ValueError, match="Trajectory.images: 2 images of 16 placeholder tokens do not fit"):
        Trajectory.from_completion([5, 6], [8, 2], [-0.5] * 2, [0] * 2, 1.0, "stop", images=im)
    cfg, _ = model
    p = pack(seqs, PACKING, None, cfg)
    assert p.image_stats["image_sets"] == 1 and p.image_stats["images"] == 2


@pytest.mark.slow
def test_sharded_trainer(model):
    """On a 4-device (fsdp 2 x tensor 2) mesh: rows split over fsdp, the vision inputs replicated; the packed
    log-probs still equal the reference forward and a step applies."""
    from jaxrl_async.sharding import make_mesh

    cfg, params = model
    rng = np.random.default_rng(6)
    trajs = _mixed(rng)
    trainer = Trainer(cfg, TrainStepConfig(packing=PACKING), make_mesh({"fsdp": 2, "tensor": 2},
                                                                      devices=jax.devices()[:4]))
    state = trainer.init_state(params)
    packed = trainer.pack(trajs)
    assert packed.rows_per_micro % 2 == 0
    batch = trainer.put_batch(packed)
    assert batch.tokens.sharding.spec[1] is not None and batch.vision.pixel_values.sharding.is_fully_replicated
    lp, _ = trainer.compute_logprobs(state.params, batch)
    diff = _max_diff(trainer, params, trajs, packed, lp)
    assert diff <= TOL, diff
    state, m = trainer.step(state, packed, batch)
    assert int(m["skipped"]) == 0 and np.isfinite(float(m["loss"]))


def test_run_config_key(tmp_path):
    """``trainer.freeze_vision`` reaches the train step; it needs a vision-language policy (the default qwen3 has no
    vision tower) and is fixed across a resume (the optimizer state holds the tower's moments or not)."""
    from jaxrl_async.config import ConfigError, apply_overrides, validate
    from jaxrl_async.config.default import get_config
    from jaxrl_async.config.resume import RESUME_FIXED
    from jaxrl_async.trainer.factory import trainer_config

    cfg = apply_overrides(get_config(), [f"run_dir={tmp_path / 'run'}", "trainer.freeze_vision=true"])
    assert trainer_config(cfg).freeze_vision and not trainer_config(get_config()).freeze_vision
    with pytest.raises(ConfigError) as e:
        validate(cfg, num_devices=1)
    assert e.value.field == "trainer.freeze_vision" and "vision-language" in str(e.value)
    assert "trainer.freeze_vision" in RESUME_FIXED
