"""The generator serves vision-language prompts (issue 29 item 3) on a tiny random Qwen2.5-VL (fp32): greedy
generation with images equals transformers' ``generate`` token for token (one image, several images, sizes and
aspect ratios, a text prompt, all in one generator with fewer slots than requests, single- and multi-step decode);
behaviour log-probs equal the trainer-side forward (`qwen2_5_vl.apply` on prompt + completion) within 1e-5;
preemption and recompute_kv after a weight update rebuild the M-RoPE positions with the images; the vision tower
compiles once per patch bucket; requests with images on a text model or with mismatched placeholders are refused."""
from __future__ import annotations

import functools
import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("PIL")
torch = pytest.importorskip("torch")
import transformers  # noqa: E402
from PIL import Image  # noqa: E402

from jaxrl_async.data.images import ImageInputs, ImageProcessorConfig, decode_image, process_image  # noqa: E402
from jaxrl_async.generator.engine_api import SamplingParams  # noqa: E402
from jaxrl_async.generator.factory import EngineConfig, build_engine  # noqa: E402
from jaxrl_async.generator.orchestrator import Generator  # noqa: E402
from jaxrl_async.generator.vision_prefill import MIN_PATCH_BUCKET, patch_bucket  # noqa: E402
from jaxrl_async.models import load_hf, qwen2_5_vl, transformer  # noqa: E402
from jaxrl_async.testing import TINY_VL_TOKENS, make_tiny_vl_model  # noqa: E402
from mock_engine import GatedEngine  # noqa: E402

IMG, VS, VE = (TINY_VL_TOKENS[k] for k in ("image_token_id", "vision_start_token_id", "vision_end_token_id"))
TINY = ImageProcessorConfig(min_pixels=8 * 8 * 2, max_pixels=8 * 8 * 12, patch_size=4)  # the tiny model's patching
EOS = 2


def _png(rng, h, w) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def _request(rng, sizes, text=(5, 3)):
    """(prompt ids, ImageInputs or None): text, then per image <vs> placeholders <ve> text."""
    pngs = [_png(rng, h, w) for h, w in sizes]
    grids = [process_image(decode_image(b), TINY)[1] for b in pngs]
    ids = [int(x) for x in rng.integers(3, 240, text[0])]
    for t, h, w in grids:
        ids += [VS] + [IMG] * (t * h * w // 4) + [VE] + [int(x) for x in rng.integers(3, 240, text[1])]
    return ids, (ImageInputs(tuple(pngs), np.asarray(grids), TINY) if pngs else None)


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    dirs = [make_tiny_vl_model(str(tmp_path_factory.mktemp(f"vl{s}")), seed=s) for s in (0, 1)]
    cfg, p0 = load_hf(dirs[0])
    _, p1 = load_hf(dirs[1])
    hf = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(dirs[0], dtype=torch.float32).eval()
    eng = build_engine(EngineConfig(max_concurrent_decodes=3, max_sequence_length=96, prefill_buckets=(32, 64),
                                    page_size=8, num_pages=48), cfg)
    return cfg, eng, {0: eng.place_params(p0), 1: eng.place_params(p1)}, hf


def _requests():
    rng = np.random.default_rng(0)
    shapes = [[(20, 28)], [(24, 24), (12, 40)], [], [(40, 12)], [(17, 33)], [(8, 60)], [(30, 30), (16, 16), (20, 8)]]
    return [_request(rng, s) for s in shapes]


def _hf_greedy(hf, ids, images, max_new):
    ids_t = torch.tensor([ids])
    kw = dict(input_ids=ids_t, mm_token_type_ids=(ids_t == IMG).int())  # transformers 5 places images by this
    if images is not None:
        kw.update(pixel_values=torch.tensor(images.pixel_values()), image_grid_thw=torch.tensor(images.grid_thw))
    with torch.no_grad():
        out = hf.generate(**kw, max_new_tokens=max_new, do_sample=False, eos_token_id=EOS, pad_token_id=0)
    return out[0, len(ids):].tolist()


@functools.partial(jax.jit, static_argnums=(1, 6))
def _ref_logits(params, cfg, seq, pos, pixel_values, layout, prompt_len):
    feats = None if pixel_values is None else qwen2_5_vl.image_features(params, cfg, pixel_values, layout)
    emb = jnp.concatenate([qwen2_5_vl.embed_inputs(params, cfg, seq[:, :prompt_len], feats),
                           jnp.take(params["embed"], seq[:, prompt_len:], axis=0)], axis=1)
    attend = transformer.model_attention(cfg.text, jnp.ones(seq.shape, jnp.int32))
    hidden, _ = transformer.forward(params, cfg.text, seq, pos, attend, embeds=emb)
    return jax.nn.log_softmax(transformer.logits_from_hidden(params, hidden), axis=-1)


def _trainer_logprobs(cfg, params, ids, images, completion, T=128):
    """log_softmax of the trainer-side forward at each generated token: the prompt's M-RoPE positions and image
    features (`qwen2_5_vl.prepare_inputs` / `image_features` / `embed_inputs`, as `qwen2_5_vl.apply`), the
    completion at index + rope_delta with plain token embeddings (a sampled token may be the placeholder id: text
    there, as in transformers' decoding); the row right-padded to T tokens (causal: nothing before moves)."""
    P, n = len(ids), len(completion)
    prep = qwen2_5_vl.prepare_inputs(cfg, np.asarray([ids]), None if images is None else images.grid_thw)
    delta = int(prep["rope_deltas"][0])
    pos = np.concatenate([prep["positions"], np.broadcast_to(np.arange(P, T) + delta, (3, 1, T - P))], axis=2)
    seq = np.zeros((1, T), np.int32)
    seq[0, :P + n] = list(ids) + list(completion)
    pv = None if images is None else images.pixel_values()
    lp = np.asarray(_ref_logits(params, cfg, seq, pos, pv, prep["layout"], P))[0]
    return np.asarray([lp[P - 1 + i, t] for i, t in enumerate(completion)])


@pytest.mark.parametrize("mode", ["single_step", "multi_step", pytest.param("compacted", marks=pytest.mark.slow)])
def test_greedy_matches_transformers_generate(vl, mode):
    """7 requests (one image, two and three images, sizes and aspect ratios, a text prompt) through 3 slots:
    greedy tokens equal transformers' `generate` (which runs the vision tower and M-RoPE the same way), and the
    greedy log-probs equal the trainer-side forward's; with 4 decode steps per dispatch, and with compacted decode
    steps (the slots' rope deltas gathered with their rows)."""
    cfg, eng, params, hf = vl
    if mode == "multi_step":
        eng = build_engine(EngineConfig(max_concurrent_decodes=3, max_sequence_length=96, prefill_buckets=(32, 64),
                                        page_size=8, num_pages=48, decode_steps=4), cfg)
    elif mode == "compacted":  # 4 slots, a 2-row program once at most 2 are live
        eng = build_engine(EngineConfig(max_concurrent_decodes=4, max_sequence_length=96, prefill_buckets=(32, 64),
                                        page_size=8, num_pages=48, compact_decode=True), cfg, compact_min_rows=1,
                           compact_levels=1)
    reqs = _requests()
    news = [6 + 2 * i for i in range(len(reqs))]  # different lengths: the slots free up one by one
    with Generator(eng, params[0]) as gen:
        hs = [gen.submit(ids, SamplingParams(temperature=0, max_new_tokens=n, stop_token_ids=(EOS,)), images=im)
              for (ids, im), n in zip(reqs, news)]
        outs = [h.result(120).samples[0] for h in hs]
    assert 1 <= eng.vision.tower_calls <= 6  # once per prefill row holding images (rows pack several prompts)
    assert (eng.compact_steps > 0) == (mode == "compacted")
    assert (eng.compile_counts()["generate_multi"] > 0) == (mode == "multi_step")
    for (ids, im), o, n in zip(reqs, outs, news):
        assert o.completion_ids == _hf_greedy(hf, ids, im, n)
        ref = _trainer_logprobs(cfg, params[0], ids, im, o.completion_ids)
        np.testing.assert_allclose(o.logprobs, ref, atol=1e-5)


def test_chunked_prefill_with_images(vl):
    """Sequences longer than the largest bucket (16: a re-prefill's prompt + generated tokens) run in chunks, images
    split across chunks: each chunk takes its slices of the M-RoPE positions and of the image features; the next
    token equals transformers' greedy one and its log-prob the trainer-side forward's."""
    cfg, _, params, hf = vl
    eng = build_engine(EngineConfig(max_concurrent_decodes=2, max_sequence_length=96, prefill_buckets=(16,),
                                    page_size=8, num_pages=48), cfg)
    sp = SamplingParams(temperature=0, max_new_tokens=4)
    for ids, im in [_requests()[i] for i in (1, 6)]:
        ref = _hf_greedy(hf, ids, im, 5)
        lps = _trainer_logprobs(cfg, params[0], ids, im, ref)
        for k in (0, 4):  # the prompt, and the prompt + 4 generated tokens
            pre = eng.prefill(params[0], ids + ref[:k], sp, images=im)
            assert len(ids) + k > 16 and int(pre.first_tokens[0]) == ref[k]
            assert abs(float(pre.first_logprobs[0]) - lps[k]) <= 1e-5
    assert eng.compile_counts()["prefill_chunk_vl"] >= 1 and eng.compile_counts()["prefill_vl"] == 0


def test_sampled_logprobs_equal_trainer_forward(vl):
    """temperature 1, 2 samples per request (one shared prefill): every behaviour log-prob equals the trainer-side
    forward's within 1e-5, and the samples of one request differ."""
    cfg, eng, params, _ = vl
    reqs = _requests()[:4]
    sp = SamplingParams(temperature=1.0, max_new_tokens=10, n=2, seed=3)
    calls = eng.vision.tower_calls
    with Generator(eng, params[0]) as gen:
        outs = [h.result(120) for h in [gen.submit(ids, sp, images=im) for ids, im in reqs]]
    assert eng.vision.tower_calls - calls <= 3  # one tower run per prefill row holding images, not per sample
    worst = 0.0
    for (ids, im), out in zip(reqs, outs):
        assert out.samples[0].completion_ids != out.samples[1].completion_ids
        for s in out.samples:
            ref = _trainer_logprobs(cfg, params[0], ids, im, s.completion_ids)
            worst = max(worst, float(np.abs(np.asarray(s.logprobs) - ref).max()))
    assert worst <= 1e-5, worst


def test_preemption_rebuilds_image_positions(vl):
    """A page pool that holds about two sequences: preempted image requests are re-prefilled (prompt + generated,
    with their images) and their sampled tokens and log-probs stay those of the trainer-side forward."""
    cfg, _, params, _ = vl
    eng = build_engine(EngineConfig(max_concurrent_decodes=3, max_sequence_length=96, prefill_buckets=(32, 64),
                                    page_size=8, num_pages=14), cfg)
    p = eng.place_params(jax.device_get(params[0]))
    reqs = _requests()[:4]
    sp = SamplingParams(temperature=1.0, max_new_tokens=40, seed=7)
    with Generator(eng, p) as gen:
        outs = [h.result(120).samples[0] for h in [gen.submit(ids, sp, images=im) for ids, im in reqs]]
        assert gen.stats().preemptions > 0
    for (ids, im), o in zip(reqs, outs):
        ref = _trainer_logprobs(cfg, params[0], ids, im, o.completion_ids)
        np.testing.assert_allclose(o.logprobs, ref, atol=1e-5)
    assert any(o.num_preemptions for o, (_, im) in zip(outs, reqs) if im is not None)


def test_recompute_kv_after_weight_update_with_images(vl):
    """recompute_kv: a weight push (the vision tower's weights too) mid-generation re-prefills every live image
    sequence under the new weights: each token's log-prob equals the trainer-side forward under the weights of its
    version (prompt + tokens so far, same images), and the pushed vision weights change the tokens."""
    cfg, eng, params, _ = vl
    gated = GatedEngine(eng, gate_step=5)
    reqs = [r for r in _requests() if r[1] is not None][:3]
    sp = SamplingParams(temperature=0, max_new_tokens=16)
    with Generator(gated, params[0], kv_update_policy="recompute_kv") as gen:
        hs = [gen.submit(ids, sp, images=im) for ids, im in reqs]
        assert gated.reached.wait(60)
        gen.update_params(params[1], version=1)
        gated.gate.set()
        outs = [h.result(120).samples[0] for h in hs]
        assert gen.stats().recomputed_sequences == 3
    for (ids, im), o in zip(reqs, outs):
        v = np.asarray(o.versions)
        assert 0 < (v == 0).sum() < len(v)
        for ver in (0, 1):  # teacher-forced under each version's weights: its tokens' log-probs
            ref = _trainer_logprobs(cfg, jax.device_get(params[ver]), ids, im, o.completion_ids)
            np.testing.assert_allclose(np.asarray(o.logprobs)[v == ver], ref[v == ver], atol=1e-5)


def test_pushed_vision_weights_change_generation(vl):
    """A weight push (`WeightPusher`, from params on the trainer's shardings to the engine's) that changes only the
    vision tower changes what an image request generates (the pushed tree carries ``vision``; its log-probs are the
    new tower's) and leaves a text request's tokens unchanged."""
    from jaxrl_async.generator.weight_sync import WeightPusher
    from jaxrl_async.models.shardings import model_shardings
    from jaxrl_async.sharding.mesh import make_mesh

    cfg, eng, params, _ = vl
    p_vis = dict(jax.device_get(params[0]), vision=jax.device_get(params[1])["vision"])
    trainer_mesh = make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, devices=jax.devices()[:1])
    src = jax.device_put(p_vis, model_shardings(cfg, trainer_mesh, "trainer"))
    (ids, im), (tids, _) = _requests()[0], _requests()[2]
    sp = SamplingParams(temperature=0, max_new_tokens=8)
    with Generator(eng, params[0]) as gen:
        a, ta = gen.submit(ids, sp, images=im).result(60), gen.submit(tids, sp).result(60)
        pusher = WeightPusher(gen, eng.param_shardings, guard=True)
        try:
            pusher.push(src, 1)
            pusher.wait(1, timeout=60)
        finally:
            pusher.close()
        assert gen.version == 1
        b, tb = gen.submit(ids, sp, images=im).result(60), gen.submit(tids, sp).result(60)
    assert b.samples[0].versions == [1] * 8
    assert a.samples[0].completion_ids != b.samples[0].completion_ids
    assert ta.samples[0].completion_ids == tb.samples[0].completion_ids
    ref = _trainer_logprobs(cfg, p_vis, ids, im, b.samples[0].completion_ids)
    np.testing.assert_allclose(b.samples[0].logprobs, ref, atol=1e-5)


def test_vision_tower_compiles_per_patch_bucket(vl):
    """The tower compiles once per (padded patch count, prefill row bucket) pair, whatever the images: all the
    requests above used at most the buckets their patch counts round to."""
    cfg, eng, params, _ = vl
    rng = np.random.default_rng(5)
    before = eng.compile_counts()
    sp = SamplingParams(temperature=0, max_new_tokens=2)
    pairs = set()
    for sizes in ([(20, 28)], [(28, 20)], [(24, 24)], [(16, 40)], [(40, 16)], [(12, 12)]):
        ids, im = _request(rng, sizes, text=(3, 2))
        eng.prefill(params[0], ids, sp, images=im)
        pairs.add((patch_bucket(im.num_patches), eng.bucket_for(len(ids))))
    counts = eng.compile_counts()
    assert len(pairs) <= 2 and all(nb >= MIN_PATCH_BUCKET for nb, _ in pairs)
    assert counts["vision_tower"] - before["vision_tower"] <= len(pairs)
    assert counts["vision_tower"] <= len(eng.vision._towers)
    assert counts["prefill_vl"] <= len(eng.buckets) and counts["prefill"] == before["prefill"]
    assert counts["generate"] + counts["generate_plain"] <= 2


def test_errors(vl, tmp_path):
    cfg, eng, params, _ = vl
    ids, im = _requests()[0]
    from jaxrl_async.models import load_hf as _load
    from jaxrl_async.testing import make_tiny_hf_model

    tcfg, tparams = _load(make_tiny_hf_model(str(tmp_path / "text"), "qwen2"))
    teng = build_engine(EngineConfig(max_concurrent_decodes=1, max_sequence_length=96, prefill_buckets=(64,),
                                     page_size=8, num_pages=24), tcfg)
    tgen = Generator(teng, tparams)
    with pytest.raises(ValueError, match="'r1'.*text-only"):
        tgen.submit(ids, request_id="r1", images=im)
    with pytest.raises(ValueError, match="text-only"):
        teng.prefill(tparams, ids, SamplingParams(), images=im)
    gen = Generator(eng, params[0])
    with pytest.raises(ValueError, match="'r2'.*placeholder"):
        gen.submit(ids[:-6] + ids[-3:], request_id="r2", images=im)  # placeholders cut short
    with pytest.raises(ValueError, match="'r3'.*placeholder"):
        gen.submit(ids, request_id="r3")  # placeholders without images
    two = ImageInputs(im.images * 2, np.concatenate([im.grid_thw] * 2), TINY)
    with pytest.raises(ValueError, match="'r4'.*placeholder"):
        gen.submit(ids, request_id="r4", images=two)


def test_factory_builds_vl_engines(vl):
    """`generator_model_config` keeps a VLConfig (weights in the compute dtype), `for_prompts` reads the text
    model's position limit, and an auto-sized pool counts the vision tower's weights too (`kv_cache`)."""
    from jaxrl_async.generator.factory import for_prompts, generator_model_config

    cfg = vl[0]
    gen_cfg = generator_model_config(cfg.replace(param_dtype="bfloat16"))
    assert qwen2_5_vl.is_vl(gen_cfg) and gen_cfg.text.param_dtype == gen_cfg.text.dtype
    e = for_prompts([40, 50], 600, cfg, max_concurrent=2)
    assert e.max_sequence_length == cfg.text.max_position_embeddings
    eng = build_engine(EngineConfig(max_concurrent_decodes=2, max_sequence_length=64, page_size=8), cfg)
    n_bytes = sum(x.size * 4 for x in jax.tree.leaves(qwen2_5_vl.param_shapes(cfg)))
    n_vision = sum(x.size * 4 for x in jax.tree.leaves(qwen2_5_vl.param_shapes(cfg)["vision"]))
    assert eng.sizing.param_bytes == n_bytes and n_vision > 0 and eng.num_pages >= eng.max_pages_per_seq
    assert eng.vl_cfg == cfg and eng.text_cfg == cfg.text and eng.cfg == cfg


def test_trainer_treats_a_generated_placeholder_as_text_like_the_generator(vl):
    """A sampled completion may hold the image placeholder id (a random or young policy samples it): the generator
    decodes it as a text token at index + rope_delta (`qwen2_5_vl.sequence_layout`); the trainer's packed log-probs
    of prompt + such a completion must be the same function (features only at the prompt's placeholders, the
    completion's M-RoPE positions at index + delta), or generator and trainer log-probs part. Checked against the
    reference forward the generator tests use, in a minibatch with a plain image sequence beside it."""
    from jaxrl_async.trainer import PackingConfig, Trainer, TrainStepConfig, TrainSequence, unpack

    cfg, _, placed, _ = vl
    host = jax.device_get(placed[0])
    rng = np.random.default_rng(5)
    seqs, refs = [], []
    for sizes, completion in (([(20, 28)], [7, IMG, 9, IMG, VS, 11, VE, 12]), ([(24, 24), (12, 40)], [5, 6, 7])):
        ids, images = _request(rng, sizes)
        tokens = np.asarray(ids + completion, np.int32)
        mask = (np.arange(len(tokens)) >= len(ids)).astype(np.int32)
        seqs.append(TrainSequence(tokens=tokens, loss_mask=mask, behaviour_logprobs=np.zeros(len(tokens), np.float32),
                                  advantages=np.zeros(len(tokens), np.float32), versions=np.where(mask > 0, 0, -1),
                                  images=images))
        refs.append((ids, images, completion))
    trainer = Trainer(cfg, TrainStepConfig(packing=PackingConfig(tokens_per_micro=256, row_len_buckets=(128,),
                                                                 max_seqs_per_row=4)))
    packed = trainer.pack(seqs)
    lp, _ = trainer.compute_logprobs(trainer.init_state(host).params, trainer.put_batch(packed))
    got = unpack(np.asarray(lp), packed)
    for g, i in zip(got, packed.indices):
        ids, images, completion = refs[i]
        want = _trainer_logprobs(cfg, host, ids, images, completion)
        np.testing.assert_allclose(g[len(ids):], want, atol=1e-5)
