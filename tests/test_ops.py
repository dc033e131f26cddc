"""The compiled ops against the NumPy reference (bit-exact) and their invariants."""
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import np_reference as ref
from hvd_compress import ops

DTYPES = {"float32": tf.float32, "float16": tf.float16, "bfloat16": tf.bfloat16}
# Small odd sizes with any block size, and sizes around the kernels' chunk grid
# with blocks that cross it (tiny blocks there would only slow the reference).
SMALL_LAYOUTS = st.tuples(st.integers(0, 300), st.one_of(st.none(), st.integers(1, 40), st.just(256)))
LARGE_LAYOUTS = st.tuples(
    st.sampled_from([ref.KCHUNK - 1, ref.KCHUNK, ref.KCHUNK + 1, 2 * ref.KCHUNK + 9, 3 * ref.KCHUNK + 5]),
    st.sampled_from([None, 97, 1000, ref.KCHUNK + 3]))
LAYOUTS = st.one_of(SMALL_LAYOUTS, LARGE_LAYOUTS)
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def sample(n, seed, dtype="float32", ties=False):
    """Gaussian values with exact zeros and negative zeros sprinkled in (small integers if ties)."""
    rng = np.random.default_rng(seed)
    x = rng.integers(-4, 5, n).astype(np.float32) if ties else rng.standard_normal(n).astype(np.float32)
    x[rng.random(n) < 0.05] = 0.0
    x[rng.random(n) < 0.05] = -0.0
    return tf.cast(tf.constant(x), DTYPES[dtype])


@SETTINGS
@given(layout=LAYOUTS, dtype=st.sampled_from(sorted(DTYPES)), seed=st.integers(0, 2**16))
def test_pack_unpack_match_numpy_bit_exact(layout, dtype, seed):
    n, block_size = layout
    x = sample(n, seed, dtype)
    bounds = ref.block_bounds(n, block_size)
    np.testing.assert_array_equal(ops.block_bounds(n, block_size).numpy(), bounds)

    bits, scales = ops.block_sign_pack(x, block_size)
    want_bits, want_scales = ref.pack(x.numpy(), bounds)
    np.testing.assert_array_equal(bits.numpy(), want_bits)
    np.testing.assert_array_equal(scales.numpy(), want_scales)  # bit-exact, not approximately

    decoded = ops.block_sign_unpack(bits, scales, n, block_size)
    np.testing.assert_array_equal(decoded.numpy(), ref.unpack(want_bits, want_scales, bounds))
    as_input_dtype = ops.block_sign_unpack(bits, scales, n, block_size, dtype=DTYPES[dtype])
    assert as_input_dtype.dtype == DTYPES[dtype]
    np.testing.assert_array_equal(as_input_dtype.numpy(), tf.cast(decoded, DTYPES[dtype]).numpy())


@SETTINGS
@given(layout=LAYOUTS, seed=st.integers(0, 2**16), non_finite=st.booleans())
def test_compress_gives_the_pack_and_the_residual_of_its_decoding(layout, seed, non_finite):
    """block_sign_compress: block_sign_pack's payload and x - unpack(payload), bit for bit, also where
    x holds NaN or Inf (whose block's scale is then not finite; a NaN's sign bit may differ)."""
    n, block_size = layout
    x = sample(n, seed).numpy()
    if non_finite and n:
        x[np.random.default_rng(seed).integers(0, n, 2)] = [np.nan, -np.inf]
    bits, scales, residual = ops.block_sign_compress(tf.constant(x), block_size)
    want_bits, want_scales = ops.block_sign_pack(x, block_size)
    np.testing.assert_array_equal(bits.numpy(), want_bits.numpy())
    np.testing.assert_array_equal(scales.numpy(), want_scales.numpy())
    with np.errstate(invalid="ignore"):  # inf - inf
        want_residual = x - ops.block_sign_unpack(bits, scales, n, block_size).numpy()
    # Bit for bit, signed zeros and infinities too; NaN where NumPy has NaN, whatever its sign bit (IEEE leaves a
    # NaN result's sign unspecified, and the compiler may compute x - (-s) as x + s).
    got = residual.numpy()
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want_residual))
    np.testing.assert_array_equal(got[~np.isnan(got)].view(np.uint32), want_residual[~np.isnan(got)].view(np.uint32))


@SETTINGS
@given(layout=LAYOUTS, seed=st.integers(0, 2**16))
def test_unpack_of_pack_has_signs_and_block_means(layout, seed):
    n, block_size = layout
    x = sample(n, seed).numpy()
    bits, scales = ops.block_sign_pack(x, block_size)
    y = ops.block_sign_unpack(bits, scales, n, block_size).numpy()
    bounds = ref.block_bounds(n, block_size)
    if n == 0:
        assert y.size == 0 and scales.shape == [0]
        return
    block_means = np.add.reduceat(np.abs(x.astype(np.float64)), bounds[:-1]) / np.diff(bounds)
    np.testing.assert_allclose(scales.numpy(), block_means, rtol=1e-6)
    per_element = np.repeat(scales.numpy(), np.diff(bounds))
    np.testing.assert_array_equal(np.abs(y), per_element)  # one magnitude per block...
    nonzero = per_element > 0  # ...and the signs of x, with sign(0) = sign(-0) = +1
    np.testing.assert_array_equal((y < 0)[nonzero], (x < 0)[nonzero])


@SETTINGS
@given(layout=LAYOUTS, ranks=st.integers(1, 5), seed=st.integers(0, 2**16))
def test_unpack_mean_matches_numpy(layout, ranks, seed):
    n, block_size = layout
    payloads = [ops.block_sign_pack(sample(n, seed + r), block_size) for r in range(ranks)]
    bits = tf.stack([p[0] for p in payloads])
    scales = tf.stack([p[1] for p in payloads])
    bounds = ref.block_bounds(n, block_size)
    want = ref.unpack_mean([b.numpy() for b in bits], [s.numpy() for s in scales], bounds)
    np.testing.assert_array_equal(ops.block_sign_unpack_mean(bits, scales, n, block_size).numpy(), want)
    # The flat concatenation that hvd.allgather returns decodes the same.
    flat = ops.block_sign_unpack_mean(tf.reshape(bits, [-1]), tf.reshape(scales, [-1]), n, block_size)
    np.testing.assert_array_equal(flat.numpy(), want)
    # plus= adds in the same pass exactly what a separate float32 add gives (two-way's server: mean + e_s).
    plus = sample(n, seed + 1000)
    np.testing.assert_array_equal(ops.block_sign_unpack_mean(bits, scales, n, block_size, plus=plus).numpy(),
                                  want + plus.numpy())


@SETTINGS
@given(sizes=st.lists(st.one_of(st.integers(1, 300), st.sampled_from([ref.KCHUNK - 3, ref.KCHUNK + 5])),
                      min_size=1, max_size=4),
       block_size=st.one_of(st.none(), st.integers(1, 40), st.just(1000)), ranks=st.integers(1, 4),
       seed=st.integers(0, 2**16))
def test_subtract_block_sign_mean_is_the_decode_and_assign_sub(sizes, block_size, ranks, seed):
    """Each variable of a fused bucket less its part of the decoded mean, in place: the bits of
    block_sign_unpack_mean and assign_sub (NumPy's float32 subtraction), eagerly and traced; a read
    taken before still sees the old values (the op copies a buffer that a read holds)."""
    n = sum(sizes)
    bounds = ops.layout_bounds(sizes, block_size)
    payloads = [ops.block_sign_compress(sample(n, seed + r), bounds=bounds)[:2] for r in range(ranks)]
    bits, scales = tf.stack([b for b, _ in payloads]), tf.stack([s for _, s in payloads])
    mean = ref.unpack_mean([b.numpy() for b in bits], [s.numpy() for s in scales], bounds)

    @tf.function
    def subtract(*args):
        ops.subtract_block_sign_mean(*args)

    for offset, size in zip(np.cumsum([0, *sizes[:-1]]), sizes):
        before = sample(size, seed + 7).numpy()
        variable = tf.Variable(before)
        read = variable.read_value()
        ops.subtract_block_sign_mean(variable, bits, scales, tf.constant(bounds), offset)
        want = before - mean[offset:offset + size]
        np.testing.assert_array_equal(variable.numpy(), want)
        np.testing.assert_array_equal(read.numpy(), before)
        subtract(variable, bits, scales, tf.constant(bounds), offset)
        np.testing.assert_array_equal(variable.numpy(), want - mean[offset:offset + size])


def test_subtract_block_sign_mean_refuses_what_it_cannot_update():
    bits, scales = ops.block_sign_pack(tf.ones([16]))
    with pytest.raises(TypeError, match="float32 variables only, got float16"):
        ops.subtract_block_sign_mean(tf.Variable(tf.ones([16], tf.float16)), bits[None], scales[None], [0, 16])
    with pytest.raises(tf.errors.InvalidArgumentError, match="the variable's 10 elements from offset 8 do not fit"):
        ops.subtract_block_sign_mean(tf.Variable(tf.ones([10])), bits[None], scales[None], [0, 16], 8)
    with pytest.raises(tf.errors.InvalidArgumentError, match="payload does not match bounds"):
        ops.subtract_block_sign_mean(tf.Variable(tf.ones([10])), bits[None], scales[None], [0, 8, 16])


def test_unpack_mean_refuses_a_plus_of_another_size():
    bits, scales = ops.block_sign_pack(tf.ones([16]))
    with pytest.raises(tf.errors.InvalidArgumentError, match="plus must be at most one float32 tensor of 16 "):
        ops.block_sign_unpack_mean(bits[None], scales[None], 16, plus=tf.ones([15]))
    traced = tf.function(lambda b, s, p: ops.block_sign_unpack_mean(b, s, 16, plus=p))
    with pytest.raises(ValueError, match="Dimension 0 in both shapes must be equal, but are 15 and 16"):
        traced.get_concrete_function(bits[None], scales[None], tf.TensorSpec([15], tf.float32))


def test_bit_order_is_lsb_first_and_zero_is_positive():
    x = tf.constant([-1.0, 0.0, -0.0, 2.0, 1.0, 1.0, 1.0, -3.0, -1.0])
    bits, scales = ops.block_sign_pack(x)
    assert bits.numpy().tolist() == [0b10000001, 0b1]
    np.testing.assert_allclose(scales.numpy(), [10.0 / 9])


def test_fused_layout_gives_each_tensor_its_own_blocks():
    bounds = ops.block_bounds([3, 0, 5, 2], block_size=None).numpy()
    np.testing.assert_array_equal(bounds, [0, 3, 8, 10])
    np.testing.assert_array_equal(ops.block_bounds([5, 3], block_size=2).numpy(), [0, 2, 4, 5, 7, 8])
    x = tf.constant([1.0, -1.0, 1.0, 4.0, 4.0, -4.0, 4.0, 4.0, 0.5, 0.5])
    _, scales = ops.block_sign_pack(x, bounds=bounds)
    np.testing.assert_allclose(scales.numpy(), [1.0, 4.0, 0.5])


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_value_makes_its_block_non_finite(bad):
    x = np.ones(64, np.float32)
    x[40] = bad
    bits, scales = ops.block_sign_pack(x, block_size=16)
    assert np.all(np.isfinite(scales.numpy()[[0, 1, 3]]))
    assert not np.isfinite(scales.numpy()[2])
    decoded = ops.block_sign_unpack(bits, scales, 64, 16).numpy()
    assert not np.any(np.isfinite(decoded[32:48]))
    assert np.all(np.isfinite(decoded[:32]))


def test_results_do_not_depend_on_thread_count(tmp_path):
    """The fixed chunk grid makes a 1-thread process give the same bytes as this one."""
    script = tmp_path / "one_thread.py"
    script.write_text(
        "import sys, numpy as np, tensorflow as tf\n"
        "tf.config.threading.set_intra_op_parallelism_threads(1)\n"
        "from hvd_compress import ops\n"
        "x = np.random.default_rng(3).standard_normal(5 * 16384 + 11).astype(np.float32)\n"
        "bits, scales = ops.block_sign_pack(x)\n"
        "np.savez(sys.argv[1], bits=bits.numpy(), scales=scales.numpy(), top=ops.top_k_abs(x, 999)[1].numpy(),\n"
        "         half=ops.half_mean(tf.reshape(ops.half_pack([x[:-11]]), [5, -1])).numpy())\n")
    subprocess.run([sys.executable, str(script), str(tmp_path / "one.npz")], check=True, timeout=120)
    one_thread = np.load(tmp_path / "one.npz")
    x = np.random.default_rng(3).standard_normal(5 * ref.KCHUNK + 11).astype(np.float32)
    bits, scales = ops.block_sign_pack(x)
    np.testing.assert_array_equal(one_thread["bits"], bits.numpy())
    np.testing.assert_array_equal(one_thread["scales"], scales.numpy())
    np.testing.assert_array_equal(one_thread["top"], ops.top_k_abs(x, 999)[1].numpy())
    np.testing.assert_array_equal(one_thread["half"], ops.half_mean(tf.reshape(ops.half_pack([x[:-11]]), [5, -1])))


@SETTINGS
@given(n=st.integers(1, 3000), data=st.data(), dtype=st.sampled_from(sorted(DTYPES)),
       ties=st.booleans(), seed=st.integers(0, 2**16))
def test_top_k_abs_matches_numpy(n, data, dtype, ties, seed):
    k = data.draw(st.integers(0, n))
    x = sample(n, seed, dtype, ties=ties)
    values, indices = ops.top_k_abs(x, k)
    want_values, want_indices = ref.top_k_abs(x.numpy(), k)
    np.testing.assert_array_equal(indices.numpy(), want_indices)
    np.testing.assert_array_equal(values.numpy(), want_values)
    # Invariant: nothing left out is larger than what was taken.
    if 0 < k < n:
        left_out = np.delete(np.abs(x.numpy().astype(np.float32)), indices.numpy())
        assert left_out.max() <= np.abs(values.numpy().astype(np.float32)).min()


def test_top_k_abs_many_segments_and_non_finite():
    x = sample(3 * 65536 + 17, 11, ties=True).numpy()  # several segments, many ties
    x[[5, 70000, 150000]] = [np.nan, -np.inf, np.inf]
    for k in (1, 3, 1000, 70001):
        values, indices = ops.top_k_abs(x, k)
        want_values, want_indices = ref.top_k_abs(x, k)
        np.testing.assert_array_equal(indices.numpy(), want_indices)
        np.testing.assert_array_equal(values.numpy(), want_values)
    assert ops.top_k_abs(x, 1)[1].numpy().tolist() == [5]  # NaN counts as the largest


@SETTINGS
@given(n=st.integers(0, 5000), k=st.integers(0, 400), dtype=st.sampled_from(sorted(DTYPES)),
       seed=st.integers(0, 2**16))
def test_scatter_dense_sums_duplicates(n, k, dtype, seed):
    rng = np.random.default_rng(seed)
    indices = rng.integers(0, max(n, 1), k if n else 0).astype(np.int32)
    values = tf.cast(rng.standard_normal(indices.size).astype(np.float32), DTYPES[dtype])
    got = ops.scatter_dense(indices, values, n)
    want = ref.scatter_dense(indices, values.numpy(), n, got.dtype.as_numpy_dtype)
    np.testing.assert_array_equal(got.numpy(), want)
    np.testing.assert_array_equal(ops.scatter_dense(indices.astype(np.int64), values, n).numpy(), want)


def test_scatter_of_top_k_is_a_round_trip():
    x = sample(1000, 5).numpy()
    values, indices = ops.top_k_abs(x, 100)
    dense = ops.scatter_dense(indices, values, 1000).numpy()
    np.testing.assert_array_equal(dense[indices.numpy()], x[indices.numpy()])
    assert np.count_nonzero(dense) == np.count_nonzero(x[indices.numpy()])


def test_shape_inference_with_unknown_dimensions():
    @tf.function(input_signature=[tf.TensorSpec([None, None], tf.float32), tf.TensorSpec([], tf.int32)])
    def dynamic(x, k):
        n = tf.size(x, out_type=tf.int64)
        bits, scales = ops.block_sign_pack(x, block_size=4)
        decoded = ops.block_sign_unpack(bits, scales, n, block_size=4)
        mean = ops.block_sign_unpack_mean(tf.stack([bits, bits]), tf.stack([scales, scales]), n, block_size=4)
        values, indices = ops.top_k_abs(x, k)
        dense = ops.scatter_dense(indices, values, n)
        for t in (bits, scales, decoded, mean, values, indices, dense):
            assert t.shape.as_list() == [None], t
        return decoded, mean, dense

    decoded, mean, dense = dynamic(tf.ones([3, 5]), tf.constant(2))
    assert decoded.shape == [15] and mean.shape == [15] and dense.shape == [15]

    @tf.function(input_signature=[tf.TensorSpec([6, 5], tf.float32)])
    def static(x):
        bits, scales = ops.block_sign_pack(x, block_size=4)
        assert bits.shape.as_list() == [4] and scales.shape.as_list() == [8]
        assert ops.block_sign_unpack(bits, scales, 30, block_size=4).shape.as_list() == [30]
        values, indices = ops.top_k_abs(x, 7)
        assert values.shape.as_list() == [7] and indices.shape.as_list() == [7]
        assert ops.scatter_dense(indices, values, 30).shape.as_list() == [30]
        return bits

    static(tf.ones([6, 5]))


@SETTINGS
@given(sizes=st.lists(st.sampled_from([1, 2, 9, 300, ref.KCHUNK + 3, 70000]), min_size=1, max_size=4),
       data=st.data(), ranks=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_top_k_over_parts_zero_at_and_scatter_mean_match_numpy(sizes, data, ranks, seed):
    """Top-k's and random-k's in-place path: the selection over a list of parts is the one over their
    concatenation (pieces never cross a part, so this checks the cut), gather_at reads it back, the
    residual zeroes it, and the allgathered pairs of `ranks` ranks (duplicates across ranks) give the
    NumPy mean of their dense sums."""
    rng = np.random.default_rng(seed)
    parts = [rng.integers(-4, 5, n).astype(np.float32) for n in sizes]  # ties cross the parts
    flat = np.concatenate(parts)
    k = data.draw(st.integers(0, flat.size))
    values, indices = ops.top_k_abs([tf.constant(p) for p in parts], k)
    want_values, want_indices = ref.top_k_abs(flat, k)
    np.testing.assert_array_equal(values.numpy(), want_values)
    np.testing.assert_array_equal(indices.numpy(), want_indices)
    np.testing.assert_array_equal(ops.gather_at([tf.constant(p) for p in parts], indices).numpy(), want_values)
    np.testing.assert_array_equal(ops.gather_at(tf.constant(flat), indices).numpy(), want_values)
    zeroed = ops.zero_at([tf.constant(p) for p in parts], indices)
    np.testing.assert_array_equal(np.concatenate([z.numpy() for z in zeroed]),
                                  flat - ref.scatter_dense(want_indices, want_values, flat.size))
    pairs = [ref.top_k_abs(flat + rng.standard_normal(flat.size).astype(np.float32), k) for _ in range(ranks)]
    mean = ops.scatter_mean(np.concatenate([i for _, i in pairs]).astype(np.int32),
                            np.concatenate([v for v, _ in pairs]), [(n,) for n in sizes], ranks)
    total = np.zeros(flat.size, np.float32)
    for v, i in pairs:
        total += ref.scatter_dense(i, v, flat.size)
    np.testing.assert_array_equal(np.concatenate([m.numpy() for m in mean]), total / np.float32(ranks))


SPECIAL_HALVES = np.array([np.nan, np.inf, -np.inf, 7e4, -7e4, 65504, 65519.99, 65520, 1e-8, 6e-8, 3e-8,
                          -3e-5, 0.0, -0.0, 1 + 2 ** -11, 1 + 3 * 2 ** -11], np.float32)  # ties round to even


@SETTINGS
@given(sizes=st.lists(st.sampled_from([0, 1, 7, 8, 9, 300, ref.KCHUNK - 1, ref.KCHUNK + 5]), min_size=1, max_size=4),
       dtypes=st.lists(st.sampled_from(sorted(DTYPES)), min_size=4, max_size=4), scale=st.sampled_from([1e-6, 1, 3e4]),
       seed=st.integers(0, 2**16))
def test_half_pack_and_unpack_match_numpy(sizes, dtypes, scale, seed):
    """Fused float16 buffers: every part cast as NumPy's astype(np.float16) (F16C's vector body and the
    scalar tail alike, parts crossing the chunk grid), and cast back into each part's dtype."""
    rng = np.random.default_rng(seed)
    parts = [tf.cast(rng.standard_normal(n).astype(np.float32) * np.float32(scale), DTYPES[d])
             for n, d in zip(sizes, dtypes)]
    parts.append(tf.constant(SPECIAL_HALVES))
    packed = ops.half_pack(parts)
    with np.errstate(over="ignore"):
        want = np.concatenate([tf.cast(p, tf.float32).numpy() for p in parts]).astype(np.float16)
    assert packed.dtype == tf.float16
    np.testing.assert_array_equal(packed.numpy().view(np.uint16)[~np.isnan(want)],
                                  want.view(np.uint16)[~np.isnan(want)])  # bit-exact, signed zeros too
    np.testing.assert_array_equal(np.isnan(packed.numpy()), np.isnan(want))
    shapes = [(n,) for n in sizes] + [(4, 4)]
    back = ops.half_unpack(packed, shapes, [p.dtype for p in parts])
    offset = 0
    for part, got, shape in zip(parts, back, shapes):
        n = int(np.prod(shape))
        assert got.dtype == part.dtype and tuple(got.shape) == shape
        expected = tf.cast(tf.constant(want[offset:offset + n].astype(np.float32)), part.dtype)
        np.testing.assert_array_equal(tf.cast(got, tf.float32).numpy().ravel(),
                                      tf.cast(expected, tf.float32).numpy().ravel())
        offset += n
    cuts = np.sort(rng.integers(0, packed.shape[0] + 1, size=3))  # the buffer in pieces, some maybe empty
    in_pieces = ops.half_unpack(tf.split(packed, np.diff(np.concatenate([[0], cuts, [packed.shape[0]]]))),
                                shapes, [p.dtype for p in parts])
    for whole, pieces in zip(back, in_pieces):
        np.testing.assert_array_equal(tf.bitcast(whole, tf.uint16 if whole.dtype.size == 2 else tf.uint32).numpy(),
                                      tf.bitcast(pieces, tf.uint16 if pieces.dtype.size == 2 else tf.uint32).numpy())


@SETTINGS
@given(count=st.integers(1, 5), m=st.sampled_from([1, 9, 300, ref.KCHUNK + 3, 2 * ref.KCHUNK]),
       seed=st.integers(0, 2**16))
def test_half_mean_matches_numpy(count, m, seed):
    rows = (np.random.default_rng(seed).standard_normal((count, m)) * 1e3).astype(np.float16)
    rows[0, 0] = np.float16(6e4)  # the float32 sum of such values does not overflow; a float16 sum would
    rows[:, -1] = np.float16(6e4)
    got = ops.half_mean(tf.constant(rows)).numpy()
    np.testing.assert_array_equal(got.astype(np.float32), ref.half_mean(list(rows)))
    assert np.isfinite(got[-1])


def test_ops_have_no_gradient():
    x = tf.Variable(tf.ones([8]))
    with tf.GradientTape() as tape:
        _, scales = ops.block_sign_pack(x)
        values, _ = ops.top_k_abs(x, 2)
        loss = tf.reduce_sum(scales) + tf.reduce_sum(values)
    assert tape.gradient(loss, x) is None


@pytest.mark.parametrize("call, error, match", [
    (lambda: ops.block_sign_pack(tf.ones([4]), block_size=0), ValueError, "block_size"),
    (lambda: ops.block_sign_pack(tf.ones([4]), block_size=-3), ValueError, "block_size"),
    (lambda: ops.block_sign_pack(tf.ones([4], tf.int32)), TypeError, "float"),
    (lambda: ops.block_sign_pack(tf.ones([4]), bounds=[0, 3]), tf.errors.InvalidArgumentError, "n=4"),
    (lambda: ops.block_sign_pack(tf.ones([4]), bounds=[0, 2, 2, 4]), tf.errors.InvalidArgumentError,
     "strictly increasing"),
    (lambda: ops.block_sign_unpack(tf.zeros([1], tf.uint8), tf.ones([2]), 9, 4),
     tf.errors.InvalidArgumentError, "does not match"),
    (lambda: ops.top_k_abs(tf.ones([4]), 5), ValueError, "k"),
    (lambda: ops.top_k_abs(tf.ones([4]), tf.constant(5)), tf.errors.InvalidArgumentError, "k must be"),
    (lambda: ops.scatter_dense([0, 4], [1.0, 2.0], 4), tf.errors.InvalidArgumentError, "out of range"),
    (lambda: ops.zero_at([tf.ones([4])], tf.constant([4])), tf.errors.InvalidArgumentError, "out of range"),
    (lambda: ops.gather_at([tf.ones([4]), tf.ones([2])], tf.constant([6])), tf.errors.InvalidArgumentError,
     "out of range"),
    (lambda: ops.scatter_mean(tf.constant([0, 9]), tf.ones([2]), [(4,), (5,)], 2), tf.errors.InvalidArgumentError,
     "out of range"),
    (lambda: ops.half_pack([tf.ones([4], tf.int32)]), TypeError, "float"),
    (lambda: ops.half_unpack(tf.ones([5], tf.float16), [(4,)], [tf.float32]), tf.errors.InvalidArgumentError,
     "sum\\(sizes\\) = 4"),
    (lambda: ops.half_mean(tf.ones([4], tf.float16)), tf.errors.InvalidArgumentError, "must be \\[count, m\\]"),
    (lambda: ops.momentum_error_feed(tf.ones([4]), tf.ones([4]), tf.ones([5]), 0.1, 0.9, False),
     tf.errors.InvalidArgumentError, "one shape"),
    (lambda: ops.momentum_error_feed(tf.ones([4]), tf.ones([4]), tf.ones([4]), [0.1, 0.2], 0.9, False),
     tf.errors.InvalidArgumentError, "lr, momentum and residual_scale must be scalars"),
    (lambda: ops.adam_momentum_feed(tf.ones([4]), tf.ones([4]), tf.ones([5]), tf.ones([4]), 0.9, 1e-7),
     tf.errors.InvalidArgumentError, "input 2 has shape \\[5\\].*must have one shape"),
    (lambda: ops.adam_frozen_step(tf.ones([4]), tf.ones([4]), tf.ones([4]), [1.0, 2.0], 0.9, 1e-7, True),
     tf.errors.InvalidArgumentError, "input 3 must be a scalar"),
    (lambda: ops.push_sum_share([tf.ones([4]), tf.ones([2])], 1.0, 2, before=[tf.ones([4])]),
     tf.errors.InvalidArgumentError, "no `before` or one per value: got 1 for 2 values"),
    (lambda: ops.push_sum_share([tf.ones([4]), tf.ones([2, 2])], 1.0, 2, before=[tf.ones([4]), tf.ones([4])]),
     tf.errors.InvalidArgumentError, "before\\[1\\] must have the shape of values\\[1\\], \\[2,2\\], got \\[4\\]"),
    (lambda: ops.push_sum_share([tf.ones([4])], [1.0, 1.0], 2), tf.errors.InvalidArgumentError,
     "weight must be a scalar"),
    (lambda: ops.push_sum_share([tf.ones([4])], 1.0, 1), tf.errors.InvalidArgumentError, "parts.*minimum 2"),
])
def test_bad_input_gets_a_clear_error(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_library_built_for_another_tensorflow_is_refused(monkeypatch):
    ops.library.cache_clear()
    monkeypatch.setattr(tf, "__version__", "0.0.0")
    with pytest.raises(ops.OpsLibraryError, match="built for TensorFlow 2.*but TensorFlow 0.0.0.*make setup"):
        ops.library()
    monkeypatch.undo()
    ops.library.cache_clear()
    missing = ops.LIBRARY_PATH.with_name("no_such_library.so")
    monkeypatch.setattr(ops, "LIBRARY_PATH", missing)
    with pytest.raises(ops.OpsLibraryError, match="missing.*make setup"):
        ops.library()
    monkeypatch.undo()
    ops.library.cache_clear()
    assert ops.library() is not None


def test_more_than_2_pow_31_elements():
    """64-bit indexing end to end: 2^31 + 13 bfloat16 values (4.3 GB; needs ~14 GB free)."""
    import psutil

    if psutil.virtual_memory().available < 16 * 2**30:
        pytest.skip("needs 16 GiB of free memory for a 2^31-element tensor")
    n = 2**31 + 13
    negative = [0, 2**31 - 1, 2**31, 2**31 + 5, n - 1]
    x = tf.tensor_scatter_nd_update(tf.fill([n], tf.constant(0.5, tf.bfloat16)),
                                    [[i] for i in negative], tf.constant([-2.0] * 5, tf.bfloat16))
    bits, scales = ops.block_sign_pack(x, block_size=2**31)
    del x
    assert bits.shape == [(n + 7) // 8] and scales.shape == [2]
    set_bits = np.flatnonzero(np.unpackbits(bits.numpy(), bitorder="little")[:n])
    np.testing.assert_array_equal(set_bits, negative)
    want_first = (0.5 * (2**31 - 2) + 2.0 * 2) / 2**31
    np.testing.assert_allclose(scales.numpy(), [want_first, (0.5 * 10 + 2.0 * 3) / 13], rtol=1e-7)
    decoded = ops.block_sign_unpack(bits, scales, n, block_size=2**31, dtype=tf.bfloat16)
    assert decoded.shape == [n]
    tail = decoded[2**31 - 2:].numpy().astype(np.float32)
    np.testing.assert_array_equal(tail < 0, np.isin(np.arange(2**31 - 2, n), negative))


def large_input(case, n):
    """Inputs past the size where top_k_abs selects from a sample, built to take each of its paths;
    its sample is the first 16 of every 4093 elements of the concatenation."""
    rng = np.random.default_rng(7)
    noise = rng.standard_normal(n).astype(np.float32)
    sampled = np.arange(n) % 4093 < 16
    if case == "gaussian":  # more than k above the sample's key: the exact select on those alone
        return noise
    if case == "rounded":  # the same, with ties at the k-th key among those copied out
        return np.round(noise * 64) / np.float32(64)
    if case == "ties":  # the sample's key is the k-th largest key: one pass with ties to the lower index
        return sample(n, 1, ties=True).numpy()
    if case == "sample_too_high":  # the sample holds only large values: too few reach its key
        return np.where(sampled, 10 + noise, 1e-3 * noise)
    if case == "sample_too_low":  # the sample holds only small values: far more than 2k reach its key
        return np.where(sampled, 1e-3 * noise, noise)
    if case == "non_finite":
        x = noise.copy()
        x[[3, 16, 4096 * 7 + 1, n - 1]] = [np.nan, np.inf, -np.inf, np.nan]
        return x
    raise ValueError(case)


@pytest.mark.parametrize("case", ["gaussian", "rounded", "ties", "sample_too_high", "sample_too_low", "non_finite"])
@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_top_k_abs_of_large_inputs_matches_numpy(case, dtype):
    """Every way top_k_abs may select on inputs over 2^20 elements (two parts, so its pieces start
    anywhere), for k = 0.1% and 1% (the sampled select) and k = 20% (the radix select alone)."""
    n = (1 << 21) + 4096 * 3 + 7
    x = tf.cast(large_input(case, n), DTYPES[dtype])
    parts = [x[:(1 << 20) + 5], x[(1 << 20) + 5:]]
    for k in (n // 1000, n // 100, n // 5):
        values, indices = ops.top_k_abs(parts, k)
        want_values, want_indices = ref.top_k_abs(x.numpy(), k)
        np.testing.assert_array_equal(indices.numpy(), want_indices)
        # as float32: NumPy finds bfloat16's NaNs unequal
        np.testing.assert_array_equal(values.numpy().astype(np.float32), want_values.astype(np.float32))


@pytest.mark.parametrize("n", [(1 << 20) - 1, 1 << 20])
def test_top_k_abs_at_the_sampling_bound(n):
    x = large_input("rounded", n)
    for k in (1, n // 100, n // 8, n // 8 + 1):
        values, indices = ops.top_k_abs(x, k)
        want_values, want_indices = ref.top_k_abs(x, k)
        np.testing.assert_array_equal(indices.numpy(), want_indices)
        np.testing.assert_array_equal(values.numpy(), want_values)


def test_top_k_abs_when_exactly_k_keys_lie_above_the_sampled_key():
    """k large values spread evenly, the rest one small value tied everywhere: the sample's key is the
    small value and exactly k keys lie above it."""
    n, k = 1 << 21, 20000
    x = np.full(n, 0.5, np.float32)
    x[np.linspace(0, n - 1, k).astype(np.int64)] = np.arange(k, dtype=np.float32) + 1
    values, indices = ops.top_k_abs(x, k)
    want_values, want_indices = ref.top_k_abs(x, k)
    np.testing.assert_array_equal(indices.numpy(), want_indices)
    np.testing.assert_array_equal(values.numpy(), want_values)


def test_fused_ops_write_in_place_as_they_would_into_fresh_buffers():
    """Inside a tf.function the inputs below are intermediates nothing else holds, so
    block_sign_compress, momentum_error_feed and zero_at write their outputs into them: the results
    must be those of fresh buffers."""
    rng = np.random.default_rng(5)
    g, m, e = (tf.constant(rng.standard_normal(70001).astype(np.float32)) for _ in range(3))
    indices = tf.constant([0, 7, 70000], tf.int32)

    @tf.function
    def fused():
        _, _, residual = ops.block_sign_compress(g * 1.0)
        m_new, a = ops.momentum_error_feed(g * 1.0, m, e, 0.3, 0.9, True)
        return residual, m_new, a, ops.zero_at([g * 1.0], indices)[0]

    residual, m_new, a, zeroed = fused()
    bits, scales = ops.block_sign_pack(g)
    np.testing.assert_array_equal(residual.numpy(), g.numpy() - ops.block_sign_unpack(bits, scales, 70001).numpy())
    want_m = np.float32(0.9) * m.numpy() + g.numpy()
    np.testing.assert_array_equal(m_new.numpy(), want_m)
    np.testing.assert_array_equal(a.numpy(), np.float32(0.3) * (np.float32(0.9) * want_m + g.numpy()) + e.numpy())
    want_zeroed = g.numpy().copy()
    want_zeroed[indices.numpy()] = 0
    np.testing.assert_array_equal(zeroed.numpy(), want_zeroed)


@SETTINGS
@given(n=st.integers(0, 3 * ref.KCHUNK + 5), momentum=st.sampled_from([0.0, 0.5, 0.9, 0.99]),
       nesterov=st.booleans(), seed=st.integers(0, 2**16), rescaled=st.booleans())
def test_momentum_error_feed_matches_the_tensorflow_ops(n, momentum, nesterov, seed, rescaled):
    """The fused worker step rounds as the TensorFlow ops it replaces (and as NumPy's float32); the
    residual scale (a learning-rate change) multiplies e, and a scale of 1 leaves it exact."""
    rng = np.random.default_rng(seed)
    g, m, e = (rng.standard_normal(n).astype(np.float32) * np.float32(s) for s in (1, 3, 1e-3))
    lr = np.float32(rng.uniform(1e-3, 1))
    scale = np.float32(rng.uniform(1e-3, 2)) if rescaled else np.float32(1)
    m_new, a = ops.momentum_error_feed(tf.constant(g), m, e, lr, momentum, nesterov, scale)
    want_m = np.float32(momentum) * m + g
    want_a = lr * (np.float32(momentum) * want_m + g if nesterov else want_m) + scale * e
    np.testing.assert_array_equal(m_new.numpy(), want_m)
    np.testing.assert_array_equal(a.numpy(), want_a)
    tf_m = momentum * tf.constant(m) + g
    tf_a = lr * (momentum * tf_m + g if nesterov else tf_m) + scale * tf.constant(e)
    np.testing.assert_array_equal(m_new.numpy(), tf_m.numpy())
    np.testing.assert_array_equal(a.numpy(), tf_a.numpy())
    if not rescaled:  # the rule before rescaling: bit for bit
        np.testing.assert_array_equal(a.numpy(), lr * (np.float32(momentum) * want_m + g if nesterov else want_m) + e)
    # momentum and the scale as tensors (a tape's exchange may get them) give the same bits
    _, a_of_tensor = ops.momentum_error_feed(tf.constant(g), m, e, lr, tf.constant(momentum), nesterov,
                                             tf.constant(scale))
    np.testing.assert_array_equal(a_of_tensor.numpy(), want_a)


@SETTINGS
@given(n=st.integers(0, 3 * ref.KCHUNK + 5), beta_1=st.sampled_from([0.0, 0.5, 0.9, 0.99]),
       epsilon=st.sampled_from([1e-7, 1e-3]), momentum_exchanged=st.booleans(), seed=st.integers(0, 2**16),
       bound=st.sampled_from([np.inf, 30.0, 1.0]))
def test_the_fused_adam_kernels_match_numpy_and_the_tensorflow_ops(n, beta_1, epsilon, momentum_exchanged, seed,
                                                                    bound):
    """1-bit Adam's worker side and the receiving side of Adam with a frozen variance, each one pass, round as NumPy's
    float32 and as the TensorFlow ops they replace (hvd_compress/adam.py before them, then a clip)."""
    rng = np.random.default_rng(seed)
    g, m, e, mean = (rng.standard_normal(n).astype(np.float32) * np.float32(s) for s in (1, 0.3, 1e-3, 0.5))
    v = np.abs(rng.standard_normal(n).astype(np.float32)) * np.float32(1e-4)
    v[: n // 7] = 0  # coordinates that never had a gradient: d = epsilon
    alpha, b1, eps = np.float32(rng.uniform(1e-4, 1e-2)), np.float32(1.0 - beta_1), np.float32(epsilon)
    d = np.sqrt(v) + eps
    bound, max_step = np.float32(bound), np.float32(bound) * alpha
    a = ops.adam_momentum_feed(tf.constant(g), m, v, e, beta_1, epsilon, bound)
    np.testing.assert_array_equal(a.numpy(), np.clip((m + (g - m) * b1) / d, -bound, bound) + e)
    tf_d = tf.sqrt(tf.constant(v)) + tf.cast(epsilon, tf.float32)
    np.testing.assert_array_equal(
        a.numpy(), (tf.clip_by_value((m + (g - m) * (1.0 - beta_1)) / tf_d, -bound, bound) + e).numpy())
    if n and bound < 2:
        assert np.mean(np.abs((m + (g - m) * b1) / d) > bound) > 0.1  # the bound cuts
    m_new, delta = ops.adam_frozen_step(tf.constant(mean), m, v, alpha, beta_1, epsilon, momentum_exchanged,
                                        max_step)
    if momentum_exchanged:
        want_m, want_delta = mean * d, mean * alpha
        tf_m, tf_delta = mean * tf_d, mean * alpha
    else:
        want_m = m + (mean - m) * b1
        want_delta = (want_m * alpha) / d
        tf_m = tf.constant(m) + (mean - m) * (1.0 - beta_1)
        tf_delta = (tf_m * alpha) / tf_d
    want_delta = np.clip(want_delta, -max_step, max_step)
    tf_delta = tf.clip_by_value(tf_delta, -max_step, max_step)
    for got, want, tf_want in ((m_new, want_m, tf_m), (delta, want_delta, tf_delta)):
        np.testing.assert_array_equal(got.numpy(), want)
        np.testing.assert_array_equal(got.numpy(), np.asarray(tf_want))


@pytest.mark.parametrize("decay", [0.0, 1e-5])
def test_decay_and_subtract_is_kerass_weight_decay_and_assign_sub_in_place(decay):
    """The step of a variable whose rule hvd_compress applies: the bits of x - x * (wd lr) and assign_sub, in place."""
    rng = np.random.default_rng(11)
    x0, delta = (rng.standard_normal(3 * ref.KCHUNK + 5).astype(np.float32) for _ in range(2))
    x = tf.Variable(x0)
    held = tf.convert_to_tensor(x)  # a read that still holds the buffer: the op copies it first
    ops.decay_and_subtract(x, delta, decay)
    np.testing.assert_array_equal(x.numpy(), (x0 - x0 * np.float32(decay)) - delta)
    np.testing.assert_array_equal(held.numpy(), x0)
    with pytest.raises(TypeError, match="float32 variables only"):
        ops.decay_and_subtract(tf.Variable(tf.zeros([3], tf.float16)), tf.zeros([3]), decay)
    with pytest.raises(tf.errors.InvalidArgumentError, match="delta has 2 elements and the variable 3"):
        ops.decay_and_subtract(tf.Variable(tf.zeros([3])), tf.zeros([2]), decay)


@settings(deadline=None, max_examples=30)
@given(sizes=st.lists(st.integers(1, 3000), min_size=1, max_size=4), share=st.floats(0, 1), count=st.integers(1, 5),
       seed=st.integers(0, 2**32 - 1))
def test_subtract_sparse_mean_is_scatter_mean_subtracted_from_each_part(sizes, share, count, seed):
    """A bucket's sparse mean (distinct, increasing indices over its parts) subtracted from each part's variable in
    place: the bits of ScatterMean's dense mean subtracted from the whole variable, the variable's buffer copied
    first where a read still holds it."""
    rng = np.random.default_rng(seed)
    n = sum(sizes)
    indices = np.sort(rng.choice(n, int(share * n), replace=False)).astype(np.int32)
    values = rng.standard_normal(indices.size).astype(np.float32)
    dense = ops.scatter_mean(indices, values, [(size,) for size in sizes], count)
    offset = 0
    for size, mean in zip(sizes, dense):
        x0 = rng.standard_normal(size).astype(np.float32)
        x = tf.Variable(x0)
        held = tf.convert_to_tensor(x)
        ops.subtract_sparse_mean(x, indices, values, offset, count)
        np.testing.assert_array_equal(x.numpy(), x0 - mean.numpy())
        np.testing.assert_array_equal(held.numpy(), x0)
        offset += size


def test_subtract_sparse_mean_refuses_indices_out_of_order():
    x = tf.Variable(tf.zeros([5]))
    with pytest.raises(tf.errors.InvalidArgumentError, match="indices must increase"):
        ops.subtract_sparse_mean(x, np.array([1, 3, 3], np.int32), np.ones(3, np.float32), 0, 2)
    np.testing.assert_array_equal(x.numpy(), np.zeros(5))  # refused before any write


def tf_share(values, w, parts, before=None):
    """The TensorFlow ops that PushSumShare replaces (hvd_compress/gossip.py's share before it)."""
    flat = [tf.reshape(tf.cast(v, tf.float32), [-1]) for v in values]
    if before is None:
        numerators = [z * w for z in flat]
    else:
        numerators = [z - (1.0 - w) * tf.reshape(z0, [-1]) for z, z0 in zip(flat, before)]
    x = tf.concat(numerators + [tf.reshape(w, [1])], 0)
    return x / float(parts)


@SETTINGS
@given(shapes=st.lists(st.sampled_from([(), (0,), (1,), (7,), (3, 5), (16385,), (2, ref.KCHUNK + 3)]), min_size=1,
                       max_size=5),
       stepped=st.booleans(), parts=st.sampled_from([2, 3]), w=st.sampled_from([1.0, 0.6666667, 0.37]),
       seed=st.integers(0, 2**16))
def test_push_sum_share_matches_numpy_and_the_tensorflow_ops(shapes, stepped, parts, w, seed):
    """SGP's share in one pass, bit for bit (signed zeros too) as NumPy's float32 and as the TensorFlow ops it
    replaced, run eagerly: [w z, w] / parts, or with the values before the step [z - (1 - w) b, w] / parts, over
    variables of any shape (a scalar, a matrix, parts crossing the chunk grid)."""
    rng = np.random.default_rng(seed)
    values = [sample(int(np.prod(s)), rng.integers(2**16)).numpy().reshape(s) for s in shapes]
    steps = [rng.standard_normal(v.shape).astype(np.float32) * np.float32(1e-2) for v in values]
    before = [v + u for v, u in zip(values, steps)] if stepped else None
    weight = np.float32(w)
    got = ops.push_sum_share([tf.constant(v) for v in values], weight, parts, before)
    want = ref.push_sum_share(values, weight, parts, before)
    assert got.dtype == tf.float32 and got.shape == [sum(v.size for v in values) + 1]
    np.testing.assert_array_equal(got.numpy().view(np.uint32), want.view(np.uint32))
    np.testing.assert_array_equal(got.numpy().view(np.uint32),
                                  tf_share(values, tf.constant(weight), parts, before).numpy().view(np.uint32))


def test_push_sum_share_in_a_tf_function_divides_and_knows_its_length():
    """In a tf.function the op gives its eager bits and a static length (the alltoall's splits need it). The
    TensorFlow ops' bits differ there by up to an ulp at 3 parts (Grappler makes x / 3.0 a product by
    float32(1 / 3)), and not at 2 (a product by 0.5 is the division)."""
    values = [tf.Variable(sample(5 * ref.KCHUNK + 1, 5)), tf.Variable(tf.ones([3, 4]))]
    before = [tf.constant(sample(5 * ref.KCHUNK + 1, 6)), tf.zeros([3, 4])]
    w = tf.constant(0.6666667)

    @tf.function
    def share(parts):
        result = ops.push_sum_share(values, w, parts, before)
        assert result.shape.as_list() == [5 * ref.KCHUNK + 1 + 12 + 1]
        return result, tf_share(values, w, parts, before)

    eager = ops.push_sum_share(values, w, 3, before).numpy()
    fused, by_tf_ops = share(3)
    np.testing.assert_array_equal(fused.numpy().view(np.uint32), eager.view(np.uint32))
    np.testing.assert_allclose(fused.numpy(), by_tf_ops.numpy(), rtol=2 ** -22, atol=0)
    fused, by_tf_ops = share(2)
    np.testing.assert_array_equal(fused.numpy().view(np.uint32), by_tf_ops.numpy().view(np.uint32))
    with pytest.raises(ValueError, match="must be equal, but are 4 and 5"):  # the shape function checks as the kernel
        tf.function(lambda: ops.push_sum_share([tf.ones([4])], 1.0, 2, before=[tf.ones([5])]))()
