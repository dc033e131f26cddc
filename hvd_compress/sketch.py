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
    x[A] -= V[A] / n;  e = a;  e[A] = 0;  u[A] = 0      (mask_momentum=False: u is kept)
Hashes and signs are drawn anew every step (from the seed, the bucket and the step): with fixed
hashes the coordinates that share a bucket with a persistent heavy one would hide it at every step,
and their residuals would grow unseen (measured on digits under the paper's top-k rule: recall of
the true top-k 0.02 late in training, against 0.23 with fresh hashes). The candidate set is the
paper's margin: the summed sketch only has to rank the heavy coordinates among the top P k, and
every applied value is exact, so a coordinate the sketch over-estimated is never applied with a
wrong value. The paper applies only the exact top k of the candidates; the second round has already
paid for all P k exact sums, and applying them all is what trains at 8x and beyond (measured on
digits, 2 ranks, 16 epochs, three hash seeds: at 8x 0.981-0.989 against 0.10-0.972 with the top k
only; docs/design.md, "Sketched SGD"). Without the second round (`second_round=False`, the paper's
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

from hvd_compress import ops
from hvd_compress.compression import StatefulCompressor

#: Sizes from a ratio (docs/design.md, "Sketched SGD": measured on digits residuals).
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
    them (`apply_candidates=False`, the paper's rule). Under momentum SGD it zeroes
    the worker's momentum where it applied the update (`mask_momentum=True`, the
    paper's momentum stopping), or keeps it (False, as dist-EF-SGD does). Hashes and
    signs come from `seed`, shared by all ranks.
    """

    collective = "allreduce of sketches (with optimizer state)"

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
        self.mask_momentum = mode == "sketched" if mask_momentum is None else mask_momentum

    def __repr__(self):
        return (f"Compression.sketch(ratio={self.ratio}, k={self.k}, rows={self.rows}, cols={self.cols}, "
                f"candidates={self.candidates}, second_round={self.second_round}, seed={self.seed}, "
                f"mode={self.mode!r}, apply_candidates={self.apply_candidates}, mask_momentum={self.mask_momentum})")

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
        return self.seed * (1 << 20) + salt

    def encode(self, flat, rows, cols, salt=0, step=0):
        return ops.count_sketch(flat, rows, cols, self.hash_seed(salt), step)

    def estimate(self, sketch, num_elements, salt=0, step=0):
        return ops.count_sketch_query(sketch, num_elements, self.hash_seed(salt), step)

    def buckets(self, indices, num_elements, rows, cols, salt=0, step=0):
        return ops.count_sketch_buckets(indices, num_elements, rows, cols, self.hash_seed(salt), step)
