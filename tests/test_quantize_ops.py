"""The blockwise low-bit quantizer's ops (hvd_compress/quantize_ops.py) against the NumPy reference
(bit-exact), and what the format in tf_ops/quantize_ops.cc promises."""
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import np_reference as ref
from hvd_compress import ops
from hvd_compress import quantize_ops as qops

K = ref.KCHUNK
# Fused layouts (tensor sizes, block size): small odd ones with any block size, and ones around the
# kernels' chunk grid, with blocks inside a chunk, blocks that cross it and blocks that start mid-byte.
SMALL_LAYOUTS = st.tuples(st.lists(st.integers(0, 150), min_size=1, max_size=3),
                          st.one_of(st.none(), st.integers(1, 40), st.just(256)))
LARGE_SIZES = st.tuples(st.sampled_from([0, 3, 13]), st.sampled_from([K - 1, K, K + 1, 2 * K + 9])).map(list)
LARGE_LAYOUTS = st.tuples(LARGE_SIZES, st.sampled_from([None, 97, 1000, K + 3]))
LAYOUTS = st.one_of(SMALL_LAYOUTS, LARGE_LAYOUTS)
BITS = st.sampled_from(qops.QUANTIZE_BITS)
SEEDS = st.tuples(st.integers(-2**63, 2**63 - 1), st.integers(-2**63, 2**63 - 1))
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def sample(n, seed):
    """Gaussian values of a random magnitude with exact zeros, negative zeros and repeats sprinkled in."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * 10.0 ** rng.uniform(-3, 3)).astype(np.float32)
    x[rng.random(n) < 0.05] = 0.0
    x[rng.random(n) < 0.05] = -0.0
    if n:
        x[rng.random(n) < 0.05] = x[0]
    return x


def assert_bits_equal(got, want):
    """Bit for bit, signed zeros too; NaN where want has NaN, whatever its sign bit."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(got[~np.isnan(got)].view(np.uint32), want[~np.isnan(want)].view(np.uint32))


def decode(packed, scales, offsets, bounds, bits):
    """The op's plain decode (a mean of one payload)."""
    return qops.block_quantize_decode_mean(packed[None], scales[None], offsets[None], bounds, bits).numpy()


@SETTINGS
@given(layout=LAYOUTS, bits=BITS, stochastic=st.booleans(), seed=SEEDS, data_seed=st.integers(0, 2**16))
def test_compress_matches_numpy_bit_exact(layout, bits, stochastic, seed, data_seed):
    sizes, block_size = layout
    bounds = ops.layout_bounds(sizes, block_size)
    x = sample(sum(sizes), data_seed)
    got = qops.block_quantize_compress(tf.constant(x), bounds, bits, stochastic, seed)
    want = ref.block_quantize_compress(x, bounds, bits, stochastic, seed)
    np.testing.assert_array_equal(got[0].numpy(), want[0])  # packed, padding bits included
    for g, w in zip(got[1:], want[1:]):  # scales, offsets, residual
        assert_bits_equal(g.numpy(), w)
    np.testing.assert_array_equal(qops.block_quantize(tf.constant(x), bounds, bits, stochastic, seed)[0], want[0])


@SETTINGS
@given(layout=LAYOUTS, bits=BITS, stochastic=st.booleans(), seed=SEEDS, data_seed=st.integers(0, 2**16),
       pluses=st.lists(st.booleans(), min_size=3, max_size=3))
def test_compress_of_parts_plus_residuals_matches_numpy_bit_exact(layout, bits, stochastic, seed, data_seed, pluses):
    """The parts of a bucket where they lie, each with its error-feedback residual or none added on the way: the
    code of their concatenated sum, bit for bit, and each part's residual."""
    sizes, block_size = layout
    bounds = ops.layout_bounds(sizes, block_size)
    xs = [sample(size, data_seed + k) for k, size in enumerate(sizes)]
    es = [sample(size, data_seed + 50 + k) if pluses[k] else None for k, size in enumerate(sizes)]
    summed = np.concatenate([x if e is None else x + e for x, e in zip(xs, es)])
    want = ref.block_quantize_compress(summed, bounds, bits, stochastic, seed)
    got = qops.block_quantize_compress([tf.constant(x) for x in xs], bounds, bits, stochastic, seed,
                                       plus=[None if e is None else tf.constant(e) for e in es])
    np.testing.assert_array_equal(got[0].numpy(), want[0])
    for g, w in zip(got[1:3], want[1:3]):
        assert_bits_equal(g.numpy(), w)
    assert [r.shape.as_list() for r in got[3]] == [[size] for size in sizes]
    assert_bits_equal(np.concatenate([r.numpy() for r in got[3]]), want[3])


@SETTINGS
@given(layout=LAYOUTS, bits=BITS, ranks=st.integers(1, 5), data_seed=st.integers(0, 2**16), plus=st.booleans())
def test_decode_mean_matches_numpy_bit_exact(layout, bits, ranks, data_seed, plus):
    sizes, block_size = layout
    n = sum(sizes)
    bounds = ops.layout_bounds(sizes, block_size)
    payloads = [qops.block_quantize(sample(n, data_seed + r), bounds, bits, r % 2 == 1, (r, data_seed))
                for r in range(ranks)]
    packed, scales, offsets = (tf.stack([p[j] for p in payloads]) for j in range(3))
    extra = sample(n, data_seed + 100) if plus else None
    want = ref.block_quantize_decode_mean(packed.numpy(), scales.numpy(), offsets.numpy(), bounds, bits, extra)
    assert_bits_equal(qops.block_quantize_decode_mean(packed, scales, offsets, bounds, bits, extra).numpy(), want)
    flat = [tf.reshape(t, [-1]) for t in (packed, scales, offsets)]  # as hvd.allgather returns them
    assert_bits_equal(qops.block_quantize_decode_mean(*flat, bounds, bits, extra).numpy(), want)


@SETTINGS
@given(layout=LAYOUTS, bits=BITS, ranks=st.integers(1, 5), stochastic=st.booleans(), seed=SEEDS,
       data_seed=st.integers(0, 2**16), plus=st.booleans())
def test_recode_mean_is_compress_of_decode_mean_bit_exact(layout, bits, ranks, stochastic, seed, data_seed, plus):
    """The server's fused step: NumPy's compress of NumPy's decoded mean (+ plus), bit for bit, for blocks inside
    a chunk and blocks across the chunk grid; the residual in plus's buffer."""
    sizes, block_size = layout
    n = sum(sizes)
    bounds = ops.layout_bounds(sizes, block_size)
    payloads = [qops.block_quantize(sample(n, data_seed + r), bounds, bits, r % 2 == 1, (r, data_seed))
                for r in range(ranks)]
    packed, scales, offsets = (tf.stack([p[j] for p in payloads]) for j in range(3))
    extra = sample(n, data_seed + 100) if plus else None
    mean = ref.block_quantize_decode_mean(packed.numpy(), scales.numpy(), offsets.numpy(), bounds, bits, extra)
    want = ref.block_quantize_compress(mean, bounds, bits, stochastic, seed)
    flat = [tf.reshape(t, [-1]) for t in (packed, scales, offsets)]  # as hvd.allgather returns them
    got = qops.block_quantize_recode_mean(*flat, bounds, bits, extra, stochastic, seed)
    np.testing.assert_array_equal(got[0].numpy(), want[0])  # packed, padding bits included
    for g, w in zip(got[1:], want[1:]):  # scales, offsets, residual
        assert_bits_equal(g.numpy(), w)


@pytest.mark.parametrize("bits", [4, 8])
def test_a_decoded_mean_past_the_caches_is_streamed_with_numpys_bits(bits):
    """A decoded mean of 32 MB or more is written with streaming stores where a vector loop writes whole aligned
    vectors, the rest as before: a part that starts mid-vector (its first elements one at a time), a tail, a plus."""
    sizes = [3, 8 << 20, 1000]
    n = sum(sizes)
    bounds = ops.layout_bounds(sizes, 256)
    payloads = [qops.block_quantize(sample(n, r), bounds, bits, True, (r, 11)) for r in range(3)]
    packed, scales, offsets = (tf.stack([p[j] for p in payloads]) for j in range(3))
    extra = sample(n, 100)
    want = ref.block_quantize_decode_mean(packed.numpy(), scales.numpy(), offsets.numpy(), bounds, bits, extra)
    assert_bits_equal(qops.block_quantize_decode_mean(packed, scales, offsets, bounds, bits, extra).numpy(), want)


@pytest.mark.parametrize("ranks", [8, 16, 17])
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_decode_mean_of_many_payloads_matches_numpy_bit_exact(bits, ranks):
    """The vector loop keeps up to 16 payloads' scales in registers and multiplies by 1 / m where m is a power of
    two; 17 payloads take the other loop. Every count gives NumPy's bits."""
    sizes, n = [1000, 37, 4096], 5133
    bounds = ops.layout_bounds(sizes, 256)
    payloads = [qops.block_quantize(sample(n, r), bounds, bits, True, (r, 7)) for r in range(ranks)]
    packed, scales, offsets = (tf.stack([p[j] for p in payloads]) for j in range(3))
    want = ref.block_quantize_decode_mean(packed.numpy(), scales.numpy(), offsets.numpy(), bounds, bits)
    assert_bits_equal(qops.block_quantize_decode_mean(packed, scales, offsets, bounds, bits).numpy(), want)


@SETTINGS
@given(layout=LAYOUTS, bits=BITS, stochastic=st.booleans(), data_seed=st.integers(0, 2**16))
def test_residual_is_x_less_decode_and_errors_are_bounded(layout, bits, stochastic, data_seed):
    """Per element |x - decode| <= scale / 2 rounding to nearest (< scale stochastically), plus the
    float32 roundings of the code and the decode; a block's min decodes exactly (code 0); its max
    has code L to nearest, and decodes within a few ulps (lo + L * ((hi - lo) / L) is rounded)."""
    sizes, block_size = layout
    bounds = ops.layout_bounds(sizes, block_size)
    x = sample(sum(sizes), data_seed)
    packed, scales, offsets, residual = (t.numpy() for t in qops.block_quantize_compress(
        tf.constant(x), bounds, bits, stochastic, (7, data_seed)))
    y = decode(packed, scales, offsets, bounds, bits)
    assert_bits_equal(residual, x - y)
    counts = np.diff(bounds)
    scale, lo = np.repeat(scales, counts), np.repeat(offsets, counts)
    magnitude = np.maximum(np.abs(lo), np.abs(lo + scale * np.float32(2**bits - 1)))
    slack = scale * np.float32(1e-4) + 2 * np.spacing(magnitude)
    np.testing.assert_array_less(np.abs(residual), (scale if stochastic else scale / 2) + slack)
    codes = ref.unpack_codes(packed, x.size, bits)
    for b in range(len(counts)):
        block, block_y, block_codes = (a[bounds[b]:bounds[b + 1]] for a in (x, y, codes))
        assert np.all(block_y[block == block.min()] == block.min())
        assert np.all(block_codes[block == block.min()] == 0)
        top = block == block.max()
        if not stochastic and block.max() > block.min():  # (a draw within ~L * 2^-23 of 1 may round it down)
            assert np.all(block_codes[top] == 2**bits - 1)
            range_ulps = np.spacing(np.float32(block.max() - block.min()))
            assert np.all(np.abs(block_y[top] - block.max()) <= 2 * range_ulps + np.spacing(abs(block.max())))


@pytest.mark.parametrize("bits", qops.QUANTIZE_BITS)
def test_stochastic_rounding_is_unbiased(bits):
    """The mean decode over D counters is x within 5 standard errors, sqrt(scale^2 / 4 / D) (a code's
    variance is at most scale^2 / 4); rounding to nearest, off the grid, fails that bound."""
    draws = 2000
    steps = np.float32(2**bits - 1)
    # Grid 0, 1, ..., L (scale 1, exactly representable), every fraction of a step, min and max.
    x = np.concatenate([[0.0, steps], np.linspace(0, steps, 61)[1:-1] + 0.37, np.linspace(0, 1, 11)])
    x = np.minimum(x, steps).astype(np.float32)
    bounds = [0, x.size]
    payloads = [qops.block_quantize(x, bounds, bits, True, (42, counter)) for counter in range(draws)]
    assert all(p[1].numpy()[0] == 1 and p[2].numpy()[0] == 0 for p in payloads[:3])
    packed, scales, offsets = (tf.stack([p[j] for p in payloads]) for j in range(3))
    mean = qops.block_quantize_decode_mean(packed, scales, offsets, bounds, bits).numpy()
    bound = 5 * np.sqrt(0.25 / draws)
    np.testing.assert_array_less(np.abs(mean - x), bound)
    on_grid = x == np.round(x)
    codes = ref.unpack_codes(packed.numpy().reshape(-1), draws * x.size, bits).reshape(draws, -1)
    assert np.all(codes[:, on_grid] == x[on_grid])  # exact where x is on the grid
    assert np.all(codes[:, ~on_grid].min(0) == np.floor(x[~on_grid]))  # else both neighbours come up
    assert np.all(codes[:, ~on_grid].max(0) == np.ceil(x[~on_grid]))
    # The control: rounding to nearest is biased where x is off the grid, beyond the bound.
    nearest = qops.block_quantize_compress(x, bounds, bits)[3].numpy()  # the residual, x - decode
    assert np.abs(nearest[~on_grid]).max() > 2 * bound
    assert np.mean(np.abs(nearest[~on_grid]) > bound) > 0.8


def test_stochastic_draws_repeat_with_the_seed_only():
    x = sample(3 * K + 5, 1)
    bounds = ops.layout_bounds(x.size, 1000)
    packed = lambda seed: qops.block_quantize(x, bounds, 4, True, seed)[0].numpy()  # noqa: E731
    first = packed((3, 9))
    np.testing.assert_array_equal(packed((3, 9)), first)
    np.testing.assert_array_equal(packed(tf.constant([3, 9], tf.int64)), first)
    for other in [(3, 10), (4, 9), (9, 3)]:
        assert np.mean(packed(other) != first) > 0.5
    # The draws themselves are uniform on [0, 1) and independent of the counter's neighbours.
    u = ref.quantize_uniforms((3, 9), 100_000)
    assert 0 <= u.min() and u.max() < 1 and abs(u.mean() - 0.5) < 0.005
    assert abs(np.corrcoef(u, ref.quantize_uniforms((3, 10), u.size))[0, 1]) < 0.02
    assert abs(np.corrcoef(u[:-1], u[1:])[0, 1]) < 0.02  # neighbouring elements
    assert abs(np.corrcoef(u[:-8], u[8:])[0, 1]) < 0.02  # the two halves of one hash
    counts = np.bincount((u * 64).astype(int), minlength=64)  # 64 bins of ~1562 +- 39
    assert np.all(np.abs(counts - u.size / 64) < 5 * np.sqrt(u.size / 64))


@pytest.mark.parametrize("bits", qops.QUANTIZE_BITS)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, "overflow"])
@pytest.mark.parametrize("stochastic", [False, True])
def test_non_finite_block_decodes_to_nan_alone(bits, bad, stochastic):
    x = np.linspace(-1, 1, 64, dtype=np.float32)
    if bad == "overflow":  # finite values, but max - min overflows float32
        x[40], x[41] = 3e38, -3e38
    else:
        x[40] = bad
    bounds = ops.layout_bounds(64, 16)
    packed, scales, offsets, residual = qops.block_quantize_compress(x, bounds, bits, stochastic, (1, 2))
    assert np.isnan(scales.numpy()[2]) and np.isnan(offsets.numpy()[2])
    assert np.all(ref.unpack_codes(packed.numpy(), 64, bits)[32:48] == 0)
    y = decode(packed, scales, offsets, bounds, bits)
    assert np.all(np.isnan(y[32:48])) and np.all(np.isnan(residual.numpy()[32:48]))
    keep = np.r_[0:32, 48:64]  # the other blocks: as if the bad one were not there
    clean = np.where(np.arange(64) // 16 == 2, np.float32(0), x)
    alone = decode(*qops.block_quantize(clean, bounds, bits, stochastic, (1, 2)), bounds, bits)
    assert_bits_equal(y[keep], alone[keep])
    assert np.all(np.isfinite(y[keep]))
    assert_bits_equal(residual.numpy()[keep], x[keep] - y[keep])


@pytest.mark.parametrize("bits", qops.QUANTIZE_BITS)
@pytest.mark.parametrize("stochastic", [False, True])
def test_constant_and_zero_blocks_decode_exactly(bits, stochastic):
    blocks = [np.zeros(9), -np.zeros(7), np.full(17, 3.7), np.full(8, -1e30), [2.5], [-0.0], np.full(5, 1e-30)]
    x = np.concatenate(blocks).astype(np.float32)
    bounds = ops.layout_bounds([len(b) for b in blocks])
    packed, scales, offsets, residual = qops.block_quantize_compress(x, bounds, bits, stochastic, (5, 6))
    np.testing.assert_array_equal(scales.numpy(), 0)
    np.testing.assert_array_equal(decode(packed, scales, offsets, bounds, bits), x)
    np.testing.assert_array_equal(residual.numpy(), 0)
    np.testing.assert_array_equal(packed.numpy(), 0)


def test_codes_are_packed_lsb_first_with_zero_padding():
    x = tf.constant([0.0, 1.0, 2.0, 3.0, 3.0, 2.0])  # scale 1 at 2 bits: the codes are x
    packed, scales, offsets, _ = qops.block_quantize_compress(x, [0, 6], 2)
    assert packed.numpy().tolist() == [0b11100100, 0b1011]
    assert scales.numpy().tolist() == [1.0] and offsets.numpy().tolist() == [0.0]
    assert qops.block_quantize(tf.constant([0.0, 15.0, 15.0]), [0, 3], 4)[0].numpy().tolist() == [0xF0, 0xF]
    assert qops.packed_size(6, 2) == 2 and qops.packed_size(3, 4) == 2 and qops.packed_size(5, 8) == 5


def test_shapes_are_inferred_when_traced():
    bounds = tf.constant(ops.layout_bounds(37, 8))

    @tf.function(input_signature=[tf.TensorSpec([37], tf.float32)])
    def compress(x):
        outputs = qops.block_quantize_compress(x, bounds, 4, True, (1, 2))
        assert [o.shape.as_list() for o in outputs] == [[19], [5], [5], [37]]
        y = qops.block_quantize_decode_mean(tf.stack([outputs[0]] * 3), tf.stack([outputs[1]] * 3),
                                            tf.stack([outputs[2]] * 3), bounds, 4)
        assert y.shape.as_list() == [37]
        recoded = qops.block_quantize_recode_mean(*(tf.stack([o] * 3) for o in outputs[:3]), bounds, 4, x, True,
                                                  (3, 4))
        assert [o.shape.as_list() for o in recoded] == [[19], [5], [5], [37]]
        return y

    x = sample(37, 3)
    packed, scales, offsets, _ = ref.block_quantize_compress(x, bounds.numpy(), 4, True, (1, 2))
    want = ref.block_quantize_decode_mean([packed] * 3, [scales] * 3, [offsets] * 3, bounds.numpy(), 4)
    assert_bits_equal(compress(x).numpy(), want)


@pytest.mark.parametrize("call, error, match", [
    (lambda: qops.block_quantize_compress(tf.ones([4]), [0, 4], 3), ValueError, "bits must be 2, 4 or 8 .*got 3"),
    (lambda: qops.block_quantize_compress(tf.ones([4]), [0, 4], True), ValueError, "bits must be 2, 4 or 8"),
    (lambda: qops.block_quantize_compress(tf.ones([4], tf.float16), [0, 4], 4), TypeError,
     "quantizes float32 tensors, got float16"),
    (lambda: qops.block_quantize_compress(tf.ones([4]), [0, 4], 4, stochastic=True), ValueError,
     "stochastic rounding needs a seed"),
    (lambda: qops.block_quantize_compress(tf.ones([4]), [0, 3], 4), tf.errors.InvalidArgumentError, "n=4"),
    (lambda: qops.block_quantize_compress(tf.ones([4]), [0, 2, 2, 4], 4), tf.errors.InvalidArgumentError,
     "strictly increasing"),
    (lambda: ops.library().block_quantize_compress([tf.ones([4])], [tf.zeros([0])], [0, 4], tf.zeros([3], tf.int64),
                                                   bits=4),
     tf.errors.InvalidArgumentError, r"seed must be an int64 vector \[key, counter\], got shape \[3\]"),
    (lambda: ops.library().block_quantize_compress([tf.ones([4])], [tf.zeros([0])], [0, 4], tf.zeros([2], tf.int64),
                                                   bits=3),
     tf.errors.InvalidArgumentError, "bits must be 2, 4 or 8, got 3"),
    (lambda: qops.block_quantize_compress([tf.ones([4]), tf.ones([3])], [0, 7], 4), tf.errors.InvalidArgumentError,
     "xs.1. starts at element 4, inside a block: every part must start at one of the bounds"),
    (lambda: qops.block_quantize_compress([tf.ones([4]), tf.ones([3])], [0, 4, 7], 4, plus=[None, tf.ones([2])]),
     tf.errors.InvalidArgumentError, r"pluses\[1\] must have the 3 elements of xs\[1\], or none"),
    (lambda: qops.block_quantize_compress([tf.ones([4]), tf.ones([3])], [0, 4, 7], 4, plus=[None]), ValueError,
     "plus must have one tensor .or None. per part of x: 2 parts, 1 pluses"),
    (lambda: qops.block_quantize_decode_mean(tf.zeros([1, 3], tf.uint8), tf.ones([1, 1]), tf.ones([1, 1]), [0, 9], 4),
     tf.errors.InvalidArgumentError, r"payload does not match bounds: expected packed \[1, 5\]"),
    (lambda: qops.block_quantize_decode_mean(tf.zeros([1, 5], tf.uint8), tf.ones([1, 2]), tf.ones([1, 2]), [0, 9], 4),
     tf.errors.InvalidArgumentError, "payload does not match bounds"),
    (lambda: qops.block_quantize_decode_mean(tf.zeros([1, 5], tf.uint8), tf.ones([1, 1]), tf.ones([1, 1]), [0, 9], 4,
                                             plus=tf.ones([8])), tf.errors.InvalidArgumentError, "plus must have n=9"),
    (lambda: qops.block_quantize_decode_mean(tf.zeros([0, 5], tf.uint8), tf.ones([0, 1]), tf.ones([0, 1]), [0, 9], 4),
     tf.errors.InvalidArgumentError, "at least one payload"),
    (lambda: qops.block_quantize_recode_mean(tf.zeros([1, 5], tf.uint8), tf.ones([1, 1]), tf.ones([1, 1]), [0, 9], 4,
                                             stochastic=True), ValueError, "stochastic rounding needs a seed"),
    (lambda: ops.library().block_quantize_recode_mean(tf.zeros([1, 5], tf.uint8), tf.ones([1, 1]), tf.ones([1, 1]),
                                                      [0, 9], tf.zeros([0]), tf.zeros([1], tf.int64), bits=4),
     tf.errors.InvalidArgumentError, r"seed must be an int64 vector"),
    (lambda: qops.block_quantize_recode_mean(tf.zeros([1, 3], tf.uint8), tf.ones([1, 1]), tf.ones([1, 1]), [0, 9], 4),
     tf.errors.InvalidArgumentError, r"payload does not match bounds: expected packed \[1, 5\]"),
])
def test_bad_input_gets_a_clear_error(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_results_do_not_depend_on_thread_count(tmp_path):
    """The fixed chunk grid makes a 1-thread process give the same bytes as this one."""
    script = tmp_path / "one_thread.py"
    script.write_text(
        "import sys, numpy as np, tensorflow as tf\n"
        "tf.config.threading.set_intra_op_parallelism_threads(1)\n"
        "from hvd_compress import ops, quantize_ops as q\n"
        "x = np.random.default_rng(3).standard_normal(5 * 16384 + 11).astype(np.float32)\n"
        "bounds = ops.layout_bounds([100, x.size - 100], 7000)\n"
        "p, s, o, r = q.block_quantize_compress(x, bounds, 2, True, (1, 2))\n"
        "y = q.block_quantize_decode_mean(tf.stack([p, p]), tf.stack([s, s]), tf.stack([o, o]), bounds, 2, x)\n"
        "z = q.block_quantize_recode_mean(tf.stack([p, p]), tf.stack([s, s]), tf.stack([o, o]), bounds, 2, x, True,\n"
        "                                 (3, 4))\n"
        "np.savez(sys.argv[1], p=p.numpy(), r=r.numpy(), y=y.numpy(), zp=z[0].numpy(), zr=z[3].numpy())\n")
    subprocess.run([sys.executable, str(script), str(tmp_path / "one.npz")], check=True, timeout=120)
    one_thread = np.load(tmp_path / "one.npz")
    x = np.random.default_rng(3).standard_normal(5 * K + 11).astype(np.float32)
    bounds = ops.layout_bounds([100, x.size - 100], 7000)
    p, s, o, r = qops.block_quantize_compress(x, bounds, 2, True, (1, 2))
    y = qops.block_quantize_decode_mean(tf.stack([p, p]), tf.stack([s, s]), tf.stack([o, o]), bounds, 2, x)
    z = qops.block_quantize_recode_mean(tf.stack([p, p]), tf.stack([s, s]), tf.stack([o, o]), bounds, 2, x, True,
                                        (3, 4))
    np.testing.assert_array_equal(one_thread["zp"], z[0].numpy())
    assert_bits_equal(one_thread["zr"], z[3].numpy())
    np.testing.assert_array_equal(one_thread["p"], p.numpy())
    assert_bits_equal(one_thread["r"], r.numpy())
    assert_bits_equal(one_thread["y"], y.numpy())


@pytest.mark.skipif("avx512bw" not in open("/proc/cpuinfo").read(), reason="the CPU has no AVX-512: one coder only")
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_the_avx512_and_avx2_coders_give_the_same_bits(tmp_path, bits):
    """Where the CPU has AVX-512, stochastic coding runs 16 elements at a time; HVD_COMPRESS_AVX512=0 keeps the AVX2
    coder. Both give NumPy's bits."""
    script = tmp_path / "avx2.py"
    script.write_text(
        "import sys, numpy as np, tensorflow as tf\n"
        "from hvd_compress import ops, quantize_ops as q\n"
        "x = np.random.default_rng(4).standard_normal(3 * 16384 + 21).astype(np.float32)\n"
        "bounds = ops.layout_bounds([100, x.size - 100], 256)\n"
        f"p, s, o, r = q.block_quantize_compress(x, bounds, {bits}, True, (5, 6))\n"
        "np.savez(sys.argv[1], p=p.numpy(), s=s.numpy(), r=r.numpy())\n")
    env = {**os.environ, "HVD_COMPRESS_AVX512": "0"}
    subprocess.run([sys.executable, str(script), str(tmp_path / "avx2.npz")], check=True, timeout=120, env=env)
    avx2 = np.load(tmp_path / "avx2.npz")
    x = np.random.default_rng(4).standard_normal(3 * K + 21).astype(np.float32)
    bounds = ops.layout_bounds([100, x.size - 100], 256)
    got = [t.numpy() for t in qops.block_quantize_compress(x, bounds, bits, True, (5, 6))]
    want = ref.block_quantize_compress(x, bounds, bits, True, (5, 6))
    np.testing.assert_array_equal(got[0], want[0])
    assert_bits_equal(got[3], want[3])
    np.testing.assert_array_equal(avx2["p"], got[0])
    assert_bits_equal(avx2["s"], got[1])
    assert_bits_equal(avx2["r"], got[3])
