"""Image bytes moved per RL step by the trainer (issue 29 item 4): what the trajectories carry (the encoded files of
their distinct `ImageInputs`, shared by the n samples of a prompt), what the trainer decodes (once per object) and
what it puts on the device (per micro-batch: the pixels of its distinct image sets, bucket padding included, and the
layout / M-RoPE arrays), against shipping float32 pixels with every trajectory.

    python benchmarks/vl_image_bytes.py [--prompts 8] [--samples 4]

Two settings: the tiny model's (4 x 4 patches, small PNGs; one real `Trainer.train_batch` on the tiny random
Qwen2.5-VL, metrics from the step) and Qwen2.5-VL's processor (14 x 14 patches, 640 x 480 JPEGs; packing only, no
model: the vision tower's shapes are the released ones)."""
from __future__ import annotations

import argparse
import dataclasses
import io
import tempfile

import numpy as np

from jaxrl_async.data.images import ImageInputs, ImageProcessorConfig


def _photo(rng, h, w, fmt):
    from PIL import Image

    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([(x * 255 // w), (y * 255 // h), ((x + y) * 127 // (h + w))], -1)
    img = np.clip(base + rng.normal(0, 12, (h, w, 3)), 0, 255).astype(np.uint8)  # a gradient with sensor noise
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return buf.getvalue()


def _sequences(rng, cfg, proc, n_prompts, n_samples, size, fmt, gen_len):
    from jaxrl_async.trainer import TrainSequence

    out = []
    for _ in range(n_prompts):
        im = ImageInputs((_photo(rng, *size, fmt),), np.asarray([proc.grid(*size)]), proc)
        prompt = [5, 6, cfg.vision_start_token_id] + [cfg.image_token_id] * im.num_tokens + [cfg.vision_end_token_id, 7]
        for _ in range(n_samples):
            n = len(prompt) + gen_len
            mask = (np.arange(n) >= len(prompt)).astype(np.int32)
            out.append(TrainSequence(tokens=np.asarray(prompt + list(rng.integers(3, 240, gen_len)), np.int32),
                                     loss_mask=mask, behaviour_logprobs=-mask.astype(np.float32),
                                     advantages=mask * rng.standard_normal(), versions=np.where(mask > 0, 0, -1),
                                     images=im))
    return out


def _report(name, seqs, stats):
    per_traj = sum(s.images.pixel_values().nbytes for s in seqs)
    print(f"{name}: {len(seqs)} trajectories, {stats['images/sets']:.0f} distinct images")
    for k in ("images/encoded_bytes", "images/decoded_bytes", "images/device_pixel_bytes", "images/device_bytes"):
        print(f"  {k:28s} {stats[k] / 1e6:10.3f} MB")
    print(f"  {'pixels with every trajectory':28s} {per_traj / 1e6:10.3f} MB "
          f"({per_traj / stats['images/encoded_bytes']:.0f}x the encoded bytes)")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=4)
    args = ap.parse_args()
    from jaxrl_async.models import load_hf
    from jaxrl_async.models.vision import VisionConfig
    from jaxrl_async.testing import make_tiny_vl_model
    from jaxrl_async.trainer import PackingConfig, Trainer, TrainStepConfig
    from jaxrl_async.trainer.train_step import image_metrics, step_metrics

    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as d:
        cfg, params = load_hf(make_tiny_vl_model(d))
    proc = ImageProcessorConfig(min_pixels=8 * 8 * 2, max_pixels=8 * 8 * 24, patch_size=4)
    seqs = _sequences(rng, cfg, proc, args.prompts, args.samples, (32, 32), "PNG", 12)
    trainer = Trainer(cfg, TrainStepConfig(packing=PackingConfig(tokens_per_micro=256, row_len_buckets=(64, 128))))
    state = trainer.init_state(params)
    state, ms = trainer.train_batch(state, seqs)
    _report("tiny model (4x4 patches, 32x32 PNG)", seqs, step_metrics(ms))

    real = dataclasses.replace(cfg, vision=VisionConfig(out_hidden_size=cfg.text.hidden_size))
    seqs = _sequences(rng, real, ImageProcessorConfig(), args.prompts, args.samples, (480, 640), "JPEG", 256)
    pk = PackingConfig(tokens_per_micro=4096, row_len_buckets=(1024,))
    from jaxrl_async.trainer import pack

    p = pack(seqs, pk, None, real)
    _report(f"Qwen2.5-VL processor (14x14 patches, 640x480 JPEG; {p.n_micro} micro-batches of {p.rows_per_micro} "
            f"rows)", seqs, image_metrics(p.image_stats))


if __name__ == "__main__":
    main()
