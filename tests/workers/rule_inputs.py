"""The update-rule workers' inputs (update_rule.py, hierarchical.py): two variables, w compressed and b
dense, each rank's gradients at each step, SGD's momentum and the learning-rate schedule; the quantizer's draws."""
import numpy as np

from hvd_compress.compressor import seed_key

SHAPE, DENSE, MU = (60, 50), 10, 0.9
BOUNDARIES, RATES = [2], [0.1, 0.05]  # the rate drops after step 2
WARMUP = 2  # 1-bit Adam's full-precision steps


def grads_of(rank, step):
    """(w's gradient, b's gradient) of `rank` at `step`."""
    rng = np.random.default_rng(100 * step + rank)
    return (rng.standard_normal(SHAPE).astype(np.float32), rng.standard_normal(DENSE).astype(np.float32))


def quantize_draws(compression, bucket=0):
    """draws(rank, server side, step): the stateless seed of Compression.quantize's draws on that rank's side of
    the exchange of bucket `bucket` at that step (hvd_compress/exchange.py's salts)."""
    return lambda rank, server, step: (seed_key(compression.seed, 2 * (bucket * 1024 + rank) + int(server)), step)
