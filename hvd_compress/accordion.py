"""Accordion: adaptive communication from critical-regime detection.

Agarwal, Wang, Lee, Venkataraman, Papailiopoulos, "Accordion: Adaptive
Gradient Communication via Critical Learning Regime Identification"
(MLSys 2021).

Rule. Every detection interval (an epoch, or K optimizer steps) each group
of variables (a layer's tensor for compression; the whole model for the
batch size) accumulates its local gradients, Delta = sum_t g_t. At the start
of the next interval, with ||Delta_old|| the previous interval's norm:
    critical  <=>  |  ||Delta_old|| - ||Delta_new||  | / ||Delta_old||  >= eta
                   or the learning rate has dropped since the last decision
                   or there is no previous interval yet (training starts critical)
A critical group uses the low-compression setting (or the small batch) for
the coming interval, the others the high-compression one (or the large
batch). The norms are averaged over ranks (a few floats by allreduce) and the
decision is broadcast from rank 0, so every rank runs the same collectives.

Switching compression. `AdaptiveCompression(low, high)` plans, for every compressed
tensor (one tensor per bucket, so each layer switches alone), an exchange.Switching of
both settings' exchanges, which picks one per step with `tf.cond` on the detector's
regime variable: a switch is a variable assignment, never a retrace. Error feedback
is kept across a switch: the residual is whatever was not yet sent, under
either setting, and the next step adds it back. Each setting keeps its own
extra state (PowerSGD's warm-started Q per rank, the onebit server
residual), which waits unchanged while the other setting runs. `low` is a
weaker compressor of the same family (PowerSGD rank, top-k/random-k ratio,
sketch size) or `Compression.none` (full-precision allreduce, which sends
the residual too and so leaves it zero).

State. The accumulated gradients, the previous norms, the last learning
rate, the current regimes and the byte count are optimizer variables, so a
checkpoint keeps the detector's history and a resumed run decides as the
uninterrupted one would.
"""
import logging

import numpy as np
import tensorflow as tf

import horovod.tensorflow as hvd
from hvd_compress import exchange
from hvd_compress.compressor import NoneCompressor, StatefulCompressor
from hvd_compress.state import PER_RANK, REPLICATED, StateSpec

log = logging.getLogger("hvd_compress.accordion")

LOW, HIGH = 0, 1


def critical_regime(previous_norms, norms, eta, learning_rate_dropped=False):
    """Which groups are critical (bool array): a relative norm change >= eta, no
    previous interval (norm 0), or a learning-rate drop (all)."""
    previous_norms, norms = np.asarray(previous_norms, np.float64), np.asarray(norms, np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        change = np.abs(previous_norms - norms) / previous_norms
    critical = ~(change < eta)  # no history (0/0, x/0) and NaN norms count as critical
    return critical | bool(learning_rate_dropped)


def _is_uncompressed(compression):
    return compression is NoneCompressor or isinstance(compression, NoneCompressor)


class AdaptiveCompression(StatefulCompressor):
    """Two settings of one compressor family, chosen per tensor at run time (see module doc)."""

    def __init__(self, low, high):
        if not isinstance(high, StatefulCompressor):
            raise TypeError(f"high must be a stateful hvd_compress compressor such as "
                            f"Compression.powersgd(rank=1), got {high!r}.")
        if not (_is_uncompressed(low) or type(low) is type(high)):
            raise TypeError(f"low must be the same compressor family as high ({type(high).__name__}) with "
                            f"a weaker setting, or Compression.none; got {low!r}.")
        if any(getattr(c, "mode", None) == "fetchsgd" for c in (low, high)):
            raise ValueError("Accordion cannot switch FetchSGD (Compression.sketch(mode='fetchsgd')): its error and "
                             "momentum live in sketch space, where another setting's steps would not add to them. "
                             "Use the default mode='sketched', whose error is the worker's and survives a switch.")
        self.low, self.high = (None if _is_uncompressed(low) else low), high
        self.collective = high.collective
        self.update_rule, self.sparse_update = high.update_rule, high.sparse_update
        self.detector = None  # the RegimeDetector whose regimes choose (GradientExchange.use_accordion)

    #: each compressed tensor is a bucket of its own, so each layer switches alone
    fuses_tensors = False

    def plan(self, bucket):
        """Both settings' exchanges (collectives named .setting0 and .setting1), the detector's regime
        of this bucket's tensor choosing: critical -> low."""
        low, high = (exchange.plan(setting, bucket._replace(name=f"{bucket.name}.setting{k}"))
                     for k, setting in enumerate(self.settings))
        return exchange.Switching(low, high, lambda: self.detector.critical[bucket.index] > 0.5)

    @property
    def settings(self):
        """The settings by choice index: LOW (None = uncompressed), HIGH."""
        return [self.low, self.high]

    def compresses(self, shape):
        return self.high.compresses(shape)

    @property
    def splits_tensors(self):
        """Whether a hierarchical exchange may cut a bucket into flat pieces: where both settings can."""
        return all(getattr(setting, "splits_tensors", True) for setting in self.settings if setting is not None)

    def __repr__(self):
        low = "Compression.none" if self.low is None else repr(self.low)
        return f"Accordion(low={low}, high={self.high!r})"


def current_learning_rate(optimizer):
    """The learning rate the next step will use (a schedule evaluated at the step count)."""
    lr = optimizer._learning_rate
    if callable(lr) and not hasattr(lr, "assign"):  # a LearningRateSchedule of either Keras
        lr = lr(optimizer.iterations)
    return float(tf.convert_to_tensor(lr))


class RegimeDetector:
    """Accumulates gradients per group over an interval and decides the regimes (module doc).

    `groups` is "variable" (each compressed variable alone) or "model" (all
    variables together). Its variables are created by the exchange's
    factories at build time (optimizer variables for DistributedOptimizer).
    """

    def __init__(self, eta=0.5, groups="variable"):
        if not isinstance(eta, (int, float)) or isinstance(eta, bool) or not eta > 0:
            raise ValueError(f"eta must be a positive number (the paper uses 0.5), got {eta!r}.")
        if groups not in ("variable", "model"):
            raise ValueError(f"groups must be 'variable' or 'model', got {groups!r}.")
        self.eta, self.groups = float(eta), groups
        self.built = False

    def __repr__(self):
        return f"RegimeDetector(eta={self.eta}, groups={self.groups!r})"

    def build(self, variable_names, layout, new_state):
        """Creates the detector's state through the exchange's new_state(StateSpec): the local
        gradient sums are per-rank, the interval's history and the regimes replicated."""
        if self.groups == "variable":
            self.members = [[i] for i in layout.compressed]
            self.names = [variable_names[i].split(":")[0] for i in layout.compressed]
        else:
            self.members = [[i for i in range(len(variable_names)) if i not in layout.empty]]
            self.names = ["model"]
        watched = sorted({i for group in self.members for i in group})
        self.accumulated = {i: new_state(StateSpec(f"accordion_accumulated/{i}", layout.shapes[i], PER_RANK))
                            for i in watched}

        def replicated(name, shape, initializer=None):
            return new_state(StateSpec(f"accordion_{name}/all", shape, REPLICATED, initializer=initializer))

        self.steps = replicated("steps", ())
        self.previous_norms = replicated("previous_norms", (len(self.members),))
        self.last_learning_rate = replicated("last_learning_rate", ())
        self.critical = replicated("critical", (len(self.members),), tf.ones)
        self.bytes_total = replicated("bytes_total", ())
        self.built = True

    def observe(self, grads):
        """In the step: adds this step's local gradients to the interval's sums."""
        for i, acc in self.accumulated.items():
            acc.assign_add(tf.cast(grads[i], acc.dtype))
        self.steps.assign_add(1.0)

    def decide(self, learning_rate, process_set=hvd.global_process_set):
        """Between steps, on every rank: ends the interval and returns (critical, norms) per group."""
        squares = {i: tf.reduce_sum(tf.square(acc)) for i, acc in self.accumulated.items()}
        local = tf.stack([tf.sqrt(tf.add_n([squares[i] for i in group])) for group in self.members])
        norms = hvd.allreduce(local, op=hvd.Average, process_set=process_set,
                              name="hc.accordion.norms").numpy()
        dropped = 0 < learning_rate < float(self.last_learning_rate.numpy()) * (1 - 1e-6)
        critical = critical_regime(self.previous_norms.numpy(), norms, self.eta, dropped)
        critical = hvd.broadcast(tf.constant(critical, tf.float32), 0, process_set=process_set,
                                 name="hc.accordion.decision").numpy() > 0.5
        self.previous_norms.assign(norms.astype(np.float32))
        self.last_learning_rate.assign(learning_rate)
        self.critical.assign(critical.astype(np.float32))
        for acc in self.accumulated.values():
            acc.assign(tf.zeros_like(acc))
        self.steps.assign(0.0)
        return critical, norms
