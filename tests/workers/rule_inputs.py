"""The update-rule workers' inputs (update_rule.py, hierarchical.py, accordion.py, gossip_rule.py): two
variables, w compressed and b dense, each rank's gradients at each step, SGD's momentum and the learning-rate
schedule; the quantizer's draws; the optimizers and the training loop the rules run."""
import numpy as np
import tensorflow as tf

import hvd_compress as hc
from hvd_compress.compressor import seed_key

SHAPE, DENSE, MU = (60, 50), 10, 0.9
BOUNDARIES, RATES = [2], [0.1, 0.05]  # the rate drops after step 2
WARMUP = 2  # 1-bit Adam's full-precision steps


def rate(step):
    """The schedule's rate at `step`."""
    return RATES[int(step > BOUNDARIES[0])]


def adam_rate(step):
    """The rate of the rules' Adam (adam) at `step`: a tenth of the schedule's."""
    return rate(step) / 10


def grads_of(rank, step):
    """(w's gradient, b's gradient) of `rank` at `step`."""
    rng = np.random.default_rng(100 * step + rank)
    return (rng.standard_normal(SHAPE).astype(np.float32), rng.standard_normal(DENSE).astype(np.float32))


def quantize_draws(compression, bucket=0):
    """draws(rank, server side, step): the stateless seed of Compression.quantize's draws on that rank's side of
    the exchange of bucket `bucket` at that step (hvd_compress/exchange.py's salts)."""
    return lambda rank, server, step: (seed_key(compression.seed, 2 * (bucket * 1024 + rank) + int(server)), step)


def sgd(nesterov=True, schedule=True):
    """The rules' SGD (momentum MU): on the schedule RATES, or at 0.1 throughout."""
    keras = tf.keras  # tf_keras or Keras 3: TF_USE_LEGACY_KERAS decides
    rate = keras.optimizers.schedules.PiecewiseConstantDecay(BOUNDARIES, RATES) if schedule else 0.1
    return keras.optimizers.SGD(rate, momentum=MU, nesterov=nesterov)


def adam(weight_decay=0.0, amsgrad=False):
    """The rules' Adam (weight_decay > 0: AdamW) on a tenth of the schedule RATES (adam_rate)."""
    keras = tf.keras
    rate = keras.optimizers.schedules.PiecewiseConstantDecay(BOUNDARIES, [r / 10 for r in RATES])
    if weight_decay:
        return keras.optimizers.AdamW(rate, weight_decay=weight_decay, amsgrad=amsgrad)
    return keras.optimizers.Adam(rate, amsgrad=amsgrad)


def train(inner, steps, rank, dense=True, wrap=hc.DistributedOptimizer, **wrapper):
    """wrap(inner, **wrapper) (hc.DistributedOptimizer, or hc.PushSumOptimizer) on w (and b where `dense`), both from
    zero, for `steps` graph-mode steps of grads_of(rank, t); returns (w flat, b or None, the wrapped optimizer, the
    step function)."""
    w = tf.Variable(np.zeros(SHAPE, np.float32), name="w")
    b = tf.Variable(np.zeros(DENSE, np.float32), name="b") if dense else None
    opt = wrap(inner, **wrapper)

    @tf.function
    def step(*grads):
        opt.apply_gradients(list(zip(grads, [w, b] if dense else [w])))

    for t in range(steps):
        step(*map(tf.constant, grads_of(rank, t)[:2 if dense else 1]))
    return w.numpy().reshape(-1), None if b is None else b.numpy(), opt, step
