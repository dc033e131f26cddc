"""The compiled TensorFlow ops (tf_ops/) and thin Python wrappers around them.

The library hvd_compress/_tf_ops-tf<version>.so is loaded once, on first use. If it is
missing, cannot be loaded, or was compiled against another TensorFlow than
the one imported, an `OpsLibraryError` says how to rebuild it.

Blocks. The sign ops cut a flat tensor of n elements into blocks described by
`bounds`, an int64 vector [0 = b_0 < b_1 < ... < b_B = n]. `block_bounds`
builds it from a block size (one block per tensor by default) or from the
sizes of the tensors fused into one buffer, so each tensor keeps its own
scale. Bounds are a function of the layout only and are never sent.
"""
import functools
import pathlib

import numpy as np
import tensorflow as tf

LIBRARY_PATH = pathlib.Path(__file__).with_name(f"_tf_ops-tf{tf.__version__}.so")
REBUILD_HINT = (
    "Rebuild it for the installed TensorFlow: from the hvd_compress checkout run "
    "`make setup` (or `pip install --no-build-isolation -e .`)."
)
FLOAT_DTYPES = (tf.float32, tf.float16, tf.bfloat16)
_OP_NAMES = ("BlockSignPack", "BlockSignCompress", "BlockSignUnpack", "BlockSignUnpackMean", "TopKAbs",
             "ScatterDense", "CountSketch", "CountSketchQuery", "HalfPack", "HalfMean", "HalfUnpack",
             "ZeroAt", "GatherAt", "ScatterMean", "MomentumErrorFeed", "AdamMomentumFeed", "AdamFrozenStep",
             "ResourceDecayAndSubtract", "ResourceSubtractBlockSignMean",
             "PushSumShare", "HvdCompressBuildInfo")


for _name in _OP_NAMES:  # the ops compute encodings, never gradients
    tf.no_gradient(_name)


class OpsLibraryError(ImportError):
    """The compiled ops library is missing or does not match TensorFlow."""


@functools.lru_cache(maxsize=None)
def library():
    """The loaded op library (loaded and checked once per process)."""
    if not LIBRARY_PATH.exists():
        raise OpsLibraryError(
            f"hvd_compress's compiled ops are missing: {LIBRARY_PATH} does not exist. {REBUILD_HINT}")
    try:
        lib = tf.load_op_library(str(LIBRARY_PATH))
    except tf.errors.NotFoundError as exc:
        raise OpsLibraryError(
            f"{LIBRARY_PATH} could not be loaded into TensorFlow {tf.__version__} ({exc}); it was "
            f"probably built for another TensorFlow. {REBUILD_HINT}") from exc
    with tf.init_scope():
        if tf.executing_eagerly():
            built_for = lib.hvd_compress_build_info().numpy().decode()
            if built_for != tf.__version__:
                raise OpsLibraryError(
                    f"{LIBRARY_PATH} was built for TensorFlow {built_for}, but TensorFlow "
                    f"{tf.__version__} is imported. {REBUILD_HINT}")
    return lib


def check_float(tensor, name):
    """Raises TypeError unless `tensor` is float32, float16 or bfloat16."""
    if tensor.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{name} must be float32, float16 or bfloat16, got {tensor.dtype.name}. Cast it to a "
            "float type, or leave integer tensors out of compression.")


def check_block_size(block_size):
    """Returns block_size after checking it is None or a positive integer."""
    if block_size is None:
        return None
    if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)) or block_size <= 0:
        raise ValueError(
            f"block_size must be a positive integer, or None for one block per tensor; got "
            f"{block_size!r}.")
    return int(block_size)


def layout_bounds(sizes, block_size=None):
    """Block boundaries (NumPy int64 [B + 1]) of tensors of these sizes fused in order.

    block_size=None gives one block per tensor, else each tensor is cut into
    blocks of block_size elements (its last block may be shorter). Zero-size
    tensors have no blocks.
    """
    block_size = check_block_size(block_size)
    sizes = [int(sizes)] if np.ndim(sizes) == 0 else [int(s) for s in sizes]
    if any(s < 0 for s in sizes):
        raise ValueError(f"sizes must be non-negative, got {sizes}.")
    starts, offset = [], 0
    for size in sizes:
        if size:
            starts.extend(range(offset, offset + size, size if block_size is None else block_size))
        offset += size
    return np.array(starts + [offset], dtype=np.int64)


def block_bounds(sizes, block_size=None):
    """Block boundaries as an int64 tensor [B + 1].

    sizes: the number of elements n (a Python int or a scalar tensor), or a
      list of the sizes of the tensors fused into one buffer (see layout_bounds).
    block_size: None for one block per tensor, else blocks of block_size elements.
    """
    if not tf.is_tensor(sizes):
        return tf.constant(layout_bounds(sizes, block_size))
    block_size = check_block_size(block_size)
    n = tf.cast(sizes, tf.int64)
    if block_size is None:
        starts = tf.zeros([tf.minimum(n, 1)], tf.int64)
    else:
        starts = tf.range(0, n, block_size, dtype=tf.int64)
    return tf.concat([starts, tf.reshape(n, [1])], axis=0)


def _tensors(x):
    """The ops that read several tensors as one take a tensor or a list of them: always a list."""
    return list(x) if isinstance(x, (list, tuple)) else [x]


def _bounds(n, block_size, bounds):
    return block_bounds(n, block_size) if bounds is None else tf.convert_to_tensor(bounds, tf.int64)


def _static_size(x):
    size = x.shape.num_elements()
    return size if size is not None else tf.size(x, out_type=tf.int64)


def block_sign_pack(x, block_size=None, bounds=None):
    """Blockwise 1-bit compression of x (flattened).

    Returns (bits uint8[ceil(n/8)], scales float32[B]): bit i set when x[i] < 0
    (LSB-first, so sign(0) = +1), scales[b] = mean |x| over block b. A NaN or
    Inf in a block makes its scale non-finite. Pass `bounds` (from
    `block_bounds`) instead of block_size for a fused multi-tensor layout.
    """
    x = tf.convert_to_tensor(x)
    check_float(x, "x")
    return library().block_sign_pack(x, _bounds(_static_size(x), block_size, bounds))


def block_sign_compress(x, block_size=None, bounds=None):
    """block_sign_pack of float32 x [n] and the error-feedback residual x - C(x) in one op:
    (bits, scales, residual), the residual exactly x - block_sign_unpack(bits, scales) (a NaN's sign
    bit aside), written in x's buffer when nothing else holds it."""
    x = tf.convert_to_tensor(x)
    return library().block_sign_compress(x, _bounds(_static_size(x), block_size, bounds))


def block_sign_unpack(bits, scales, n, block_size=None, bounds=None, dtype=tf.float32):
    """Decodes one payload of `block_sign_pack` into dtype[n]: +-scale per element."""
    result = library().block_sign_unpack(bits, scales, _bounds(n, block_size, bounds), T=dtype)
    return _with_static_length(result, n)


def block_sign_unpack_mean(bits, scales, n, block_size=None, bounds=None, dtype=tf.float32, plus=None):
    """Mean of m payloads decoded in one pass, dtype[n].

    bits: uint8[m, ceil(n/8)] and scales: float32[m, B], or the same stacked
    flat, as `hvd.allgather` returns them. Summed in float32 in payload order,
    then divided by m; never materializes m dense tensors. plus (float32 [n]):
    added to the mean in the same pass, as a separate float32 add would.
    """
    bounds = _bounds(n, block_size, bounds)
    num_blocks = tf.size(bounds, out_type=tf.int64) - 1
    scales = tf.reshape(scales, [-1, num_blocks]) if scales.shape.rank == 1 else scales
    if bits.shape.rank == 1:
        bits = tf.reshape(bits, tf.stack([tf.shape(scales, out_type=tf.int64)[0], -1]))
    result = library().block_sign_unpack_mean(bits, scales, bounds, [] if plus is None else [plus], T=dtype)
    return _with_static_length(result, n)


def subtract_block_sign_mean(variable, bits, scales, bounds, offset=0):
    """variable -= elements [offset, offset + variable's size) of block_sign_unpack_mean(bits, scales,
    bounds=bounds), in place: the bits of that decode and `variable.assign_sub`, in one pass over
    the variable instead of four streams (a decode and assign_sub's read, read and write).

    variable: a float32 resource variable, read as a flat vector; bits uint8[m, ceil(n/8)] and
    scales float32[m, B] are m stacked payloads of the n = bounds[-1] elements (m = 1: one
    payload, its +-scale as block_sign_unpack decodes it, but for a block whose scale rounded
    to 0, whose -0 comes out +0). Returns the op (no output).
    """
    if tf.as_dtype(variable.dtype) != tf.float32:
        raise TypeError(f"subtract_block_sign_mean updates float32 variables only, got {tf.as_dtype(variable.dtype).name}; "
                        "decode with block_sign_unpack_mean and use assign_sub for other dtypes.")
    return library().resource_subtract_block_sign_mean(variable.handle, bits, scales, bounds,
                                                       tf.cast(offset, tf.int64))


def _with_static_length(result, n):
    if isinstance(n, (int, np.integer)):
        result.set_shape([int(n)])
    return result


def top_k_abs(x, k):
    """The k entries of x (flattened) with the largest |x|; x may be a list of tensors of one dtype,
    read in place as if flattened and concatenated (no concatenation is made).

    Returns (values, int32 indices) in increasing index order; among equal
    magnitudes the lower index wins and NaN counts as the largest magnitude.
    """
    xs = [tf.convert_to_tensor(t) for t in _tensors(x)]
    for t in xs:
        check_float(t, "x")
    sizes = [t.shape.num_elements() for t in xs]
    n = None if None in sizes else sum(sizes)
    if isinstance(k, (int, np.integer)) and not (0 <= k and (n is None or k <= n)):
        raise ValueError(
            f"k must be between 0 and the number of elements of the tensor ({n}), got k={k}. "
            "Lower k or the top-k ratio.")
    return library().top_k_abs(xs, tf.cast(k, tf.int32))


def momentum_error_feed(g, m, e, learning_rate, momentum, nesterov, residual_scale=1.0):
    """Error feedback with momentum in front of the compressor, in one pass over float32 g, m, e:
    m_new = momentum * m + g; p = momentum * m_new + g if nesterov else m_new;
    a = lr * p + residual_scale * e (the scale: lr over the previous step's lr, 1 when it did not change).
    learning_rate, momentum and residual_scale are float32 scalars (numbers or tensors), nesterov a
    Python bool. Returns (m_new, a), each product and sum rounded as TensorFlow's own ops would round it."""
    return library().momentum_error_feed(g, m, e, tf.cast(learning_rate, tf.float32), tf.cast(momentum, tf.float32),
                                         tf.cast(residual_scale, tf.float32), nesterov=bool(nesterov))


def adam_momentum_feed(g, m, v, e, beta_1, epsilon, bound=float("inf")):
    """The worker's side of 1-bit Adam after its warm-up, in one pass over float32 g, m, v (v frozen) and e:
    a = clip((m + (g - m) * (1 - beta_1)) / (sqrt(v) + epsilon), -bound, bound) + e, rounded as TensorFlow's own ops
    would round it (NaN stays NaN). beta_1: a Python float (1 - beta_1 is taken in float64, then rounded, as a
    TensorFlow expression does); epsilon, bound: float32 scalars."""
    return library().adam_momentum_feed(g, m, v, e, tf.constant(1.0 - beta_1, tf.float32),
                                        tf.cast(epsilon, tf.float32), tf.cast(bound, tf.float32))


def adam_frozen_step(mean, m, v, alpha, beta_1, epsilon, momentum_exchanged, max_step=float("inf")):
    """The receiving side of Adam with its variance v frozen, in one pass over float32 mean, m and v, with
    d = sqrt(v) + epsilon. momentum_exchanged (1-bit Adam: the mean is of m / d): m_new = mean d, delta = mean alpha;
    else (the mean is a gradient) m_new = m + (mean - m)(1 - beta_1), delta = m_new alpha / d; delta clipped to
    [-max_step, max_step] (NaN stays NaN). Returns (m_new, delta), delta what the variable loses, rounded as
    TensorFlow's own ops would round them."""
    return library().adam_frozen_step(mean, m, v, tf.cast(alpha, tf.float32), tf.constant(1.0 - beta_1, tf.float32),
                                      tf.cast(epsilon, tf.float32), tf.cast(max_step, tf.float32),
                                      momentum_exchanged=bool(momentum_exchanged))


def decay_and_subtract(variable, delta, decay):
    """variable = (variable - variable * decay) - delta, in place, in one pass over a float32 resource variable
    (decay: a float32 scalar, AdamW's weight decay times the learning rate, 0 for none): the bits of Keras's
    decoupled weight decay and assign_sub. Returns the op (no output)."""
    if tf.as_dtype(variable.dtype) != tf.float32:
        raise TypeError(f"decay_and_subtract updates float32 variables only, got {tf.as_dtype(variable.dtype).name}.")
    return library().resource_decay_and_subtract(variable.handle, tf.reshape(tf.cast(delta, tf.float32), [-1]),
                                                 tf.cast(decay, tf.float32))


def zero_at(parts, indices):
    """The float32 tensors `parts` with the elements at int32 `indices` of their concatenation (each
    flattened) set to zero; a part nothing else holds is zeroed in place."""
    return library().zero_at([tf.reshape(p, [-1]) for p in parts], indices)


def gather_at(parts, indices):
    """The elements at int32 `indices` of the concatenation of the float32 tensors `parts` (each
    flattened; one tensor is read as itself), read in place."""
    return library().gather_at([tf.reshape(p, [-1]) for p in _tensors(parts)], indices)


def scatter_mean(indices, values, shapes, count):
    """float32 tensors of these shapes, parts of one concatenation: at each int32 index the values
    given for it summed in input order and divided by count, zero elsewhere. For the allgathered
    (values, indices) of `count` ranks: their mean, with no dense tensor per rank."""
    sizes = [int(np.prod(s, dtype=np.int64)) for s in shapes]
    flat = library().scatter_mean(indices, values, N=len(sizes), sizes=sizes, count=int(count))
    return [tf.reshape(y, s) for y, s in zip(flat, shapes)]


def subtract_sparse_mean(variable, indices, values, offset, count):
    """variable -= its part of a bucket's sparse mean, in place: for each int32 index i of the bucket in
    [offset, offset + the variable's size) (the indices increasing, each once), variable[i - offset] -=
    values / count; the bits of ScatterMean's mean subtracted from the whole variable."""
    return library().resource_subtract_sparse_mean(variable.handle, indices, values, tf.cast(offset, tf.int64),
                                                   count=int(count))


def scatter_dense(indices, values, n):
    """Dense vector of length n with values summed at indices (duplicates add up)."""
    return library().scatter_dense(indices, values, tf.cast(n, tf.int64))


def half_pack(tensors):
    """The tensors (float32, float16 or bfloat16), flattened and concatenated in order, as one
    float16 vector: rounded to nearest even as NumPy's astype(np.float16) (beyond +-65504: +-Inf),
    with F16C where the CPU has it. One pass; no float32 concatenation is made."""
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    for i, t in enumerate(tensors):
        check_float(t, f"tensors[{i}]")
    return library().half_pack(tensors)


def half_mean(rows):
    """float16[m]: the mean of the rows of float16[count, m], summed in float32 in row order,
    divided by count in float32 and rounded to float16 once."""
    return library().half_mean(rows)


def half_unpack(packed, shapes, dtypes):
    """Inverse of half_pack: the float16 vector (or a list of float16 vectors, taken as one in order,
    with no concatenation made) cut into tensors of these shapes and dtypes (float16 -> float32 is
    exact)."""
    sizes = [int(np.prod(s, dtype=np.int64)) for s in shapes]
    flat = library().half_unpack(_tensors(packed), sizes=sizes, T=[tf.as_dtype(d) for d in dtypes])
    return [tf.reshape(y, s) for y, s in zip(flat, shapes)]


def push_sum_share(values, weight, parts, before=None):
    """One of `parts` equal shares of a rank's PushSum mass (x, w) (Stochastic Gradient Push), in one pass: the
    float32 vector [x / parts, w / parts], x over the float32 tensors `values` flattened and concatenated in order,

        x = values * w                     before None (SGP without overlap, where w is 1)
        x = values - (1 - w) * before      before: the values before the optimizer's step, of the same shapes

    w = weight, a float32 scalar; parts >= 2. Each product, difference and quotient is rounded in float32 in this
    order, as the same TensorFlow ops round them run eagerly: a division by parts, where in a tf.function Grappler
    makes the ops' division by a constant a product by its rounded reciprocal."""
    return library().push_sum_share(list(values), list(before or []), tf.convert_to_tensor(weight, tf.float32),
                                    parts=int(parts))


def check_sketch_size(rows, cols):
    """Raises ValueError unless rows and cols are positive integers."""
    for name, value in (("rows", rows), ("cols", cols)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}.")


def count_sketch(x, rows, cols, seed=0, step=0, count_loads=False):
    """Count sketch of x, float32[rows, cols]: S[j, h_j(i)] += s_j(i) x_i. x is a tensor or a list of them (a
    bucket's parts, read where they lie: the sketch of their concatenation, each flattened). With count_loads,
    (sketch, loads): loads int32[rows, cols], how many coordinates each cell took, counted in the same pass
    (count_sketch_top_k takes them, and need not hash every coordinate once more to count them).

    Hashes and signs come from (seed, step, j, i) alone (tf_ops/sketch_hash.h),
    so every rank with the same seed and step builds compatible, summable
    sketches; seed and step may be tensors (a new hash family every step).
    A row wider than 4096 columns (16 KB, in a core's L1 cache) is cut into regions of at most that many, and
    the coordinates into as many equal segments, each hashed into its own region
    (so the sketch is built one cache-sized region at a time).
    """
    parts = [tf.convert_to_tensor(p) for p in _tensors(x)]
    for p in parts:
        check_float(p, "x")
    if len({p.dtype for p in parts}) > 1:
        raise TypeError(f"x's parts must share one float type, got {[p.dtype.name for p in parts]}: cast them alike.")
    check_sketch_size(rows, cols)
    sketch, loads = library().count_sketch(parts, tf.cast(seed, tf.int64), tf.cast(step, tf.int64), rows=int(rows),
                                           cols=int(cols), count_loads=bool(count_loads))
    return (sketch, loads) if count_loads else sketch


def count_sketch_query(sketch, n, seed=0, step=0):
    """Median-of-rows estimate of every coordinate i < n from a sketch, float32[n]."""
    return library().count_sketch_query(sketch, tf.cast(n, tf.int64), tf.cast(seed, tf.int64),
                                        tf.cast(step, tf.int64))


def count_sketch_top_k(sketch, x, k, seed=0, step=0, loads=None):
    """top_k_abs(count_sketch_query(sketch, n), k) of a one-row sketch, with x (float32: a tensor, or a list of
    them read as their concatenation, each flattened; n its size) at the selected coordinates: (values of x,
    int32 indices) in increasing index order, without the n estimates (sketched SGD's candidates and the values
    its second round sums). loads: count_sketch(..., count_loads=True)'s of the same n, seed and step (a sketch
    summed across ranks has the same), or None to count them here."""
    if sketch.shape.rank != 2 or sketch.shape[0] != 1:
        raise ValueError(f"count_sketch_top_k takes a one-row sketch [1, cols], got shape {sketch.shape}; "
                         "for more rows use top_k_abs(count_sketch_query(sketch, n), k).")
    loads = tf.zeros([0, 0], tf.int32) if loads is None else loads
    return library().count_sketch_top_k(sketch, loads, [tf.reshape(p, [-1]) for p in _tensors(x)],
                                        tf.cast(k, tf.int32), tf.cast(seed, tf.int64), tf.cast(step, tf.int64))


def count_sketch_buckets(indices, n, rows, cols, seed=0, step=0):
    """int64[rows, m]: the bucket h_j(i) of each of the m coordinates `indices` (< n) in each row j,
    the cells count_sketch of n values adds them to."""
    check_sketch_size(rows, cols)
    return library().count_sketch_buckets(tf.cast(indices, tf.int64), tf.cast(n, tf.int64), tf.cast(seed, tf.int64),
                                          tf.cast(step, tf.int64), rows=int(rows), cols=int(cols))
