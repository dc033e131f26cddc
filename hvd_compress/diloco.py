"""DiLoCo: H local steps on each rank, then one outer step on the ranks' averaged change.

Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models", 2023; the compressed
outer exchange with error feedback as in SparseLoCo (Sarfi et al., 2025). Every rank keeps the global snapshot
theta (replicated) and trains its own copy x_i with the wrapped ("inner") optimizer, which sends nothing. After
every `sync_every` = H inner steps (counted by DiLoCo: a step a LossScaleOptimizer skips is not one):

    Delta_i = theta - x_i                                  the pseudo-gradient, float32
    a_i = Delta_i + beta e_i;  D_i = C(a_i);  e_i = a_i - D_i   with compression C (per-rank error feedback,
                                                           beta = error_decay; without compression D_i = Delta_i)
    Delta = mean_i D_i                                     one exchange (the compression's own collectives)
    m = mu m + Delta                                       outer momentum (replicated), when mu > 0
    theta = theta - eta (Delta + mu m)   (Nesterov),  theta - eta m  (heavy ball),  theta - eta Delta  (mu = 0)
    x_i = theta                                            every rank holds the same weights again

Defaults are the paper's outer optimizer: Nesterov SGD, eta = 0.7, mu = 0.9. SparseLoCo keeps no outer
momentum: outer_momentum=0, outer_learning_rate=1 and a decayed error feedback (error_decay = the paper's
beta < 1) on a top-k pseudo-gradient (hc.methods' "sparseloco"). The exchange is a GradientExchange under no optimizer, so every
Compression works here with its error feedback, buckets and bytes as for gradients (an unbiased compressor,
random-k, is not error-fed, as there).

State (docs/state_and_checkpoints.md): theta, the outer momentum and the step count are replicated (optimizer
variables: model files and broadcasts carry them); the error feedback e_i is per rank (checkpoints only); the
inner optimizer's slots (Adam's m and v) stay each rank's own between syncs, and are saved as rank 0's in a
rank-0 model file. Between syncs the ranks hold different models: `hvd_compress.callbacks.Consensus` averages
them where a model is evaluated or saved.
"""
import logging
import math

import tensorflow as tf

import horovod.tensorflow as hvd
from hvd_compress import exchange
from hvd_compress.compression import Compression
from hvd_compress.compression import from_config as compression_from_config, to_config as compression_config
from hvd_compress.gradient_exchange import (DEFAULT_FUSION_THRESHOLD_BYTES, DEFAULT_MIN_COMPRESS_SIZE,
                                            GradientExchange, check_known_variables)
from hvd_compress.keras_compat import (WrapperCore, keras_of, refuse_saved_process_set, refuse_wrapped,
                                       register_loader, saved_process_set, wrap_in_place)
from hvd_compress.optimizer import refuse_loss_scale_optimizer, refuse_xla
from hvd_compress import state

log = logging.getLogger("hvd_compress")

#: DiLoCo's outer optimizer (Douillard et al. 2023): Nesterov SGD at this rate and momentum
OUTER_LEARNING_RATE, OUTER_MOMENTUM = 0.7, 0.9


def _is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


class OuterStep:
    """theta, the outer momentum and the exchange of the pseudo-gradients, for one fixed list of variables."""

    def __init__(self, sync_every, outer_learning_rate, outer_momentum, nesterov, compression, error_decay,
                 process_set, min_compress_size, fusion_threshold_bytes, name):
        if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
            raise ValueError(f"sync_every must be a number of inner steps >= 1 between syncs (the papers: 50 to 500), "
                             f"got {sync_every!r}.")
        if not _is_number(outer_learning_rate) or outer_learning_rate <= 0:
            raise ValueError(f"outer_learning_rate must be a number > 0 (DiLoCo's: {OUTER_LEARNING_RATE}), "
                             f"got {outer_learning_rate!r}.")
        if not _is_number(outer_momentum) or not 0 <= outer_momentum < 1:
            raise ValueError(f"outer_momentum must be a number in [0, 1) (DiLoCo's: {OUTER_MOMENTUM}; 0: none, as "
                             f"SparseLoCo), got {outer_momentum!r}.")
        if not isinstance(nesterov, bool):
            raise TypeError(f"nesterov must be True or False, got {nesterov!r}.")
        if not _is_number(error_decay) or not 0 < error_decay <= 1:
            raise ValueError(f"error_decay must be a number in (0, 1] (1: plain error feedback; SparseLoCo decays it), "
                             f"got {error_decay!r}.")
        self.sync_every, self.nesterov = sync_every, nesterov
        self.learning_rate, self.momentum = float(outer_learning_rate), float(outer_momentum)
        self.error_decay = float(error_decay)
        self.exchange = GradientExchange(compression, process_set, min_compress_size=min_compress_size,
                                         fusion_threshold_bytes=fusion_threshold_bytes, name=name, warmup_steps=0)
        self.exchange.settle(None)
        if self.error_decay != 1 and not self.exchange.compression.requires_optimizer:
            raise ValueError(f"error_decay={error_decay} decays the error feedback of a compression, and "
                             f"{self.exchange.compression!r} keeps none: leave error_decay=1, or give a compression "
                             "such as Compression.topk(ratio=0.01).")
        self.process_set, self.name = process_set, name
        self.built = False

    def build(self, variables, new_replicated, holder):
        """theta (from the variables' values) and the outer momentum through new_replicated(name, initial
        value) -> variable, and the exchange's plan and state (per-rank state tracked by `holder`)."""
        if self.built:
            return
        # Plain references (this object is not tracked: the optimizer must not own the model's variables).
        self.variables = list(variables)
        self.variable_ids = [id(v) for v in self.variables]
        self.snapshots = [new_replicated(f"diloco_snapshot/{i}", tf.cast(v, tf.float32))
                          for i, v in enumerate(self.variables)]
        self.momenta = ([new_replicated(f"diloco_momentum/{i}", tf.zeros(v.shape, tf.float32))
                         for i, v in enumerate(self.variables)] if self.momentum else None)
        # The inner steps taken: the optimizer's own count also advances on a step a LossScaleOptimizer skips
        # (tf_keras's), which would skip a sync.
        self.inner_steps = new_replicated("diloco_inner_steps", tf.zeros([], tf.int64))
        self.exchange.build(self.snapshots, holder=holder,
                            new_replicated=lambda spec: new_replicated(spec.name, spec.initial_value()))
        self.built = True

    @property
    def bytes_per_sync(self):
        """Bytes one rank sends per sync (it receives as many)."""
        return self.exchange.bytes_sent

    @property
    def bytes_per_step(self):
        """Bytes one rank sends per inner step, averaged over the H steps of a sync period."""
        return self.bytes_per_sync / self.sync_every

    def __call__(self):
        """After an inner step: counts it, and syncs where it is the H-th since the last sync."""
        count = self.inner_steps.assign_add(1)
        due = tf.equal(tf.math.floormod(count, self.sync_every), 0)
        tf.cond(due, lambda: self._sync(count // self.sync_every - 1), lambda: tf.constant(False))

    def _sync(self, sync):
        with tf.name_scope("hc_diloco_sync"):
            if self.error_decay != 1:  # SparseLoCo: a_i = Delta_i + beta e_i
                for residual in self.exchange.residuals:
                    if residual is not None:
                        residual.assign(residual * self.error_decay)
            deltas = [theta - tf.cast(x, tf.float32) for theta, x in zip(self.snapshots, self.variables)]
            averaged = self.exchange(deltas, step=tf.cast(sync, tf.int64))
            for i, (theta, x, delta) in enumerate(zip(self.snapshots, self.variables, averaged)):
                step = delta
                if self.momentum:
                    m = self.momenta[i].assign(self.momentum * self.momenta[i] + delta)
                    step = delta + self.momentum * m if self.nesterov else m
                stepped = theta.assign(theta - self.learning_rate * step)
                x.assign(tf.cast(stepped, x.dtype))
        return tf.constant(True)


class _DiLoCoMixin(WrapperCore):
    saved_name = "DiLoCo"
    ranks_diverge = True

    def _hc_init(self, outer, settings):
        object.__setattr__(self, "_hc_outer", outer)
        object.__setattr__(self, "_hc_saved_settings", settings)

    def _hc_settings(self):
        """DiLoCo's keyword arguments as JSON data (for model files)."""
        settings = dict(self._hc_saved_settings)
        settings["compression"] = compression_config(settings["compression"])
        settings["process_set_ranks"] = saved_process_set(settings.pop("process_set"))
        return settings

    @staticmethod
    def factory(optimizer, compression, process_set_ranks=None, **settings):
        if process_set_ranks is not None:
            refuse_saved_process_set(process_set_ranks, "DiLoCo")
        if isinstance(compression, dict):
            compression = compression_from_config(compression)
        return DiLoCo(optimizer, compression=compression, **settings)

    @property
    def diloco(self):
        """The OuterStep: theta, the outer momentum, the exchange and its bytes."""
        return self._hc_outer

    @property
    def hc_process_set(self):
        return self._hc_outer.process_set

    @property
    def bytes_per_step(self):
        return self._hc_outer.bytes_per_step

    def _trackable_children(self, save_type="checkpoint", **kwargs):
        # The error feedback: in checkpoints, with its owner; never in optimizer.variables nor in model files.
        return state.checkpoint_children(super()._trackable_children(save_type, **kwargs),
                                         self._hc_outer.exchange.rank_state, save_type)

    def build(self, var_list):
        """Keras's build of the inner optimizer, then theta, the outer momentum and the exchange's plan, eagerly
        (as DistributedOptimizer.build)."""
        var_list = list(var_list)
        if not var_list:
            return
        with tf.init_scope():
            super().build(var_list)
            self._hc_outer.build(var_list, holder=self, new_replicated=lambda name, value: self.add_variable(
                value.shape, dtype=value.dtype, initializer=lambda shape, dtype: value,
                name=f"hc_{state.safe_name(name)}"))

    def hc_replan(self):
        """After an elastic reset, on every rank (hvd_compress.elastic.KerasState calls it)."""
        if self._hc_outer.built:
            self._hc_outer.exchange.replan()

    def hc_plan_fit(self, end_step):
        """Before a model.fit that ends at optimizer step `end_step` (None: unknown): a fit in which no sync falls
        trains every rank alone; said on rank 0 before its first step."""
        start = int(self.iterations.numpy())
        due = self._hc_outer.sync_every - int(self._hc_outer.inner_steps.numpy()) % self._hc_outer.sync_every \
            if self._hc_outer.built else self._hc_outer.sync_every
        if end_step is None or end_step - start >= due:
            return
        if hvd.rank() == 0:
            log.warning("hvd_compress: DiLoCo syncs every %d inner steps, and this model.fit runs steps %d to %d: "
                        "no sync falls in it, so every rank trains alone. Give DiLoCo a smaller sync_every=.",
                        self._hc_outer.sync_every, start + 1, end_step)

    def _hc_agree_on_finiteness(self, grads):
        """Under a LossScaleOptimizer: every rank skips an overflowed inner step together, so the syncs stay
        at the same steps everywhere (one scalar allreduce a step)."""
        return exchange.agree_on_finiteness(grads, self._hc_outer.process_set, f"{self._hc_outer.name}.finite")

    def _hc_step(self, pairs):
        """The inner optimizer's step on this rank's gradients, then the sync where one is due."""
        refuse_xla("hvd_compress.DiLoCo")
        object.__setattr__(self, "_hc_stepped", True)
        with tf.init_scope():
            self.build([v for _, v in pairs])
        check_known_variables(self._hc_outer.variable_ids, [v for _, v in pairs], "DiLoCo")
        self._hc_wrapped_apply(pairs)
        self._hc_outer()
        return self.iterations


register_loader(_DiLoCoMixin)


def DiLoCo(optimizer, sync_every, outer_learning_rate=OUTER_LEARNING_RATE, outer_momentum=OUTER_MOMENTUM,
           nesterov=True, compression=Compression.none, error_decay=1.0, process_set=hvd.global_process_set,
           min_compress_size=DEFAULT_MIN_COMPRESS_SIZE, fusion_threshold_bytes=DEFAULT_FUSION_THRESHOLD_BYTES):
    """Wraps a Keras optimizer (Keras 3 or tf_keras) as DiLoCo's inner optimizer (see the module docstring):
    each rank steps alone on its own gradients, sending nothing, and every `sync_every` steps the ranks
    average their change since the last sync (compressed by `compression`, with error feedback) and take an
    outer step with it (Nesterov SGD at outer_learning_rate and outer_momentum; outer_momentum=0: the
    averaged change itself, scaled). Bytes per inner step: one exchange of the model every `sync_every` steps.

    Use BroadcastGlobalVariablesCallback(0) so all ranks start alike, and callbacks.Consensus() where the model
    is evaluated or saved between syncs. Returns the same optimizer object, wrapped in place; model files save
    it as "hvd_compress>DiLoCo" and both loaders give it back with theta and the outer momentum.
    """
    refuse_loss_scale_optimizer(optimizer, "hvd_compress.DiLoCo")
    keras_of(optimizer)
    refuse_wrapped(optimizer)
    if getattr(optimizer, "gradient_accumulation_steps", None):
        raise ValueError("gradient_accumulation_steps is not supported with hvd_compress.DiLoCo: create the inner "
                         "optimizer without it (each inner step already trains on this rank's batch alone).")
    outer = OuterStep(sync_every, outer_learning_rate, outer_momentum, nesterov, compression, error_decay,
                      process_set, min_compress_size, fusion_threshold_bytes, name=f"hc.diloco.{type(optimizer).__name__}")
    settings = dict(sync_every=sync_every, outer_learning_rate=outer.learning_rate, outer_momentum=outer.momentum,
                    nesterov=nesterov, compression=outer.exchange.compression, error_decay=outer.error_decay,
                    process_set=process_set, min_compress_size=min_compress_size,
                    fusion_threshold_bytes=fusion_threshold_bytes)
    wrapped = wrap_in_place(optimizer, _DiLoCoMixin)
    wrapped._hc_init(outer, settings)
    return wrapped
