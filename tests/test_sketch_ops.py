"""Count-sketch ops against the NumPy reference (same hashes), linearity, heavy hitters."""
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st

import np_reference as ref
from hvd_compress import ops


@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 3000), rows=st.integers(1, 6), cols=st.integers(1, 500), seed=st.integers(0, 2**31),
       dtype=st.sampled_from([tf.float32, tf.float16, tf.bfloat16]))
def test_sketch_and_query_match_numpy_bit_exact(n, rows, cols, seed, dtype):
    x = tf.cast(np.random.default_rng(seed).standard_normal(n).astype(np.float32), dtype)
    sketch = ops.count_sketch(x, rows, cols, seed)
    np.testing.assert_array_equal(sketch.numpy(), ref.count_sketch(x.numpy(), rows, cols, seed))
    np.testing.assert_array_equal(ops.count_sketch_query(sketch, n, seed).numpy(),
                                  ref.count_sketch_query(sketch.numpy(), n, seed))


def test_large_inputs_match_numpy_bit_exact():
    """More than one segment of the kernel (1M values) and several column regions (4096 columns),
    in float32 and float16: the partitioned, multi-threaded sums keep NumPy's order."""
    x = np.random.default_rng(5).standard_normal(2_500_003).astype(np.float32)
    for dtype in (tf.float32, tf.float16):
        values = tf.cast(x, dtype)
        sketch = ops.count_sketch(values, 2, 150_001, seed=11)
        np.testing.assert_array_equal(sketch.numpy(), ref.count_sketch(values.numpy(), 2, 150_001, seed=11))
    np.testing.assert_array_equal(ops.count_sketch_query(sketch, x.size, seed=11).numpy(),
                                  ref.count_sketch_query(sketch.numpy(), x.size, seed=11))


def test_sketches_are_exactly_linear():
    rng = np.random.default_rng(0)  # integer values: every float32 sum is exact
    a = rng.integers(-1000, 1000, 50_000).astype(np.float32)
    b = rng.integers(-1000, 1000, 50_000).astype(np.float32)
    s = lambda v: ops.count_sketch(v, 5, 2000, seed=7).numpy()  # noqa: E731
    np.testing.assert_array_equal(s(a) + s(b), s(a + b))
    np.testing.assert_array_equal(2 * s(a), s(2 * a))


def test_planted_heavy_hitters_are_recovered():
    rng = np.random.default_rng(1)
    x = rng.standard_normal(200_000).astype(np.float32) * 0.01
    planted = rng.choice(x.size, 50, replace=False)
    x[planted] = rng.choice([-1, 1], 50) * rng.uniform(5, 10, 50)
    estimate = ops.count_sketch_query(ops.count_sketch(x, 5, 20_000, seed=3), x.size, seed=3)
    _, found = ops.top_k_abs(estimate, 50)
    assert set(found.numpy()) == set(planted)
    np.testing.assert_allclose(estimate.numpy()[planted], x[planted], atol=0.2)


def test_different_seeds_steps_and_rows_hash_differently():
    buckets0, _ = ref.sketch_hash(0, 0, 1000, 97)
    assert not np.array_equal(buckets0, ref.sketch_hash(1, 0, 1000, 97)[0])
    assert not np.array_equal(buckets0, ref.sketch_hash(0, 1, 1000, 97)[0])
    assert not np.array_equal(buckets0, ref.sketch_hash(0, 0, 1000, 97, step=1)[0])
    x = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    step = tf.constant(12345, tf.int64)  # a tensor, as the optimizer's step
    sketch = ops.count_sketch(x, 2, 97, seed=3, step=step)
    np.testing.assert_array_equal(sketch.numpy(), ref.count_sketch(x, 2, 97, seed=3, step=12345))
    np.testing.assert_array_equal(ops.count_sketch_query(sketch, 1000, seed=3, step=step).numpy(),
                                  ref.count_sketch_query(sketch.numpy(), 1000, seed=3, step=12345))
    assert set(np.unique(buckets0)) == set(range(97))  # every bucket used


def test_non_finite_values_reach_the_estimate():
    x = np.ones(1000, np.float32)
    x[10] = np.nan
    estimate = ops.count_sketch_query(ops.count_sketch(x, 3, 64), 1000)
    assert np.isnan(estimate.numpy()[10])


@pytest.mark.parametrize("rows", [2, 3, 4, 5, 6])
def test_medians_order_non_finite_values_and_zeros_as_numpy(rows):
    """The query's medians (a min/max network over integer keys for 3 and 5 rows, a sort otherwise)
    on cells of NaN of either sign, infinities, signed zeros and ordinary values: NaN sorts last,
    so a NaN in a minority of rows leaves the median finite and in most rows makes it NaN."""
    special = np.array([np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 1.5, -2.5, 1e-30, -7.0], np.float32)
    sketch = np.random.default_rng(rows).choice(special, (rows, 40)).astype(np.float32)
    got = ops.count_sketch_query(tf.constant(sketch), 5000, seed=rows).numpy()
    want = ref.count_sketch_query(sketch, 5000, seed=rows)
    np.testing.assert_array_equal(got, want)  # NaN equals NaN, -0.0 equals 0.0
    assert np.isnan(want).any() and np.isfinite(want).any()


@pytest.mark.parametrize("rows, cols", [(0, 10), (3, 0), (2.5, 10)])
def test_bad_sizes_are_refused(rows, cols):
    with pytest.raises(ValueError, match="rows|cols"):
        ops.count_sketch(tf.ones([10]), rows, cols)


def test_shapes_inside_tf_function():
    @tf.function(input_signature=[tf.TensorSpec([None], tf.float32), tf.TensorSpec([], tf.int64)])
    def f(x, n):
        sketch = ops.count_sketch(x, 3, 11)
        assert sketch.shape.as_list() == [3, 11]
        estimate = ops.count_sketch_query(sketch, n)
        assert estimate.shape.as_list() == [None]
        return estimate

    assert f(tf.ones([20]), tf.constant(20, tf.int64)).shape == [20]


@settings(deadline=None, max_examples=25)
@given(n=st.integers(1, 5000), rows=st.integers(1, 7), cols=st.integers(1, 200_000), seed=st.integers(0, 2**40),
       step=st.integers(0, 1000), data=st.data())
def test_buckets_are_the_cells_the_sketch_adds_to(n, rows, cols, seed, step, data):
    """count_sketch_buckets names, per row, the cell each coordinate lands in (NumPy's hash), and a
    one-hot vector's sketch is nonzero exactly there."""
    indices = np.array(data.draw(st.lists(st.integers(0, n - 1), min_size=0, max_size=20)), np.int64)
    got = ops.count_sketch_buckets(indices, n, rows, cols, seed, step).numpy()
    assert got.shape == (rows, indices.size)
    for j in range(rows):
        np.testing.assert_array_equal(got[j], ref.sketch_hash(seed, j, n, cols, step)[0][indices])
    if indices.size:
        one_hot = np.zeros(n, np.float32)
        one_hot[indices[0]] = 1.0
        sketch = ops.count_sketch(one_hot, rows, cols, seed, step).numpy()
        assert [tuple(np.flatnonzero(row)) for row in sketch] == [(b,) for b in got[:, 0]]


@pytest.mark.parametrize("index", [-1, 10])
def test_buckets_of_coordinates_outside_the_vector_are_refused(index):
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"indices must be in \[0, n = 10\)"):
        ops.count_sketch_buckets(np.array([3, index], np.int64), 10, 2, 10)


def reference_top_k(sketch, x, k, seed, step):
    """count_sketch_top_k's definition: top_k_abs of the query's estimates, and x there."""
    _, indices = ref.top_k_abs(ref.count_sketch_query(sketch, x.size, seed, step), k)
    return x[indices], indices


@settings(deadline=None, max_examples=40)
@given(n=st.integers(1, 30_000), cols=st.integers(1, 13_000), seed=st.integers(0, 2**40), step=st.integers(0, 50),
       share=st.floats(0, 1), ties=st.booleans(), data=st.data())
def test_top_k_of_a_one_row_sketch_is_top_k_abs_of_its_query(n, cols, seed, step, share, ties, data):
    """The candidates of sketched SGD: one row (regions of 4096 columns from 4097 on), any k, and sketches whose
    cells tie (integer-valued x) or hold NaN, infinities and signed zeros: the same indices as top_k_abs of the
    estimates (ties to the lower index) and x's values at them."""
    rng = np.random.default_rng(seed % 2**32)
    x = (rng.integers(-3, 4, n) if ties else rng.standard_normal(n)).astype(np.float32)
    sketch = ref.count_sketch(x, 1, cols, seed, step)
    if data.draw(st.booleans()):
        cells = rng.integers(0, cols, 4)
        sketch[0, cells] = np.array([np.nan, np.inf, -np.inf, -0.0], np.float32)
    k = int(round(share * n))
    values, indices = ops.count_sketch_top_k(tf.constant(sketch), x, k, seed, step)
    want_values, want_indices = reference_top_k(sketch, x, k, seed, step)
    np.testing.assert_array_equal(indices.numpy(), want_indices)
    np.testing.assert_array_equal(values.numpy(), want_values)


def test_top_k_of_a_large_sketch_is_top_k_abs_of_its_query():
    """Compression.sketch(ratio=4)'s shape at 2.5M coordinates (n / 8 columns, n / 8 candidates): hundreds of regions,
    several threads."""
    x = np.random.default_rng(3).standard_normal(2_500_003).astype(np.float32)
    sketch = ops.count_sketch(x, 1, x.size // 8, seed=7, step=3)
    values, indices = ops.count_sketch_top_k(sketch, x, x.size // 8, 7, 3)
    want_values, want_indices = reference_top_k(sketch.numpy(), x, x.size // 8, 7, 3)
    np.testing.assert_array_equal(indices.numpy(), want_indices)
    np.testing.assert_array_equal(values.numpy(), want_values)


@settings(deadline=None, max_examples=25)
@given(n=st.integers(1, 40_000), cols=st.integers(1, 9_000), rows=st.sampled_from([1, 3]),
       dtype=st.sampled_from([np.float32, np.float16]), data=st.data())
def test_a_bucket_in_parts_is_sketched_and_selected_as_its_concatenation(n, cols, rows, dtype, data):
    """A bucket's parts, read where they lie (some empty, some across regions and runs of 1024): the sketch and the
    one-row top-k of their concatenation, bit for bit; the cells' loads counted with the sketch are the reference
    hash's counts, and the top-k that takes them selects as the one that counts them itself."""
    cuts = sorted(data.draw(st.lists(st.integers(0, n), max_size=5)))
    x = np.random.default_rng(n).standard_normal(n).astype(dtype)
    parts = [tf.constant(piece.reshape(2, -1) if piece.size % 2 == 0 and piece.size else piece)
             for piece in np.split(x, cuts)]
    sketch, loads = ops.count_sketch(parts, rows, cols, seed=5, step=2, count_loads=True)
    np.testing.assert_array_equal(sketch.numpy(), ops.count_sketch(x, rows, cols, seed=5, step=2).numpy())
    np.testing.assert_array_equal(loads.numpy(), [np.bincount(ref.sketch_hash(5, j, n, cols, 2)[0], minlength=cols)
                                                  for j in range(rows)])
    if rows == 1 and dtype == np.float32:
        k = data.draw(st.integers(0, n))
        values, indices = ops.count_sketch_top_k(sketch, parts, k, 5, 2, loads)
        want_values, want_indices = ops.count_sketch_top_k(sketch, x, k, 5, 2)
        np.testing.assert_array_equal(indices.numpy(), want_indices.numpy())
        np.testing.assert_array_equal(values.numpy(), want_values.numpy())


def test_parts_of_different_types_are_refused():
    with pytest.raises(TypeError, match="share one float type"):
        ops.count_sketch([tf.zeros([3]), tf.zeros([3], tf.float16)], 1, 4)


def test_top_k_of_a_sketch_refuses_more_rows_and_a_k_beyond_the_vector():
    with pytest.raises(ValueError, match="one-row sketch"):
        ops.count_sketch_top_k(tf.zeros([2, 10]), tf.zeros([20]), 3)
    with pytest.raises(tf.errors.InvalidArgumentError, match="k must be in"):
        ops.count_sketch_top_k(tf.zeros([1, 10]), tf.zeros([20]), 21)


def test_top_k_of_a_sketch_refuses_loads_of_another_sketch():
    """Loads of another width, or of another vector's size, are refused before anything is selected."""
    _, loads = ops.count_sketch(tf.ones([20]), 1, 10, count_loads=True)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"loads must be .* \[1, cols = 9\]"):
        ops.count_sketch_top_k(tf.zeros([1, 9]), tf.zeros([20]), 3, loads=loads)
    with pytest.raises(tf.errors.InvalidArgumentError, match="loads sum to 20 with 0 negative, not to x's 21 elements"):
        ops.count_sketch_top_k(tf.zeros([1, 10]), tf.zeros([21]), 3, loads=loads)
    crafted = tf.constant([[25, -5] + [0] * 8], tf.int32)  # (sums to 20: a region's place would pass k)
    with pytest.raises(tf.errors.InvalidArgumentError, match="with 1 negative"):
        ops.count_sketch_top_k(tf.zeros([1, 10]), tf.zeros([20]), 3, loads=crafted)
    x = np.random.default_rng(0).standard_normal(50_000).astype(np.float32)
    sketch, other_step = ops.count_sketch(x, 1, 9_000, 7, 1, count_loads=True)  # two regions of other hashes
    with pytest.raises(tf.errors.InvalidArgumentError, match="the loads do not match x's hashes"):
        ops.count_sketch_top_k(sketch, x, 5_000, 7, 2, loads=other_step)


@pytest.mark.skipif("avx512dq" not in open("/proc/cpuinfo").read(), reason="the CPU has no AVX-512: one hash only")
def test_the_avx512_and_avx2_hashes_give_the_same_sketch(tmp_path):
    """Where the CPU has AVX-512, the hash runs 8 coordinates at a time; HVD_COMPRESS_AVX512=0 keeps the AVX2 one: the
    same sketch, query and count_sketch_top_k (over 7 cells, where a seventh of the coordinates tie at the k-th)."""
    script = tmp_path / "avx2.py"
    script.write_text(
        "import sys, numpy as np\n"
        "from hvd_compress import ops\n"
        "x = np.random.default_rng(4).standard_normal(300_007).astype(np.float32)\n"
        "s = ops.count_sketch(x, 2, 20_011, 9, 2)\n"
        "ints = np.random.default_rng(5).integers(-3, 4, 300_007).astype(np.float32)\n"
        "v, i = ops.count_sketch_top_k(ops.count_sketch(ints, 1, 7, 9, 2), ints, 30_001, 9, 2)\n"
        "np.savez(sys.argv[1], s=s.numpy(), q=ops.count_sketch_query(s, x.size, 9, 2).numpy(), v=v.numpy(),\n"
        "         i=i.numpy())\n")
    env = {**os.environ, "HVD_COMPRESS_AVX512": "0"}
    subprocess.run([sys.executable, str(script), str(tmp_path / "avx2.npz")], check=True, timeout=120, env=env)
    avx2 = np.load(tmp_path / "avx2.npz")
    x = np.random.default_rng(4).standard_normal(300_007).astype(np.float32)
    sketch = ops.count_sketch(x, 2, 20_011, 9, 2)
    np.testing.assert_array_equal(sketch.numpy(), ref.count_sketch(x, 2, 20_011, 9, 2))
    np.testing.assert_array_equal(avx2["s"], sketch.numpy())
    np.testing.assert_array_equal(avx2["q"], ops.count_sketch_query(sketch, x.size, 9, 2).numpy())
    ints = np.random.default_rng(5).integers(-3, 4, 300_007).astype(np.float32)
    values, indices = ops.count_sketch_top_k(ops.count_sketch(ints, 1, 7, 9, 2), ints, 30_001, 9, 2)
    np.testing.assert_array_equal(avx2["i"], indices.numpy())
    np.testing.assert_array_equal(avx2["v"], values.numpy())
