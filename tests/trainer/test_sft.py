"""SFT warm start: NLL formula and gradient, Trainer loss == hand computation on unpacked sequences,
example encoding, batch schedule, one planned shape (one compilation), loss decrease, sharded run ==
single device, greedy evaluation == argmax decoding, bad inputs.

One tiny model on the arithmetic tokenizer; the 30-step SFT run is module-scoped and shared.
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_async.config import SFTConfig
from jaxrl_async.data.arithmetic import ArithmeticConfig, build_splits, sft_example
from jaxrl_async.models.config import ModelConfig
from jaxrl_async.models.transformer import apply, init_params, sequence_logprobs
from jaxrl_async.sharding import make_mesh
from jaxrl_async.trainer import PackingConfig, Trainer, TrainStepConfig, pack
from jaxrl_async.trainer.sft import (
    SFTExample, SFTRun, batch_schedule, encode_examples, greedy_accuracy, greedy_completions, nll_loss, run_sft,
    sft_packing,
)

STEPS = 30
SFT = SFTConfig(steps=STEPS, batch_size=16, lr=1e-2, warmup_steps=3, weight_decay=0.0)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    from jaxrl_async.data.tokenizer import build_tokenizer

    return AutoTokenizer.from_pretrained(build_tokenizer(tmp_path_factory.mktemp("tok"), kind="arithmetic"))


@pytest.fixture(scope="module")
def cfg(tok):
    return ModelConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=8, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                       max_position_embeddings=128)


@pytest.fixture(scope="module")
def problems():
    return build_splits(ArithmeticConfig(num_train=64, num_eval=8, seed=3))


@pytest.fixture(scope="module")
def examples(problems, tok):
    return encode_examples([sft_example(p, tok) for p in problems[0]], tok)


@pytest.fixture(scope="module")
def params(cfg):
    return jax.jit(init_params, static_argnums=(0, 2))(cfg, jax.random.key(0), 0.05)


@pytest.fixture(scope="module")
def sft_runner(params, cfg, examples):
    """The 30-step warm start (``run_sft`` is this, whole); its compiled step is reused below."""
    sft = SFTRun(params, cfg, examples, SFT, seed=1)
    assert sft.run(progress=False)
    return sft


@pytest.fixture(scope="module")
def sft_run(sft_runner):
    return sft_runner.state.params, list(sft_runner.history)


def test_nll_loss_value_gradient_and_stats():
    rng = np.random.default_rng(0)
    lp = jnp.asarray(-rng.uniform(0.1, 5.0, (3, 7)), jnp.float32)
    mask = jnp.asarray(np.array([[0, 0, 1, 1, 1, 0, 0], [0, 1, 1, 0, 0, 0, 0], [0] * 7]), jnp.float32)
    ent = jnp.asarray(rng.uniform(0, 2, (3, 7)), jnp.float32)
    lp_h, m_h = np.asarray(lp, np.float64), np.asarray(mask, np.float64)
    n = m_h.sum()  # 5 loss tokens
    loss, stats = nll_loss(lp, None, None, None, mask, normaliser=jnp.float32(20.0), entropy=ent)
    np.testing.assert_allclose(float(loss), -(m_h * lp_h).sum() / 20.0, rtol=1e-6)  # global normaliser
    np.testing.assert_allclose(float(stats["nll"]), -(m_h * lp_h).sum() / n, rtol=1e-6)  # local token mean
    np.testing.assert_allclose(float(stats["entropy"]), (m_h * np.asarray(ent)).sum() / n, rtol=1e-6)
    assert float(stats["n_tokens"]) == n
    loss_local, _ = nll_loss(lp, None, None, None, mask)  # no normaliser: local count
    np.testing.assert_allclose(float(loss_local), -(m_h * lp_h).sum() / n, rtol=1e-6)
    g = jax.grad(lambda x: nll_loss(x, None, None, None, mask, normaliser=20.0)[0])(lp)
    np.testing.assert_allclose(np.asarray(g), -m_h / 20.0, rtol=1e-6)  # zero off the mask (prompt, padding)
    assert not np.any(np.asarray(g)[m_h == 0])


def _hand_loss(params, cfg, examples, full_mask=False):
    """-mean over completion tokens of log p(token | prefix): one sequence per row (no packing),
    right-padded with segment id 0."""
    T = max(len(e) for e in examples)
    toks = np.zeros((len(examples), T), np.int32)
    seg = np.zeros((len(examples), T), np.int32)
    mask = np.zeros((len(examples), T), np.float32)
    for i, ex in enumerate(examples):
        n = len(ex)
        toks[i, :n] = ex.prompt_ids + ex.completion_ids
        seg[i, :n] = 1
        mask[i, 1 if full_mask else len(ex.prompt_ids):n] = 1

    return _hand_value_and_grad(params, toks, seg, mask, cfg)


@functools.partial(jax.jit, static_argnames=("cfg",))
@functools.partial(jax.value_and_grad)
def _hand_value_and_grad(params, toks, seg, mask, cfg):
    lp, _ = sequence_logprobs(params, cfg, toks, seg)
    return -(lp * mask).sum() / mask.sum()


def test_trainer_loss_and_gradient_equal_hand_computation(cfg, params, examples):
    subset = examples[:6]
    # 3 sequences per row of 128 tokens, one row per micro-batch: 2 micro-batches, accumulation + packing.
    packing = PackingConfig(tokens_per_micro=128, row_len_buckets=(128,), max_seqs_per_row=3)
    trainer = Trainer(cfg, TrainStepConfig(packing=packing, proximal="given"), loss_fn=nll_loss,
                      normaliser_fn=lambda n_tok, n_seq: float(n_tok))
    packed = pack([ex.trajectory() for ex in subset], packing)
    assert packed.n_real_micro == 2 and packed.n_loss_tokens == sum(len(e.completion_ids) for e in subset)
    grads, loss, stats = trainer.gradients(params, packed)
    want, want_g = _hand_loss(params, cfg, subset)
    np.testing.assert_allclose(float(loss), float(want), rtol=1e-5)
    np.testing.assert_allclose(float(stats["nll"]), float(want), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want_g)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-7)
    # The check discriminates: training on the prompt tokens too gives another loss.
    assert abs(float(_hand_loss(params, cfg, subset, full_mask=True)[0]) - float(want)) > 1e-2


def test_encode_examples(tok, problems):
    pairs = [sft_example(p, tok) for p in problems[0][:4]]
    exs = encode_examples(pairs, tok)
    for (prompt, completion), ex in zip(pairs, exs):
        assert tok.decode(list(ex.prompt_ids)) == prompt and tok.decode(list(ex.completion_ids)) == completion
        assert ex.completion_ids[-1] == tok.eos_token_id  # the model learns to stop
        t = ex.trajectory()
        assert t.tokens.tolist() == list(ex.prompt_ids + ex.completion_ids)
        assert t.loss_mask.tolist() == [0] * len(ex.prompt_ids) + [1] * len(ex.completion_ids)
    with pytest.raises(ValueError, match="example 1: empty completion"):
        encode_examples([pairs[0], (pairs[1][0], "")], tok)
    with pytest.raises(ValueError, match="example 0: empty prompt"):
        encode_examples([("", pairs[0][1])], tok)
    with pytest.raises(ValueError, match="example 0: expected a"):
        encode_examples(["just a string"], tok)
    with pytest.raises(ValueError, match="completion_ids is empty"):
        SFTExample((1, 2), ())


def test_batch_schedule_epochs_and_seed():
    b = batch_schedule(10, 4, 5, seed=7)  # 20 indices = 2 epochs of 10; batch 2 straddles them
    assert [len(x) for x in b] == [4] * 5
    flat = np.concatenate(b)
    assert sorted(flat[:10].tolist()) == list(range(10)) and sorted(flat[10:].tolist()) == list(range(10))
    assert all(np.array_equal(x, y) for x, y in zip(b, batch_schedule(10, 4, 5, seed=7)))
    assert not all(np.array_equal(x, y) for x, y in zip(b, batch_schedule(10, 4, 5, seed=8)))


def test_sft_packing_one_shape_holds_every_batch(examples):
    lengths = [len(e) for e in examples]
    batches = batch_schedule(len(examples), 16, 12, seed=0)
    pk = sft_packing(lengths, batches, data_parallel=4)
    assert pk.row_len_buckets == (-(-max(lengths) // 8) * 8,) and pk.rows_per_micro(pk.row_len_buckets[0]) % 4 == 0
    trajs = [e.trajectory() for e in examples]
    shapes = {pack([trajs[i] for i in b], pk).batch.shape for b in batches}
    assert len(shapes) == 1 and next(iter(shapes))[0] == 1


def test_run_sft_loss_decreases_one_compilation(sft_run, params, cfg):
    out, hist = sft_run
    assert [h["step"] for h in hist] == list(range(1, STEPS + 1))
    assert all(h["compilations"] == 1 for h in hist)  # compiled at step 1, never again
    assert all(h["skipped"] == 0 and h["tokens"] > h["loss_tokens"] > 0 for h in hist)
    losses = np.array([h["loss"] for h in hist])
    assert np.all(np.isfinite(losses))
    assert losses[-5:].mean() < 0.6 * losses[:2].mean(), losses
    lrs = np.array([h["lr"] for h in hist])  # warmup 0 -> lr over 3 steps, then cosine to ~0
    np.testing.assert_allclose(lrs[:4], [0.0, SFT.lr / 3, 2 * SFT.lr / 3, SFT.lr], rtol=1e-5)
    assert np.all(np.diff(lrs[3:]) < 0) and lrs[-1] < 0.01 * SFT.lr
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(params)):
        assert a.dtype == jnp.float32 and a.shape == b.shape
    pairs = zip(jax.tree.leaves(out), jax.tree.leaves(params))
    assert all(not np.allclose(np.asarray(a), np.asarray(b)) for a, b in pairs)  # every weight was trained


def test_stopped_warm_start_continues_from_its_checkpoint_bit_for_bit(sft_runner, sft_run, params, tmp_path, capsys):
    """The warm start stopped after 12 steps (as a signal stops it), its state saved and restored by the
    loop's checkpoint path, then continued: the same losses and params as the uninterrupted run, bit
    for bit (the compiled step of the fixture's run is reused). The continuation shows its progress as
    lines (``progress="lines"``, the multi-process controller's console): one per step from 13 (every 5 %
    of 30 steps is every step), no carriage return."""
    from jaxrl_async.checkpoint import CheckpointConfig, Checkpointer, TrainMeta
    from jaxrl_async.loop.state import state_from_items, state_items, restore_train_state

    out, hist = sft_run
    sft, seen = sft_runner, []
    sft.load(sft.trainer.init_state(params), 0)
    sft.history = []
    assert not sft.run(progress=False, should_stop=lambda: sft.step >= 12, after_step=seen.append)
    assert sft.step == 12 and seen == list(range(1, 13)) and [h["step"] for h in sft.history] == seen
    with Checkpointer(str(tmp_path), CheckpointConfig()) as ck:
        ck.save(state_items(sft.state), TrainMeta(step=sft.step, policy_version=0))
    r = restore_train_state(Checkpointer(str(tmp_path), CheckpointConfig()), sft.trainer, params)
    sft.load(state_from_items(r.arrays), r.step)
    capsys.readouterr()
    assert sft.run(progress="lines") and sft.step == STEPS and sft.history[12]["step"] == 13
    err = capsys.readouterr().err
    assert "\r" not in err
    assert [ln.split(" [")[0] for ln in err.splitlines()] == [f"sft: {k}/{STEPS}" for k in range(13, STEPS + 1)], err
    assert f"loss={sft.history[-1]['loss']:.4f}, lr=" in err.splitlines()[-1], err
    assert [h["loss"] for h in sft.history] == [h["loss"] for h in hist]
    for a, b in zip(jax.tree.leaves(sft.state.params), jax.tree.leaves(out)):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    with pytest.raises(ValueError, match="outside 0..30"):
        sft.load(sft.state, STEPS + 1)


def test_sharded_run_matches_single_device(sft_run, params, cfg, examples):
    """fsdp=2 x tensor=2 (rows over fsdp, a different packed shape): the same losses as one device."""
    mesh = make_mesh({"fsdp": 2, "tensor": 2}, devices=jax.devices()[:4])
    logs = []
    sharded, h2 = run_sft(params, cfg, examples, SFT, mesh=mesh, seed=1, progress=False, log_fn=logs.append)
    _, h1 = sft_run
    assert logs == h2
    np.testing.assert_allclose([h["loss"] for h in h2], [h["loss"] for h in h1], rtol=1e-4)
    np.testing.assert_allclose([h["grad_norm"] for h in h2[:10]], [h["grad_norm"] for h in h1[:10]], rtol=1e-3)
    q = sharded["layers"]["q"]
    assert q.sharding.mesh.shape == mesh.shape and not q.sharding.is_fully_replicated


def _argmax_decode(params, cfg, prompts, max_new, eos):
    """Reference greedy decoding: full forward over a fixed [1, L] buffer (causal: the padding after
    position n - 1 does not change its logits), argmax of the last real position, stop at EOS."""
    L = max(len(p) for p in prompts) + max_new
    logits_at = jax.jit(lambda p, toks, i: apply(p, cfg, toks)[0, i])
    outs = []
    for prompt in prompts:
        buf = np.zeros((1, L), np.int32)
        buf[0, :len(prompt)] = prompt
        n, out = len(prompt), []
        for _ in range(max_new):
            t = int(jnp.argmax(logits_at(params, jnp.asarray(buf), n - 1)))
            out.append(t)
            buf[0, n] = t
            n += 1
            if t == eos:
                break
        outs.append(out)
    return outs


def test_greedy_accuracy_decodes_argmax_and_scores(sft_run, cfg, tok, problems):
    """Engine + generator at temperature 0 (4 prompts on 3 slots) == the argmax loop; mean reward."""
    params, _ = sft_run
    held = problems[1][:4]
    prompts = [sft_example(p, tok)[0] for p in held]
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    want = [tok.decode(o, skip_special_tokens=True) for o in _argmax_decode(params, cfg, ids, 12, tok.eos_token_id)]
    seen = []

    def reward(prompt, completion, answer):
        seen.append((prompt, completion, answer))
        return float(completion == want[0])

    acc = greedy_accuracy(params, cfg, tok, held, reward, max_new_tokens=12, max_concurrent=3)
    assert seen == [(p, c, prob.answer) for p, c, prob in zip(prompts, want, held)]
    assert acc == pytest.approx(sum(c == want[0] for c in want) / len(want))


def test_bad_inputs(params, cfg, examples):
    with pytest.raises(ValueError, match="SFTConfig.steps"):
        run_sft(params, cfg, examples, dataclasses.replace(SFT, steps=0), progress=False)
    with pytest.raises(ValueError, match="SFTConfig.warmup_steps"):
        run_sft(params, cfg, examples, dataclasses.replace(SFT, steps=3, warmup_steps=3), progress=False)
    with pytest.raises(ValueError, match="SFTConfig.batch_size"):
        run_sft(params, cfg, examples, dataclasses.replace(SFT, batch_size=0), progress=False)
    with pytest.raises(ValueError, match="no examples"):
        run_sft(params, cfg, [], SFT, progress=False)
    with pytest.raises(TypeError, match="example 1 is a tuple"):
        run_sft(params, cfg, [examples[0], ((1, 2), (3,))], SFT, progress=False)
    long = SFTExample(tuple(range(100)), tuple(range(40)))
    with pytest.raises(ValueError, match="example 1 has 140 tokens > the model's max_position_embeddings 128"):
        run_sft(params, cfg, [examples[0], long], SFT, progress=False)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        greedy_completions(params, cfg, None, ["x"], max_new_tokens=0)
