"""Packing: first-fit-decreasing rows, bucketed shapes, host counts, bad-trajectory errors (numpy only)."""
import numpy as np
import pytest

from jaxrl_async.trainer.packing import (
    PackingConfig, PackingError, TrainSequence, pack, split_minibatches, unpack, validate_trajectory,
)


def traj(n, prompt=2, seed=0, adv=1.0, version=0):
    rng = np.random.default_rng(seed)
    mask = np.zeros(n, np.int32)
    mask[prompt:] = 1
    return TrainSequence(tokens=rng.integers(3, 50, n), loss_mask=mask,
                      behaviour_logprobs=np.where(mask > 0, -rng.random(n), 0.0),
                      advantages=np.where(mask > 0, adv, 0.0), versions=np.where(mask > 0, version, -1))


def test_ffd_rows_segments_positions_and_counts():
    # lengths 10, 7, 6, 5, 3 into rows of 16 (FFD by hand):
    #   10 -> row0 (6 left), 7 -> row1 (9 left), 6 -> row0 (0 left), 5 -> row1 (4 left), 3 -> row1 (1 left)
    lens = [10, 7, 6, 5, 3]
    trajs = [traj(n, seed=i) for i, n in enumerate(lens)]
    cfg = PackingConfig(tokens_per_micro=32, row_len_buckets=(8, 16, 32), max_seqs_per_row=4)
    p = pack(trajs, cfg)
    assert p.batch.shape == (1, 2, 16)  # row_len 16 (longest 10), 32 // 16 = 2 rows, 1 micro-batch
    assert p.placement == [(0, 0, 0, 10), (0, 1, 0, 7), (0, 0, 10, 6), (0, 1, 7, 5), (0, 1, 12, 3)]
    seg = p.batch.segment_ids[0]
    np.testing.assert_array_equal(seg[0], [1] * 10 + [2] * 6)
    np.testing.assert_array_equal(seg[1], [1] * 7 + [2] * 5 + [3] * 3 + [0])
    np.testing.assert_array_equal(p.batch.positions[0, 1], list(range(7)) + list(range(5)) + list(range(3)) + [0])
    np.testing.assert_array_equal(p.batch.tokens[0, 0, 10:16], trajs[2].tokens)
    # seq_ids: row * max_seqs_per_row + slot, padding = num_seqs - 1 = 2 * 4 + 1 - 1
    assert p.num_seqs == 9
    np.testing.assert_array_equal(p.batch.seq_ids[0, 1], [4] * 7 + [5] * 5 + [6] * 3 + [8])
    assert p.n_loss_tokens == sum(n - 2 for n in lens) == 21
    assert p.n_seqs == 5 and p.n_loss_seqs == 5 and p.n_tokens == 31 and p.n_real_micro == 1
    # values live only on loss tokens; padding is inert
    assert p.batch.loss_mask[0, 1, 15] == 0 and p.batch.versions[0, 1, 15] == -1
    np.testing.assert_array_equal(p.seq_index[0, 1], [1] * 7 + [3] * 5 + [4] * 3 + [-1])


def test_buckets_give_static_shapes_and_empty_micro_batches():
    cfg = PackingConfig(tokens_per_micro=32, row_len_buckets=(16, 32), max_seqs_per_row=2)
    # longest 17 -> row_len 32 -> 1 row per micro-batch; 5 sequences of 17 -> 5 rows -> 5 micro -> bucket 8
    p = pack([traj(17, seed=i) for i in range(5)], cfg)
    assert p.batch.shape == (8, 1, 32) and p.n_real_micro == 5
    assert p.batch.loss_mask[5:].sum() == 0 and (p.batch.segment_ids[5:] == 0).all()
    # different contents, same bucket -> same shape
    q = pack([traj(n, seed=10 + n) for n in (20, 30, 18, 25, 22, 19)], cfg)
    assert q.batch.shape == (8, 1, 32)
    # explicit n_micro buckets, beyond the largest -> multiple of it
    cfg2 = PackingConfig(tokens_per_micro=16, row_len_buckets=(16,), n_micro_buckets=(1, 3))
    assert pack([traj(16, seed=i) for i in range(2)], cfg2).n_micro == 3
    assert pack([traj(16, seed=i) for i in range(4)], cfg2).n_micro == 6
    # row_multiple (data-parallel size): rows_per_micro rounded to it
    cfg3 = PackingConfig(tokens_per_micro=100, row_len_buckets=(16,), row_multiple=4)
    assert cfg3.rows_per_micro(16) == 4  # 100 // 16 = 6 -> 4


def test_unpack_round_trip_and_split_minibatches():
    lens = [12, 5, 9, 3, 7, 7]
    trajs = [traj(n, seed=i) for i, n in enumerate(lens)]
    p = pack(trajs, PackingConfig(tokens_per_micro=16, row_len_buckets=(16,)))
    for t, got in zip(trajs, unpack(p.batch.tokens, p)):
        np.testing.assert_array_equal(got, t.tokens)
    groups = split_minibatches(trajs, 2)
    # LPT by hand: 12(#0)->g0, 9(#2)->g1, 7(#4)->g1 (16), 7(#5)->g0 (19), 5(#1)->g1 (21), 3(#3)->g0 (22)
    assert groups == [[0, 3, 5], [1, 2, 4]]
    assert sorted(sum(groups, [])) == list(range(6))
    with pytest.raises(PackingError, match="ppo_n_minibatches=7"):
        split_minibatches(trajs, 7)


def test_too_long_sequence_names_it():
    cfg = PackingConfig(tokens_per_micro=64, row_len_buckets=(16, 32))
    with pytest.raises(PackingError, match=r"trajectory 1 has 40 tokens.*largest row_len bucket 32"):
        pack([traj(10), traj(40), traj(5)], cfg)


@pytest.mark.parametrize("field,value,msg", [
    ("advantages", np.ones(5), r"trajectory 0: field advantages has shape \(5,\), expected \(6,\)"),
    ("behaviour_logprobs", np.zeros((6, 1)), r"field behaviour_logprobs has shape \(6, 1\)"),
    ("versions", np.zeros(7, np.int32), r"field versions has shape \(7,\)"),
    ("loss_mask", np.array([0, 1, 2, 1, 1, 1]), r"field loss_mask must be 0/1"),
    ("loss_mask", np.array([1, 1, 1, 1, 1, 1]), r"loss_mask\[0\] must be 0"),
])
def test_bad_fields_name_the_field(field, value, msg):
    t = traj(6)
    setattr(t, field, value)
    with pytest.raises(PackingError, match=msg):
        validate_trajectory(t, 0)


@pytest.mark.parametrize("field", ["advantages", "behaviour_logprobs", "proximal_logprobs"])
def test_non_finite_on_loss_tokens_is_an_error(field):
    t = traj(6)
    t.proximal_logprobs = np.zeros(6)
    arr = np.asarray(getattr(t, field), np.float64).copy()
    arr[4] = np.nan
    setattr(t, field, arr)
    with pytest.raises(PackingError, match=rf"trajectory 3: field {field} is not finite at token 4"):
        pack([traj(5), traj(5), traj(5), t], PackingConfig(tokens_per_micro=32, row_len_buckets=(16,)))
    # off the loss mask, values are ignored and zeroed in the packed arrays
    arr[4] = 0.0
    arr[0] = np.nan
    setattr(t, field, arr)
    p = pack([t], PackingConfig(tokens_per_micro=16, row_len_buckets=(16,)))
    assert np.isfinite(getattr(p.batch, field)).all()


def test_empty_loss_mask_minibatch_is_an_error():
    t = traj(6)
    t.loss_mask = np.zeros(6, np.int32)
    with pytest.raises(PackingError, match="empty loss_mask"):
        pack([t], PackingConfig(tokens_per_micro=16, row_len_buckets=(16,)))
    # one empty trajectory among others is fine and not counted as a loss sequence
    p = pack([t, traj(6)], PackingConfig(tokens_per_micro=16, row_len_buckets=(16,)))
    assert p.n_seqs == 2 and p.n_loss_seqs == 1 and p.n_loss_tokens == 4
    with pytest.raises(PackingError, match="empty minibatch"):
        pack([], PackingConfig())
