"""Sketched SGD's heavy-hitter recovery (hvd_compress/sketch.py), through the exchange itself on one
rank (there the summed vector is the rank's own): at the sizes `ratio=` chooses, the applied
coordinates (every candidate, or with apply_candidates=False the exact top-k among them) hold the
true top-k of a vector with heavy coordinates in dense noise, where the sketch's own top-k (no exact
second round) does not. Real error-feedback residuals: the recall
metric of the digits runs, test_optimizer.py."""
import numpy as np
import pytest
import tensorflow as tf

import horovod.tensorflow as hvd
import hvd_compress as hc
from hvd_compress import exchange

D = 100_000


@pytest.fixture(scope="module", autouse=True)
def horovod_single_rank():
    hvd.init()


def sketch_exchange(compression, d=D):
    bucket = exchange.Bucket(0, [(d,)], 0, 1, hvd.global_process_set, "hc.test.sketch")
    return exchange.plan(compression, bucket)


def planted(k, seed, d=D):
    """Dense unit noise with k coordinates of magnitude 12 to 24 (the true top-k)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(d).astype(np.float32)
    heavy = rng.choice(d, k, replace=False)
    x[heavy] = rng.choice([-1, 1], k) * rng.uniform(12, 24, k)
    return x, heavy


def recovered(compression, seeds=(0, 1, 2), d=D):
    """Per seed: (planted vector, its heavy coordinates, what the exchange returned (Exchanged), the exchange)."""
    ex = sketch_exchange(compression, d)
    for seed in seeds:
        x, heavy = planted(ex.k, seed, d)
        yield x, heavy, ex([tf.constant(x)], {}, exchange.StepInfo(tf.constant(seed, tf.int64))), ex


def check_recall(d=D, **variant):
    """Mean recall of the true top-k, |applied ∩ heavy| / k, over 3 seeds, >= 0.9 at ratios 4 and 8."""
    for ratio in (4, 8):
        compression = hc.Compression.sketch(ratio=ratio, seed=ratio, **variant)
        got = np.mean([len(set(step.applied.numpy()) & set(heavy)) / ex.k
                       for _, heavy, step, ex in recovered(compression, d=d)])
        print(f"d={d}, ratio {ratio}, {variant}: recall {got:.3f}")
        assert got >= 0.9, (ratio, got)


@pytest.mark.parametrize("d", [D, 3_000_000])  # at ratio 4: 4 regions of 3125 columns; 92 of about 4076
def test_the_exact_round_recovers_the_heavy_coordinates_at_ratios_4_and_8(d):
    """Every candidate applied (the default), or only the exact top-k among them (the paper's rule)."""
    for apply_candidates in (True, False):
        check_recall(d=d, apply_candidates=apply_candidates)


@pytest.mark.parametrize("apply_candidates", [True, False])
def test_applied_values_are_the_exact_sums_and_leave_no_residual(apply_candidates):
    for x, _, step, ex in recovered(hc.Compression.sketch(ratio=4, apply_candidates=apply_candidates)):
        applied, residual = step.applied.numpy(), step.residual[0].numpy()
        update = exchange.decoded(step.update, [x.size])[0].numpy()  # (the mean stays sparse till decoded)
        count = ex.num_candidates if apply_candidates else ex.k  # every candidate, or the exact top-k
        assert len(applied) == len(set(applied)) == count and np.count_nonzero(update) == count
        np.testing.assert_array_equal(update[applied], x[applied])  # the exact sums (of one rank)
        np.testing.assert_array_equal(x - residual, update)  # the residual is zero where applied, x elsewhere


def test_the_sketch_s_own_top_k_does_not():
    """The check above fails for a recovery that takes the sketch's top-k at its estimates (the
    paper's one-round variant, second_round=False): one row of the sketch gives every heavy
    coordinate's bucket-mates its value, and only the exact round tells them apart."""
    with pytest.raises(AssertionError, match=r"\(4, "):
        check_recall(second_round=False)


def test_sizes_spend_the_ratio_on_sketch_and_candidates():
    """F = d / ratio floats: half for the sketch, half for P k candidates (P = 25), k = F / 50."""
    for ratio in (4, 8, 32):
        ex = sketch_exchange(hc.Compression.sketch(ratio=ratio))
        floats = D / ratio
        assert ex.k == int(floats / 50) and ex.num_candidates == 25 * ex.k
        assert floats - 1 < ex.rows * ex.cols + ex.num_candidates <= floats
        assert ex.bytes_sent == 0  # one rank sends nothing
        assert hc.Compression.sketch(ratio=ratio).payload_bytes(D) == 4 * (ex.rows * ex.cols + ex.num_candidates)


@pytest.mark.parametrize("rows", [1, 3])
def test_a_bucket_of_several_tensors_is_exchanged_as_its_concatenation(rows):
    """The exchange reads a bucket's tensors where they lie (never concatenated): one row (the candidates straight
    from the cells) or three (median estimates, then the worker's values gathered from the parts) apply the same
    coordinates and leave the same residuals as for the bucket in one tensor."""
    sizes = [60_000, 1, 29_999, 10_000]
    x, _ = planted(500, 3)
    compression = hc.Compression.sketch(ratio=4, rows=rows, seed=1)
    whole = exchange.plan(compression, exchange.Bucket(0, [(D,)], 0, 1, hvd.global_process_set, "hc.test.whole"))
    parts = exchange.plan(compression, exchange.Bucket(0, [(s,) for s in sizes], 0, 1, hvd.global_process_set,
                                                       "hc.test.parts"))
    info = exchange.StepInfo(tf.constant(7, tf.int64))
    one = whole([tf.constant(x)], {}, info)
    several = parts([tf.constant(p) for p in np.split(x, np.cumsum(sizes)[:-1])], {}, info)
    np.testing.assert_array_equal(several.applied.numpy(), one.applied.numpy())
    np.testing.assert_array_equal(np.concatenate([r.numpy() for r in several.residual]), one.residual[0].numpy())
    np.testing.assert_array_equal(np.concatenate([u.numpy() for u in exchange.decoded(several.update, sizes)]),
                                  exchange.decoded(one.update, [D])[0].numpy())  # the values the parts gave
