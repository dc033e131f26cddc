"""Count-sketch compression: sketched SGD (Ivkin et al., NeurIPS 2019) and FetchSGD
(Rothchild et al., ICML 2020), both on plain allreduce.

Sketched SGD (mode="sketched", the default). Each worker keeps momentum u and error e
(per-rank state). Per step, under SGD:
    u = mu u + g;  a = lr u + s e                   (Nesterov: lr (mu u + g) + s e; s = lr / last step's lr)
    S_sum = allreduce_sum(S(a))                     (sketches are linear: rows x cols floats)
    C = the P k coordinates of largest |query(S_sum)|     (candidates, the same on every rank)
    V = allreduce_sum(a[C])                         (second round: P k floats, exact sums)
    A = C                                           (every exact sum applied; apply_candidates=False:
                                                     the k coordinates of C with the largest |V|, the paper's)
    x[A] -= V[A] / n;  e = a;  e[A] = 0                 (mask_momentum=True also zeroes u[A])
Hashes and signs are drawn anew every step (from the seed, the bucket and the step): with fixed
hashes the coordinates that share a bucket with a persistent heavy one would hide it at every step,
and their residuals would grow unseen (measured on digits under the paper's top-k rule: recall of
the true top-k 0.02 late in training, against 0.23 with fresh hashes). The candidate set is the
paper's margin: the summed sketch only has to rank the heavy coordinates among the top P k, and
every applied value is exact, so a coordinate the sketch over-estimated is never applied with a
wrong value. The paper applies only the exact top k of the candidates; the second round has already
paid for all P k exact sums, and applying them all is what trains at 8x and beyond (measured on
digits, 2 ranks, 16 epochs, three hash seeds: at 8x 0.981-0.989 against 0.10-0.972 with the top k
only; docs/algorithms.md, "Sketched SGD"). Without the second round (`second_round=False`, the paper's
one-round variant) A is the top k of the estimates and V their estimates.
Under other optimizers the same exchange runs on a = g + e (no momentum in front) and the wrapped
optimizer applies the sparse mean (P k coordinates, or k with apply_candidates=False).

FetchSGD (mode="fetchsgd"). Momentum and error live in sketch space, as two rows x cols
sketches S_u and S_e that are the same on every rank (replicated state); a worker keeps no
d-sized state and sketches its plain gradient. Per step, under SGD:
    S = allreduce_mean(S(g))                        (one round: rows x cols floats)
    S_u = mu S_u + S;  S_e = S_e + lr S_u           (Nesterov: S_e + lr (mu S_u + S))
    A, V = the k coordinates of largest |query(S_e)|, and those estimates
    x[A] -= V;  S_u and S_e zeroed in every cell a coordinate of A hashes to
Zeroing the cells rather than subtracting S(V) is what the authors' implementation does:
subtracting is linear, but a row's estimates of coordinates sharing a cell are all equal, so
taking m of them subtracts m times the cell and flips it (it diverges). The hashes are fixed (the
sketches accumulate across steps, so every step must add to the same cells). No worker holds
any coordinate's exact accumulated value, so there is nothing for a second round to fetch: this
mode is one round. Under other optimizers mu = 0 and lr = 1, and the wrapped optimizer applies V.

Bytes per worker per step: ring allreduce of rows cols (+ P k) floats, independent of the number
of workers.
"""
import math

import numpy as np
import tensorflow as tf

import horovod.tensorflow as hvd
from hvd_compress import ops
from hvd_compress.compressor import EXCHANGE_FEEDBACK, MOMENTUM_IN_FRONT, StatefulCompressor, seed_key
from hvd_compress.exchange import EncodedUpdate, Exchange, Exchanged, SparseMean, allreduce_bytes, split, summed
from hvd_compress.state import REPLICATED, StateSpec

#: Sizes from a ratio (docs/algorithms.md, "Sketched SGD": measured on digits residuals).
DEFAULT_ROWS = 1
#: candidates fetched by the second round per applied coordinate (P)
DEFAULT_CANDIDATES = 25
#: share of a ratio's floats spent on the sketch when there is a second round
SKETCH_SHARE = 0.5
#: FetchSGD's sketch rows: its state accumulates in fixed cells, so estimates take a median
DEFAULT_FETCHSGD_ROWS = 5
MODES = ("sketched", "fetchsgd")


class SketchCompressor(StatefulCompressor):
    """Count-sketch compression: sketched SGD or FetchSGD (see the module docstring).

    Either `ratio` (the compression of bytes per step versus fp32, e.g. 4), and
    everything else chosen from each bucket's size d: F = d / ratio floats per
    step. Sketched SGD spends half on the sketch (rows x cols, rows = 1) and half
    on the second round's P k candidates (P = 25 and k = F / 50 heavy coordinates:
    F / 2 candidates); without a second round the sketch's top k = F / 50 are applied
    and the sketch takes all F. FetchSGD applies k = F / 50 too, and its sketch
    takes all F in 5 rows.
    Or explicit `k`, `cols` (and `rows`, `candidates`). Sketched SGD applies every
    candidate's exact sum (`apply_candidates=True`), or only the exact top k among
    them (`apply_candidates=False`, the paper's rule). Under momentum SGD it keeps the
    worker's momentum where it applied the update (`mask_momentum=False`, as dist-EF-SGD
    does), or zeroes it (True, the paper's momentum stopping: it steadies ratios of 16x and
    more on digits but cost 5 points at 4x on the text model). Hashes and
    signs come from `seed`, shared by all ranks.
    """

    collective = "allreduce of sketches (with optimizer state)"
    sparse_update = True

    def __init__(self, ratio=None, k=None, rows=None, cols=None, candidates=None, second_round=None, seed=0,
                 mode="sketched", apply_candidates=None, mask_momentum=None):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES} (sketched SGD, or FetchSGD's momentum and error "
                             f"in sketch space), got {mode!r}.")
        if mode == "fetchsgd" and (second_round or candidates is not None):
            raise ValueError("mode='fetchsgd' runs one round: its momentum and error live in sketch space, so "
                             "no worker holds exact values for a second round to fetch. Leave second_round "
                             "and candidates unset.")
        second_round = mode == "sketched" if second_round is None else second_round
        if apply_candidates is not None and not (second_round and isinstance(apply_candidates, bool)):
            raise ValueError(f"apply_candidates (True or False) chooses which of the second round's exact sums are "
                             f"applied; it needs mode='sketched' with second_round=True, got "
                             f"apply_candidates={apply_candidates!r}, mode={mode!r}, second_round={second_round!r}.")
        if (ratio is None) == (k is None):
            raise ValueError("Compression.sketch takes ratio= (compression of bytes per step, e.g. 4) "
                             f"or k= with cols=; got ratio={ratio!r}, k={k!r}.")
        default_rows = DEFAULT_FETCHSGD_ROWS if mode == "fetchsgd" else DEFAULT_ROWS
        if ratio is not None:
            if not isinstance(ratio, (int, float)) or isinstance(ratio, bool) or ratio <= 1:
                raise ValueError(f"ratio must be a number > 1 (e.g. 4 for 4x fewer bytes), got {ratio!r}.")
            if cols is not None:
                raise ValueError("give cols= with k=, not with ratio= (ratio chooses cols).")
        else:
            if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
                raise ValueError(f"k must be a positive integer, got {k!r}.")
            if cols is None:
                raise ValueError("Compression.sketch(k=...) needs cols= too (or use ratio=).")
            ops.check_sketch_size(rows or default_rows, cols)
            if cols < k:
                raise ValueError(f"cols={cols} < k={k}: a sketch narrower than the number of heavy hitters "
                                 "cannot tell them apart. Use cols >= k (ratio= gives cols = 12.5 k or more).")
        if rows is not None:
            ops.check_sketch_size(rows, 1)
        if candidates is not None:
            if isinstance(candidates, bool) or not isinstance(candidates, (int, np.integer)) or candidates < 1:
                raise ValueError(f"candidates must be a positive integer (candidates per applied coordinate, "
                                 f"e.g. {DEFAULT_CANDIDATES}), got {candidates!r}.")
            if not second_round:
                raise ValueError("candidates= is the second round's; it has no effect with second_round=False.")
        self.ratio = None if ratio is None else float(ratio)
        self.k, self.rows, self.cols = k, rows or default_rows, cols
        self.candidates = (candidates or DEFAULT_CANDIDATES) if second_round else 1
        self.second_round, self.seed, self.mode = bool(second_round), int(seed), mode
        if mask_momentum is not None and not (mode == "sketched" and isinstance(mask_momentum, bool)):
            raise ValueError(f"mask_momentum (True or False) says whether sketched SGD zeroes the worker's momentum "
                             f"where it applied the update; it needs mode='sketched' (FetchSGD zeroes its momentum "
                             f"sketch's cells by design), got mask_momentum={mask_momentum!r}, mode={mode!r}.")
        self.apply_candidates = self.second_round if apply_candidates is None else apply_candidates
        self.mask_momentum = bool(mask_momentum)

    def __repr__(self):
        return (f"Compression.sketch(ratio={self.ratio}, k={self.k}, rows={self.rows}, cols={self.cols}, "
                f"candidates={self.candidates}, second_round={self.second_round}, seed={self.seed}, "
                f"mode={self.mode!r}, apply_candidates={self.apply_candidates}, mask_momentum={self.mask_momentum})")

    @property
    def update_rule(self):
        """Sketched SGD: the worker's momentum in front (dist-EF-SGD's rule); FetchSGD: momentum and
        error in sketch space, the exchange's."""
        return MOMENTUM_IN_FRONT if self.mode == "sketched" else EXCHANGE_FEEDBACK

    def plan(self, bucket):
        return (SketchAllreduce if self.mode == "sketched" else SketchSpaceAllreduce)(self, bucket)

    def sizes(self, num_elements):
        """(k, rows, cols, number of candidates) for a bucket of num_elements. k is the number of heavy
        coordinates the candidates are sized for (and the recall metric's k); sketched SGD applies all
        the candidates unless apply_candidates=False, then k of them."""
        if self.ratio is None:
            k, cols = self.k, self.cols
        else:  # k = F / 50 either way; the sketch takes what the candidates leave
            floats = num_elements / self.ratio
            per_k = self.candidates if self.second_round else DEFAULT_CANDIDATES
            k = max(1, math.floor(floats * (1 - SKETCH_SHARE) / per_k))
            sketch_floats = floats - (self.candidates * k if self.second_round else 0)
            cols = max(1, math.floor(sketch_floats / self.rows))
        if k > num_elements:
            raise ValueError(f"Compression.sketch: k={k} is larger than a bucket of {num_elements} "
                             "elements; lower k or the ratio.")
        return k, self.rows, cols, min(num_elements, self.candidates * k)

    def payload_bytes(self, num_elements):
        """Float32 values one worker contributes to the allreduces per step."""
        _, rows, cols, candidates = self.sizes(num_elements)
        return 4 * (rows * cols + (candidates if self.second_round else 0))

    def hash_seed(self, salt=0):
        """The hashes' seed of a bucket (salt: its index); sketched SGD hashes anew every step (`step`),
        FetchSGD always as step 0."""
        return seed_key(self.seed, salt)

    def encode(self, parts, rows, cols, salt=0, step=0, count_loads=False):
        """The count sketch of a bucket's parts (tensors, read where they lie); with count_loads, and its cells'
        loads (what `heaviest` takes)."""
        return ops.count_sketch(parts, rows, cols, self.hash_seed(salt), step, count_loads)

    def estimate(self, sketch, num_elements, salt=0, step=0):
        return ops.count_sketch_query(sketch, num_elements, self.hash_seed(salt), step)

    def heaviest(self, sketch, parts, count, salt=0, step=0, loads=None):
        """The `count` coordinates of largest |estimate| from the summed sketch, and this worker's bucket (its
        parts) there: (values, int32 indices in increasing order). One row: count_sketch_top_k (the
        estimate's magnitude is its cell's; no estimate of every coordinate is written), with the cells' loads
        where `encode` counted them; more: the median estimates, then their top-k."""
        if self.rows == 1:
            return ops.count_sketch_top_k(sketch, parts, count, self.hash_seed(salt), step, loads)
        n = sum(p.shape.num_elements() for p in parts)
        _, indices = ops.top_k_abs(self.estimate(sketch, n, salt, step), count)
        return ops.gather_at(parts, indices), indices

    def buckets(self, indices, num_elements, rows, cols, salt=0, step=0):
        return ops.count_sketch_buckets(indices, num_elements, rows, cols, self.hash_seed(salt), step)


class SketchAllreduce(Exchange):
    """Sketched SGD (hvd_compress/sketch.py): count sketches summed by allreduce, candidates found
    alike on every rank, their exact sums fetched by a second allreduce and applied (all of them, or
    the exact top-k among them with apply_candidates=False)."""

    def __init__(self, compressor, bucket):
        self.compressor, self.bucket = compressor, bucket
        self.n = bucket.num_elements
        self.k, self.rows, self.cols, self.num_candidates = compressor.sizes(self.n)
        self.masks_momentum = compressor.mask_momentum
        self.bytes_sent = (allreduce_bytes(4 * self.rows * self.cols, bucket.size)
                           + (allreduce_bytes(4 * self.num_candidates, bucket.size)
                              if compressor.second_round else 0))
        self.collectives = 2 if compressor.second_round else 1  # the sketches, then the candidates' values

    def __call__(self, parts, state, step):
        tensors = summed(parts)  # the bucket's parts, never concatenated
        process_set, name, salt = self.bucket.process_set, self.bucket.name, self.bucket.index
        counts = self.rows == 1 and self.compressor.second_round  # the candidates' selection takes the cells' loads
        encoded = self.compressor.encode(tensors, self.rows, self.cols, salt, step.number, count_loads=counts)
        sketch, loads = encoded if counts else (encoded, None)
        sketch = hvd.allreduce(sketch, op=hvd.Sum, process_set=process_set, name=name + ".sketch")
        if self.compressor.second_round:
            local, candidates = self.compressor.heaviest(sketch, tensors, self.num_candidates, salt, step.number,
                                                         loads)
            values = hvd.allreduce(local, op=hvd.Sum, process_set=process_set, name=name + ".values")
            applied = candidates
            if not self.compressor.apply_candidates:
                values, chosen = ops.top_k_abs(values, self.k)
                applied = tf.gather(candidates, chosen)
        else:
            estimate = self.compressor.estimate(sketch, self.n, salt, step.number)
            _, applied = ops.top_k_abs(estimate, self.k)
            values = tf.gather(estimate, applied)
        # e = a, zeroed where applied, in place; the mean of the applied sums stays sparse (subtracted from the
        # variables where they are, or decoded into each part).
        mean = EncodedUpdate(SparseMean(self.bucket.size), (applied, values), self.n)
        return Exchanged(ops.zero_at(parts, applied), split(mean, parts), applied=applied)


class SketchSpaceAllreduce(Exchange):
    """FetchSGD (hvd_compress/sketch.py): the sketches of plain gradients averaged by one allreduce,
    momentum and error accumulated in sketch space (replicated state), the top-k of the error
    sketch's estimates applied and their cells zeroed. Hashes are fixed: the state accumulates."""

    def __init__(self, compressor, bucket):
        self.compressor, self.bucket = compressor, bucket
        self.n = bucket.num_elements
        self.k, self.rows, self.cols, _ = compressor.sizes(self.n)
        self.state = (StateSpec("sketch_momentum", (self.rows, self.cols), REPLICATED),
                      StateSpec("sketch_error", (self.rows, self.cols), REPLICATED))
        self.bytes_sent = allreduce_bytes(4 * self.rows * self.cols, bucket.size)

    def residual(self, state):
        # Each row of a count sketch keeps the vector's squared norm in expectation.
        return [state["sketch_error"] / math.sqrt(self.rows)]

    def __call__(self, parts, state, step):
        salt = self.bucket.index
        sketch = hvd.allreduce(self.compressor.encode(summed(parts), self.rows, self.cols, salt), op=hvd.Average,
                               process_set=self.bucket.process_set, name=self.bucket.name + ".sketch")
        momentum = step.momentum * state["sketch_momentum"] + sketch
        pushed = step.momentum * momentum + sketch if step.nesterov else momentum
        error = state["sketch_error"] + (pushed if step.learning_rate is None else step.learning_rate * pushed)
        values, applied = ops.top_k_abs(self.compressor.estimate(error, self.n, salt), self.k)
        cells = self.compressor.buckets(applied, self.n, self.rows, self.cols, salt)
        rows = tf.repeat(tf.range(self.rows, dtype=tf.int64), self.k)
        keep = tf.tensor_scatter_nd_update(tf.ones([self.rows, self.cols]),
                                           tf.stack([rows, tf.reshape(cells, [-1])], 1), tf.zeros([self.rows * self.k]))
        return Exchanged(None, split(EncodedUpdate(SparseMean(1), (applied, values), self.n), parts),
                         {"sketch_momentum": momentum * keep, "sketch_error": error * keep})
