"""Rows with images (data/images.py) against transformers' Qwen2_5_VLProcessor with the PIL image processor
(``Qwen2VLImageProcessorPil``: the default "fast" one imports torchvision, which the test extra does not have):
token ids exactly, pixel values within 1e-6, grids exactly; bad images named by row or skipped and counted."""
from __future__ import annotations

import base64
import io
import json
import os

import numpy as np
import pytest

pytest.importorskip("PIL")
from PIL import Image, ImageOps  # noqa: E402

from jaxrl_async.data import DataFormatError, DatasetConfig, make_train_iterator  # noqa: E402
from jaxrl_async.data.images import (  # noqa: E402
    ImageProcessorConfig,
    VLPromptRecord,
    batch_vision_inputs,
    decode_image,
    load_vl_prompt_dataset,
    process_image,
    read_vl_prompt_records,
    smart_resize,
    user_content,
)

# small bounds keep the images tiny: Qwen2.5-VL's patching (14, merge 2) and the tiny model's (4, merge 2)
REAL = ImageProcessorConfig(min_pixels=56 * 56, max_pixels=28 * 28 * 12)
TINY = ImageProcessorConfig(min_pixels=8 * 8 * 2, max_pixels=8 * 8 * 12, patch_size=4)


def _hf_image_processor(cfg: ImageProcessorConfig):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(min_pixels=cfg.min_pixels, max_pixels=cfg.max_pixels, patch_size=cfg.patch_size,
                                    temporal_patch_size=cfg.temporal_patch_size, merge_size=cfg.merge_size,
                                    image_mean=list(cfg.image_mean), image_std=list(cfg.image_std))


def _png(img: Image.Image, fmt: str = "PNG", **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


def _images() -> dict[str, bytes]:
    """Encoded test images: sizes and aspect ratios (up- and down-scaled), RGBA / LA / greyscale / palette (with
    and without transparency) / JPEG."""
    rng = np.random.RandomState(0)
    rgb = lambda h, w: Image.fromarray(rng.randint(0, 256, (h, w, 3), dtype=np.uint8))  # noqa: E731
    rgba = Image.fromarray(rng.randint(0, 256, (45, 61, 4), dtype=np.uint8), "RGBA")
    pal = rgb(30, 50).convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
    pal_t = pal.copy()
    pal_t.info["transparency"] = 3
    return {
        "rgb_50x90": _png(rgb(50, 90)),
        "rgb_17x33_upscaled": _png(rgb(17, 33)),
        "rgb_130x150_downscaled": _png(rgb(130, 150)),
        "wide_12x200": _png(rgb(12, 200)),
        "tall_140x20": _png(rgb(140, 20)),
        "rgba": _png(rgba),
        "la": _png(Image.fromarray(rng.randint(0, 256, (40, 36, 2), dtype=np.uint8), "LA")),
        "grey": _png(Image.fromarray(rng.randint(0, 256, (64, 48), dtype=np.uint8), "L")),
        "palette": _png(pal),
        "palette_transparency": _png(pal_t),
        "jpeg": _png(rgb(70, 44), "JPEG", quality=90),
    }


def _hf_input(data: bytes):
    """What a transformers user hands the processor: the opened, upright (not converted) PIL image."""
    return ImageOps.exif_transpose(Image.open(io.BytesIO(data)))


@pytest.mark.parametrize("cfg", [REAL, TINY], ids=["patch14", "patch4"])
def test_image_processor_equals_hf(cfg):
    hf = _hf_image_processor(cfg)
    worst = 0.0
    for name, data in _images().items():
        ours, grid = process_image(decode_image(data), cfg)
        ref = hf(images=[_hf_input(data)])
        assert [list(grid)] == ref["image_grid_thw"].tolist(), name
        assert ours.shape == ref["pixel_values"].shape and ours.dtype == np.float32, name
        worst = max(worst, float(np.abs(ours - ref["pixel_values"]).max()))
        assert cfg.num_tokens(grid) * cfg.merge_size ** 2 == ours.shape[0]
    assert worst <= 1e-6, worst
    print(f"max |pixel - HF| over {len(_images())} images: {worst:.1e}")


def test_smart_resize_bounds_and_alpha_on_white():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf_smart_resize

    for h, w in [(17, 33), (130, 150), (12, 200), (28, 28), (1000, 7), (3000, 4000)]:
        rh, rw = smart_resize(h, w, 28, 56 * 56, 28 * 28 * 12)
        assert (rh, rw) == hf_smart_resize(h, w, 28, 56 * 56, 28 * 28 * 12)
        assert rh % 28 == rw % 28 == 0
        if max(h, w) / min(h, w) < 20:  # (HF's floor of one factor per side can exceed max_pixels at 1000 x 7)
            assert 56 * 56 <= rh * rw <= 28 * 28 * 12
    clear = Image.new("RGBA", (4, 4), (10, 20, 30, 0))
    assert np.asarray(decode_image(_png(clear))).tolist() == [[[255, 255, 255]] * 4] * 4


def test_user_content_markers():
    assert user_content("a<image>b<image>", 2) == [{"type": "text", "text": "a"}, {"type": "image"},
                                                   {"type": "text", "text": "b"}, {"type": "image"}]
    assert user_content("what is it?", 2) == [{"type": "image"}, {"type": "image"},
                                              {"type": "text", "text": "what is it?"}]
    assert user_content("plain", 0) == [{"type": "text", "text": "plain"}]


@pytest.fixture(scope="module")
def vl_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from jaxrl_async.testing import make_tiny_vl_tokenizer

    return AutoTokenizer.from_pretrained(make_tiny_vl_tokenizer(str(tmp_path_factory.mktemp("vltok"))))


def _hf_processor(tokenizer, cfg):
    """``Qwen2_5_VLProcessor`` with the PIL image processor and no video processor (the class check of the video
    processor imports torchvision: skipped for the absent one; images only here)."""
    from transformers import Qwen2_5_VLProcessor

    class ImagesOnly(Qwen2_5_VLProcessor):
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    return ImagesOnly(image_processor=_hf_image_processor(cfg), tokenizer=tokenizer, chat_template=tokenizer.chat_template)


def _hf_reference(processor, content, images, system=None):
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    out = processor(text=[text], images=[_hf_input(b) for b in images] or None)
    return list(out["input_ids"][0]), out.get("pixel_values"), out.get("image_grid_thw")


def _check_against_hf(records, expected, processor) -> float:
    worst = 0.0
    assert len(records) == len(expected)
    for rec, (content, images, system) in zip(records, expected):
        assert isinstance(rec, VLPromptRecord)
        ids, pix, grid = _hf_reference(processor, content, images, system)
        assert rec.prompt_ids == ids, rec.id
        if images:
            assert rec.image_grid_thw.tolist() == np.asarray(grid).tolist()
            ours = rec.pixel_values()
            assert ours.shape == pix.shape
            worst = max(worst, float(np.abs(ours - np.asarray(pix)).max()))
            assert rec.num_image_tokens == sum(int(i == 250) for i in ids)
        else:
            assert rec.images == () and rec.pixel_values().shape == (0, 3 * 2 * rec.image_processor.patch_size ** 2)
    return worst


@pytest.mark.parametrize("cfg", [REAL, TINY], ids=["patch14", "patch4"])
def test_jsonl_rows_equal_hf_processor(tmp_path, vl_tokenizer, cfg):
    imgs = _images()
    (tmp_path / "img").mkdir()
    for name in ("rgb_50x90", "grey", "rgba"):
        (tmp_path / "img" / f"{name}.png").write_bytes(imgs[name])
    b64 = lambda n: base64.b64encode(imgs[n]).decode()  # noqa: E731
    rows = [
        {"id": "a", "prompt": "What is in <image> here?", "answer": "1", "images": ["img/rgb_50x90.png"]},
        {"id": "b", "prompt": "Compare them.", "answer": "2", "images": ["img/grey.png", {"bytes": b64("palette")}]},
        {"id": "c", "prompt": "<image>left, <image>right: <image>", "answer": "3",
         "images": [f"data:image/png;base64,{b64('wide_12x200')}", "img/rgba.png", {"bytes": b64("tall_140x20"),
                                                                                   "path": None}]},
        {"id": "d", "prompt": "text only", "answer": "4"},
        {"id": "e", "prompt": "one", "answer": "5", "images": "img/rgb_50x90.png"},
    ]
    path = tmp_path / "vl.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    records, stats = read_vl_prompt_records(DatasetConfig(path=str(path), system_prompt="Be brief."), vl_tokenizer, cfg)
    assert stats.kept == 5 and stats.bad_rows == 0
    img = {"type": "image"}
    t = lambda s: {"type": "text", "text": s}  # noqa: E731
    expected = [
        ([t("What is in "), img, t(" here?")], [imgs["rgb_50x90"]], "Be brief."),
        ([img, img, t("Compare them.")], [imgs["grey"], imgs["palette"]], "Be brief."),
        ([img, t("left, "), img, t("right: "), img], [imgs["wide_12x200"], imgs["rgba"], imgs["tall_140x20"]],
         "Be brief."),
        ([t("text only")], [], "Be brief."),
        ([img, t("one")], [imgs["rgb_50x90"]], "Be brief."),
    ]
    worst = _check_against_hf(records, expected, _hf_processor(vl_tokenizer, cfg))
    assert worst <= 1e-6
    print(f"rows: token ids equal; max |pixel - HF| {worst:.1e}")
    # the batch the model takes: pixels in record order, grids stacked
    batch = batch_vision_inputs(records[:3])
    assert batch["image_grid_thw"].shape == (6, 3)
    assert batch["pixel_values"].shape[0] == int(batch["image_grid_thw"].prod(axis=1).sum())
    assert batch_vision_inputs(records[3:4]) is None


def test_parquet_rows_binary_and_hf_datasets_struct(tmp_path, vl_tokenizer):
    import pyarrow as pa
    import pyarrow.parquet as pq

    imgs = _images()
    (tmp_path / "j.jpg").write_bytes(imgs["jpeg"])
    table = pa.table({
        "prompt": ["<image>Count.", "Two: <image> and <image>"],
        "answer": ["1", "2"],
        # binary list, and HF datasets' Image struct {bytes, path}
        "pics": [[{"bytes": imgs["la"], "path": None}], [{"bytes": None, "path": "j.jpg"},
                                                          {"bytes": imgs["rgb_130x150_downscaled"], "path": "x.png"}]],
    })
    pq.write_table(table, tmp_path / "vl.parquet")
    pq.write_table(pa.table({"prompt": ["<image>"], "answer": ["0"], "images": [[imgs["grey"]]]}), tmp_path / "b.parquet")
    cfg = DatasetConfig(path=[str(tmp_path / "vl.parquet"), str(tmp_path / "b.parquet")], fields={"images": "pics"})
    with pytest.raises(DataFormatError, match=r"b\.parquet: row 1: \[generic\] the prompt has 1 <image> markers but "
                                              r"the row has 0 images"):
        read_vl_prompt_records(cfg, vl_tokenizer, REAL)
    records, _ = read_vl_prompt_records(DatasetConfig(path=cfg.path[:1], fields={"images": "pics"}), vl_tokenizer, REAL)
    records += read_vl_prompt_records(DatasetConfig(path=cfg.path[1:]), vl_tokenizer, REAL)[0]
    img, t = {"type": "image"}, (lambda s: {"type": "text", "text": s})
    expected = [([img, t("Count.")], [imgs["la"]], None),
                ([t("Two: "), img, t(" and "), img], [imgs["jpeg"], imgs["rgb_130x150_downscaled"]], None),
                ([img], [imgs["grey"]], None)]
    assert _check_against_hf(records, expected, _hf_processor(vl_tokenizer, REAL)) <= 1e-6


def test_raw_prompts_without_chat_template(tmp_path, vl_tokenizer):
    imgs = _images()
    path = tmp_path / "raw.jsonl"
    path.write_text(json.dumps({"prompt": "see <image>!", "answer": "1",
                                "images": [{"bytes": base64.b64encode(imgs["grey"]).decode()}]}) + "\n")
    (rec,), _ = read_vl_prompt_records(DatasetConfig(path=str(path), apply_chat_template=False), vl_tokenizer, TINY)
    n = rec.num_image_tokens
    assert rec.prompt == "see <|vision_start|>" + "<|image_pad|>" * n + "<|vision_end|>!"
    assert rec.prompt_ids == vl_tokenizer(rec.prompt)["input_ids"] and rec.prompt_ids.count(250) == n


def test_exif_orientation_applied(tmp_path):
    img = Image.fromarray(np.random.RandomState(1).randint(0, 256, (30, 80, 3), dtype=np.uint8))
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees: 80 x 30 upright
    data = _png(img, "JPEG", exif=exif.tobytes())
    assert decode_image(data).size == (30, 80)
    ours, grid = process_image(decode_image(data), REAL)
    ref = _hf_image_processor(REAL)(images=[_hf_input(data)])
    assert [list(grid)] == ref["image_grid_thw"].tolist() and np.abs(ours - ref["pixel_values"]).max() <= 1e-6


def _bad_rows(tmp_path) -> tuple[str, list[str]]:
    imgs = _images()
    (tmp_path / "ok.png").write_bytes(imgs["grey"])
    big = _png(Image.new("RGB", (300, 200)))
    rows = [
        {"prompt": "fine <image>", "answer": "1", "images": ["ok.png"]},
        {"prompt": "x", "answer": "1", "images": ["ok.png", "missing.png"]},
        {"prompt": "x", "answer": "1", "images": [{"bytes": base64.b64encode(b"not an image").decode()}]},
        {"prompt": "x", "answer": "1", "images": [{"bytes": base64.b64encode(imgs["jpeg"][:200]).decode()}]},
        {"prompt": "x", "answer": "1", "images": [{"bytes": base64.b64encode(big).decode()}]},
        {"prompt": "x", "answer": "1", "images": [{"bytes": "@@not base64@@"}]},
        {"prompt": "x <image>", "answer": "1", "images": ["ok.png", "ok.png"]},
        {"prompt": "x", "answer": "1", "images": [7]},
        {"prompt": "fine", "answer": "1", "images": []},
    ]
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path), [
        r"row 2: image 2: 'missing\.png': file not found",
        r"row 3: image 1: cannot decode the image \(UnidentifiedImageError",
        r"row 4: image 1: cannot decode the image \(OSError",
        r"row 5: image 1: too large: 300x200 = 60000 pixels > max_image_pixels=50000",
        r"row 6: image 1: invalid base64",
        r"row 7: \[generic\] the prompt has 1 <image> markers but the row has 2 images",
        r"row 8: image 1: an image must be a path, bytes or \{'bytes', 'path'\}, got int",
    ]


def test_bad_images_named_by_row_or_skipped(tmp_path, vl_tokenizer):
    path, messages = _bad_rows(tmp_path)
    ip = ImageProcessorConfig(min_pixels=REAL.min_pixels, max_pixels=REAL.max_pixels, max_image_pixels=50_000)
    lines = open(path).read().splitlines()
    for i, msg in enumerate(messages):
        row = int(msg.split(":")[0].split()[1])
        one = tmp_path / f"one{i}.jsonl"
        one.write_text("\n" * (row - 1) + lines[row - 1] + "\n")  # same row number, alone
        with pytest.raises(DataFormatError, match=msg) as e:
            read_vl_prompt_records(DatasetConfig(path=str(one)), vl_tokenizer, ip)
        assert "\n" not in str(e.value) and str(e.value).startswith(str(one))
    records, stats = read_vl_prompt_records(DatasetConfig(path=path, skip_bad_rows=True), vl_tokenizer, ip)
    assert [r.metadata["source"].rsplit(":", 1)[1] for r in records] == ["1", "9"]
    assert (stats.rows_read, stats.kept, stats.bad_rows) == (9, 2, 7)
    assert len(stats.bad_row_examples) == 7


def test_too_many_image_tokens(tmp_path, vl_tokenizer):
    imgs = _images()
    path = tmp_path / "long.jsonl"
    b = base64.b64encode(imgs["rgb_130x150_downscaled"]).decode()  # 84 x 84 at REAL: 9 image tokens
    path.write_text(json.dumps({"prompt": "a", "answer": "1", "images": [{"bytes": b}]}) + "\n"
                    + json.dumps({"prompt": "a", "answer": "1", "images": [{"bytes": b}, {"bytes": b}]}) + "\n"
                    + json.dumps({"prompt": "b", "answer": "1", "images": [{"bytes": b}]}) + "\n")
    with pytest.raises(DataFormatError, match=r"row 1: image 1: too large: 150x130 makes 9 image tokens > "
                                              r"max_prompt_len=8"):
        read_vl_prompt_records(DatasetConfig(path=str(path), max_prompt_len=8), vl_tokenizer, REAL)
    with pytest.raises(DataFormatError, match=r"row 2: the images make 18 image tokens > max_prompt_len=15"):
        read_vl_prompt_records(DatasetConfig(path=str(path), max_prompt_len=15), vl_tokenizer, REAL)
    # images fit, text + images do not: dropped and counted like a long text prompt
    records, stats = read_vl_prompt_records(DatasetConfig(path=str(path), max_prompt_len=15, skip_bad_rows=True),
                                            vl_tokenizer, REAL)
    assert (stats.bad_rows, stats.too_long, stats.kept) == (1, 2, 0)


def test_records_feed_the_model_inputs_and_grain(tmp_path, vl_tokenizer):
    """The records' ids and grids are what the model's prepare_inputs takes (placeholders = grids), and the
    dataset goes through the usual grain iterator with exact resume."""
    from jaxrl_async.models import qwen2_5_vl
    from jaxrl_async.testing import tiny_vl_config

    vcfg = qwen2_5_vl.VLConfig.from_hf(tiny_vl_config().to_dict())
    ip = ImageProcessorConfig.from_hf({"size": {"shortest_edge": TINY.min_pixels, "longest_edge": TINY.max_pixels},
                                       "patch_size": vcfg.vision.patch_size, "merge_size": vcfg.vision.spatial_merge_size,
                                       "temporal_patch_size": vcfg.vision.temporal_patch_size})
    assert ip == TINY
    imgs = _images()
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"q{i} <image>", "answer": str(i), "images": [
        {"bytes": base64.b64encode(imgs[n]).decode()}]}) + "\n" for i, n in enumerate(["grey", "rgba", "wide_12x200"])))
    ds = load_vl_prompt_dataset(DatasetConfig(path=str(path)), vl_tokenizer, ip)
    for rec in ds.records:
        assert rec.pixel_values().shape[1] == vcfg.vision.in_channels * vcfg.vision.temporal_patch_size * \
            vcfg.vision.patch_size ** 2
        inputs = qwen2_5_vl.prepare_inputs(vcfg, np.asarray([rec.prompt_ids]), rec.image_grid_thw)
        assert inputs["positions"].shape == (3, 1, len(rec.prompt_ids))
    it = make_train_iterator(ds, seed=3)
    first = [r.id for r in it.next_batch(4)]
    state = it.get_state()
    rest = [r.id for r in it.next_batch(3)]
    it2 = make_train_iterator(ds, seed=3)
    it2.set_state(state)
    assert [r.id for r in it2.next_batch(3)] == rest and len(first) == 4
    assert isinstance(ds[0], VLPromptRecord) and ds[0].images and os.fspath(path) in ds[0].metadata["source"]
