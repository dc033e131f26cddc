"""Sketched SGD: count-sketch compression on plain allreduce (Ivkin et al., NeurIPS 2019).

Each worker keeps momentum u and error e (optimizer slots). Per step, under SGD:
    u = mu u + g;  e = e + lr u                  (worker: a = lr u + e)
    S_sum = allreduce_sum(S(e))                   (sketches are linear: r x c floats)
    candidates = top-k of |query(S_sum)|          (identical on every rank)
    second_round: values = allreduce_sum(e[candidates])  (k more floats, exact)
    else:         values = query(S_sum)[candidates]
    x[candidates] -= values / n;  e[candidates] = 0;  u[candidates] = 0
Under other optimizers the same exchange runs on a = g + e (no momentum in
front) and the wrapped optimizer applies the k-sparse mean.

Bytes per worker per step: ring allreduce of r c (+ k) floats, independent of
the number of workers.
"""
import math

import numpy as np

from hvd_compress import ops
from hvd_compress.compression import StatefulCompressor

DEFAULT_ROWS = 3
#: columns per candidate: a coordinate meets a heavy one in a row with probability k / cols
COLS_PER_K = 4


class SketchCompressor(StatefulCompressor):
    """Count-sketch compression with heavy-hitter recovery.

    Either `ratio` (the compression of bytes per step versus fp32, e.g. 4) and
    everything else chosen from each bucket's size d: floats per step
    F = d / ratio = k + rows cols (second round) or rows cols, with
    cols = 10 k and rows = 5; or explicit `k`, `rows` and `cols`.
    Hashes and signs come from `seed`, shared by all ranks.
    """

    collective = "allreduce of sketches (with optimizer state)"

    def __init__(self, ratio=None, k=None, rows=None, cols=None, second_round=True, seed=0):
        if (ratio is None) == (k is None):
            raise ValueError("Compression.sketch takes ratio= (compression of bytes per step, e.g. 4) "
                             f"or k= with rows= and cols=; got ratio={ratio!r}, k={k!r}.")
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
            ops.check_sketch_size(rows or DEFAULT_ROWS, cols)
            if cols < k:
                raise ValueError(f"cols={cols} < k={k}: a sketch narrower than the number of heavy hitters "
                                 f"cannot recover them. Use cols >= {COLS_PER_K} * k.")
        if rows is not None:
            ops.check_sketch_size(rows, 1)
        self.ratio = None if ratio is None else float(ratio)
        self.k, self.rows, self.cols = k, rows or DEFAULT_ROWS, cols
        self.second_round, self.seed = bool(second_round), int(seed)

    def __repr__(self):
        return (f"Compression.sketch(ratio={self.ratio}, k={self.k}, rows={self.rows}, cols={self.cols}, "
                f"second_round={self.second_round}, seed={self.seed})")

    def sizes(self, num_elements):
        """(k, rows, cols) for a bucket of num_elements."""
        if self.ratio is None:
            k, cols = self.k, self.cols
        else:
            floats = num_elements / self.ratio
            per_k = self.rows * COLS_PER_K + (1 if self.second_round else 0)
            k = max(1, math.floor(floats / per_k))
            cols = COLS_PER_K * k
        if k > num_elements:
            raise ValueError(f"Compression.sketch: k={k} is larger than a bucket of {num_elements} "
                             "elements; lower k or the ratio.")
        return k, self.rows, cols

    def payload_bytes(self, num_elements):
        """Float32 values one worker contributes to the allreduces per step."""
        k, rows, cols = self.sizes(num_elements)
        return 4 * (rows * cols + (k if self.second_round else 0))

    def encode(self, flat, rows, cols, salt=0):
        return ops.count_sketch(flat, rows, cols, self.seed * (1 << 20) + salt)

    def estimate(self, sketch, num_elements, salt=0):
        return ops.count_sketch_query(sketch, num_elements, self.seed * (1 << 20) + salt)
