"""hvd_compress.DistributedOptimizer: compressed gradient exchange with error feedback.

A drop-in for `horovod.tensorflow.keras.DistributedOptimizer` (same keyword
arguments) for Keras 3 and tf_keras optimizers, in `model.fit` and in custom
loops (hvd_compress/keras_compat.py: how each Keras reaches the wrapper).

The exchange itself, its layout, state and the worker's side of each compressor's update
rule live in gradient_exchange.py; the rules themselves are in compressor.py and each
compressor's module (e.g. onebit.py: dist-EF-SGD).

Keras features (docs/keras_features.md): under a LossScaleOptimizer every rank agrees
on whether a step overflowed (`_hc_agree_on_finiteness`), and a skipped step
leaves all state as it was; clipnorm/clipvalue/global_clipnorm clip each
rank's gradient once, before error feedback; sparse gradients are densified;
variables with a None gradient are left alone (zeros travel in their place);
state of float16/bfloat16 variables is float32. Where the learning rate is inside the
exchange (momentum in front under SGD) SGD's own update is bypassed for compressed
tensors and the exchanged delta is subtracted; everywhere else the mean is handed to the
wrapped optimizer as the gradient (Keras SGD's update in TensorFlow's fused kernels, the
same bits: keras_compat.fused_sgd_update).
"""
import logging
import os

import numpy as np
import tensorflow as tf
from tensorflow.python.ops import control_flow_util

import horovod.tensorflow as hvd
from hvd_compress import exchange, ops, state, uneven
from hvd_compress.auto import AutoCompression, refuse_outside_distributed_optimizer
from hvd_compress.compression import Compression
from hvd_compress.compressor import MOMENTUM_IN_FRONT
from hvd_compress.compression import from_config as compression_from_config, to_config as compression_config
from hvd_compress.gradient_exchange import (DEFAULT_FUSION_THRESHOLD_BYTES, DEFAULT_MIN_COMPRESS_SIZE,
                                            GradientExchange, refuse_two_way, variable_name)
from hvd_compress.keras_compat import (WrapperCore, adam_classes, is_distributed, is_keras3, keras3, keras_of,
                                       kerases_in_use, loss_scale_optimizer_classes, refuse_saved_process_set,
                                       refuse_wrapped, register_loader, register_loaders, rewrapping, saved_process_set,
                                       sgd_classes, tf_keras, wrap_in_place)
from hvd_compress.state import safe_name

#: hvd reductions a model file names
REDUCE_OPS = ("Average", "Sum", "Adasum", "Min", "Max", "Product")
#: Steps between the checks that the weights an optimizer updated from compressed gradients are finite.
FINITE_CHECK_EVERY = 10
log = logging.getLogger("hvd_compress")


def refuse_loss_scale_optimizer(optimizer, wrapper):
    if isinstance(optimizer, loss_scale_optimizer_classes()):
        raise TypeError(f"{wrapper} cannot wrap a LossScaleOptimizer: loss scaling must see the exchanged "
                        f"step. Wrap the other way, keras.mixed_precision.LossScaleOptimizer("
                        f"{wrapper}(optimizer)), or let model.compile() add it under a mixed_float16 policy.")


def refuse_xla(owner):
    """At trace time: Horovod's collectives have no XLA kernels (on CPU), so a jit-compiled step
    fails deep inside; say so where the user can fix it."""
    if control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()):
        raise ValueError(f"{owner} runs Horovod collectives, which XLA cannot compile: use "
                         "model.compile(..., jit_compile=False) (or tf.function(jit_compile=False)).")


class _DistributedOptimizerMixin(WrapperCore):
    """Methods mixed into a subclass of the user's optimizer class (as Horovod does), after the
    entry point of its Keras (keras_compat.TfKerasEntry or Keras3Entry); the user's instance
    becomes an instance of that class (keras_compat.wrap_in_place)."""

    saved_name = "DistributedOptimizer"

    def _hc_init(self, exchange_, backward_passes_per_step, average_aggregated_gradients, settings):
        # Not tracked as a module: its replicated state is optimizer variables, and its per-rank
        # state is tracked below (RANK_STATE), checkpoints only.
        object.__setattr__(self, "_hc_exchange", exchange_)
        object.__setattr__(self, "_hc_saved_settings", settings)
        self._hc_backward_passes = backward_passes_per_step
        self._hc_average_aggregated = average_aggregated_gradients

    def _hc_settings(self):
        """DistributedOptimizer's keyword arguments as JSON data (for model files)."""
        settings = dict(self._hc_saved_settings)
        if settings["warmup_steps"] is None and self._hc_exchange.traced:
            # 1-bit Adam's warm-up as chosen at its first step (it follows that model.fit's length): kept
            settings["warmup_steps"] = self._hc_exchange.warmup_steps or None
        settings["compression"] = compression_config(settings["compression"])
        settings["op"] = next((name for name in REDUCE_OPS if getattr(hvd, name) == settings["op"]), settings["op"])
        settings["process_set_ranks"] = saved_process_set(settings.pop("process_set"))
        return settings

    @staticmethod
    def factory(optimizer, compression, op, process_set_ranks=None, **settings):
        """DistributedOptimizer from the settings _hc_settings saved."""
        if process_set_ranks is not None and "process_set" not in settings:  # (hvd_compress.load_model's may be)
            refuse_saved_process_set(process_set_ranks, "DistributedOptimizer")
        two_way = settings.pop("two_way", None)  # files written before two_way became onebit's own argument
        if isinstance(compression, dict):
            if two_way is not None and compression["name"] == "onebit":
                compression = dict(compression, arguments={**compression.get("arguments", {}), "two_way": two_way})
            compression = compression_from_config(compression)
        return DistributedOptimizer(optimizer, compression=compression,
                                    op=getattr(hvd, op) if isinstance(op, str) else op, **settings)

    @property
    def hc_process_set(self):
        return self._hc_exchange.process_set

    def hc_plan_fit(self, end_step):
        """1-bit Adam's default warm-up follows the fit's length (GradientExchange.plan_fit)."""
        self._hc_exchange.plan_fit(end_step)

    @property
    def bytes_per_step(self):
        return self._hc_exchange.bytes_sent

    @property
    def compression_exchange(self):
        """The GradientExchange (layout, bytes per step, residuals); built at the first step."""
        return self._hc_exchange

    def _trackable_children(self, save_type="checkpoint", **kwargs):
        # Per-rank and sharded state: in checkpoints, with its owner; never in optimizer.variables
        # (which Horovod broadcasts) nor in model files.
        return state.checkpoint_children(super()._trackable_children(save_type, **kwargs),
                                        self._hc_exchange.rank_state, save_type)

    def _hc_agree_on_finiteness(self, grads):
        """Before a LossScaleOptimizer checks for an overflow: every rank agrees on whether the
        step is finite (the exchange itself runs in the step)."""
        return exchange.agree_on_finiteness(grads, self._hc_exchange.process_set,
                                            f"{self._hc_exchange.collective_name}.finite")

    def _clip_gradients(self, grads):
        """The wrapped optimizer's clipping, turned off where it would clip the exchanged result:
        _hc_apply clips each rank's gradient before the exchange, once (docs/keras_features.md, "Clipping")."""
        return grads

    def build(self, var_list):
        """Keras's build of the wrapped optimizer, then the exchange's plan and state, eagerly (Keras 3's
        LossScaleOptimizer builds its inner optimizer inside the traced step, and the state must outlive
        that trace)."""
        var_list = list(var_list)
        if not var_list:  # Keras 3's .h5 loader builds with a Sequential's own (no) variables: wait for the step's
            return
        with tf.init_scope():
            super().build(var_list)
            if not self._hc_exchange.built:
                self._hc_build_exchange(var_list)

    def _hc_build_exchange(self, var_list):
        self._hc_exchange.accumulate = self._hc_backward_passes > 1
        self._hc_exchange.build(
            list(var_list), holder=self, optimizer=self,
            new_replicated=lambda spec: self.add_variable(
                spec.shape, dtype=spec.dtype, initializer=lambda shape, dtype: spec.initial_value(),
                name=f"hc_{safe_name(spec.name)}"))
        if self._hc_backward_passes > 1:
            # Replicated: a variable, so AccordionBatchSize can change it between steps without a retrace.
            self._hc_passes_per_step = self.add_variable(
                [], dtype=tf.int64, name="hc_passes_per_step",
                initializer=lambda shape, dtype: tf.fill(shape, tf.cast(self._hc_backward_passes, dtype)))

    @property
    def hc_auto(self):
        """The Compression.auto() this optimizer was made with while it has not decided (it decides in model.fit's
        hvd_compress callbacks, or in a custom loop's auto.train_step), else None."""
        compression = self._hc_saved_settings["compression"]
        return compression if isinstance(compression, AutoCompression) else None

    def hc_switch_compression(self, compression, variables):
        """Between two steps, on every rank at once (Compression.auto's choice): the exchange made anew for
        `compression` with this optimizer's settings, planned and its state created now, for `variables` (the model's
        trainable ones, in the order of its steps); the caller retraces the step. The compression is then what model
        files save."""
        old, settings = self._hc_exchange, self._hc_saved_settings
        new = GradientExchange(compression, settings["process_set"], settings["op"],
                               settings["gradient_predivide_factor"], settings["sparse_as_dense"],
                               settings["min_compress_size"], settings["fusion_threshold_bytes"],
                               name=old.collective_name, warmup_steps=settings["warmup_steps"],
                               hierarchical=settings["hierarchical"])
        new.settle(self)
        check_compression_fits(self, new.compression)
        new.fit_end = old.fit_end
        object.__setattr__(self, "_hc_exchange", new)
        object.__setattr__(self, "_hc_saved_settings", dict(settings, compression=new.compression))
        with tf.init_scope():
            self._hc_build_exchange(list(variables))

    def hc_replan(self):
        """After an elastic reset, on every rank (hvd_compress.elastic.KerasState calls it): plans the
        exchange for the new world (GradientExchange.replan)."""
        if self._hc_exchange.built:
            self._hc_exchange.replan()

    def _hc_allow_passes_up_to(self, passes):
        """For AccordionBatchSize (before the first step): accumulate up to `passes` backward passes
        per step, summed, so that k passes give the k-times-larger batch's step at k times the
        learning rate (the linear scaling rule)."""
        if self._hc_exchange.built:
            raise ValueError("AccordionBatchSize must be in the callbacks of the first model.fit of a new "
                             "or freshly loaded optimizer (it creates the accumulators at the first step).")
        if self._hc_backward_passes != 1:
            raise ValueError("AccordionBatchSize sets the backward passes per step itself; create the "
                             "optimizer with backward_passes_per_step=1.")
        self._hc_backward_passes, self._hc_average_aggregated = passes, False

    def set_backward_passes_per_step(self, passes):
        """Between steps: how many backward passes (micro-batches) the next steps accumulate."""
        self._hc_passes_per_step.assign(passes)

    def _hc_step(self, pairs):
        """Exchanges and applies (what the entry point of either Keras calls). Variables missing
        from `pairs` or with a None gradient are left alone, as Keras does."""
        refuse_xla("hvd_compress.DistributedOptimizer")
        object.__setattr__(self, "_hc_stepped", True)
        with tf.init_scope():
            self.build([v for _, v in pairs])
        grads, variables = self._hc_exchange.arrange(pairs, "hvd_compress.DistributedOptimizer")
        if self.hc_auto is not None:  # (calibrating: a step traced now must not run after auto decides)
            grads = self.hc_auto.guard_step(grads, [v for v in variables if v is not None] + [self.iterations])
        if self._hc_backward_passes == 1:
            return self._hc_apply(grads, variables)
        return self._hc_apply_every_k_passes(grads, variables)

    def _hc_apply_every_k_passes(self, grads, variables):
        """Accumulates gradients locally; exchanges and applies them every k-th pass."""
        exchange_ = self._hc_exchange
        absent = [g is None for g in grads]
        for acc, g in zip(exchange_.accumulated, exchange_.prepare(grads)):
            acc.assign_add(tf.cast(g, acc.dtype))
        passes = exchange_.passes.assign_add(1)

        def apply():
            scale = 1.0 / tf.cast(passes, tf.float32) if self._hc_average_aggregated else 1.0
            self._hc_apply([None if skip else acc * tf.cast(scale, acc.dtype)
                            for acc, skip in zip(exchange_.accumulated, absent)], variables)
            for acc in exchange_.accumulated:
                acc.assign(tf.zeros_like(acc))
            exchange_.passes.assign(0)
            return tf.constant(True)

        tf.cond(passes >= self._hc_passes_per_step, apply, lambda: tf.constant(False))
        return self.iterations

    def _hc_apply(self, grads, variables):
        """grads, variables: in the planned order, None for those left alone this step."""
        direct = self._hc_exchange.rule.applies_step  # the rule subtracts its own deltas: Keras's apply is skipped
        grads = self._hc_clip(grads)
        results = self._hc_exchange(
            grads, learning_rate=tf.cast(self._hc_learning_rate(), tf.float32) if direct else None,
            momentum=float(getattr(self, "momentum", 0.0)), nesterov=bool(getattr(self, "nesterov", False)),
            step=self.iterations)
        compressed = set(self._hc_exchange.layout.compressed) if direct else set()
        applied = [(i, r, v) for i, (r, v) in enumerate(zip(results, variables)) if r is not None]
        deltas = [(r, v) for i, r, v in applied if i in compressed]
        passed_on = [(r, v) for i, r, v in applied if i not in compressed]
        if deltas:
            with tf.name_scope("hc_state_update"):
                for delta, v in deltas:
                    self._hc_take_step(v, delta)
                    if v.constraint is not None:
                        v.assign(v.constraint(v))
        if not passed_on:
            return self.iterations.assign_add(1)
        iteration = self._hc_wrapped_apply(passed_on)
        decompressed = [] if direct else [v for i, _, v in applied if i in self._hc_exchange.layout.slot]
        if decompressed:
            self._hc_check_finite(decompressed)
        return iteration

    def _hc_take_step(self, variable, delta):
        """x -= delta after Keras's decoupled weight decay (x -= x wd lr where the optimizer decays x): one pass
        (ops.decay_and_subtract) for a float32 variable and a dense delta; else Keras's decay, then exchange.subtract
        (an EncodedPart is decoded straight into the variable)."""
        if isinstance(delta, exchange.EncodedPart) or tf.as_dtype(variable.dtype) != tf.float32:
            self._apply_weight_decay([variable])
            return exchange.subtract(variable, delta)
        decays = self.weight_decay is not None and self._use_weight_decay(variable)
        rate = tf.cast(self.weight_decay, tf.float32) * tf.cast(self.learning_rate, tf.float32) if decays else 0.0
        return ops.decay_and_subtract(variable, delta, rate)

    def _hc_check_finite(self, variables):
        """After the wrapped optimizer applied decompressed gradients, at its first step and every
        FINITE_CHECK_EVERY steps: their variables must be finite. A non-finite gradient, or a compressed
        gradient the optimizer cannot take (sparse, or low-rank), would otherwise turn weights into NaN
        in silence. One sum per variable (about 15 ms for 25M float32 weights on one core, so not at
        every step); under a LossScaleOptimizer an overflowed step never gets here."""
        def check():
            sums = tf.stack([tf.reduce_sum(tf.cast(v, tf.float32)) for v in variables])
            tf.debugging.Assert(tf.reduce_all(tf.math.is_finite(sums)), [
                f"hvd_compress: weights became non-finite after {self._hc_base.__name__} applied gradients "
                f"exchanged with {self._hc_exchange.compression!r} (checked at the optimizer's step", self.iterations,
                f"; the sum of each compressed variable's weights, {', '.join(variable_name(v) for v in variables)}:",
                sums, "). Either a gradient was non-finite (under mixed precision a LossScaleOptimizer skips such "
                f"steps; else clip, or fix the loss), or {self._hc_base.__name__} cannot take this compression's "
                "gradients (sparse or low-rank): use another compression with it."], summarize=len(variables))
            return tf.constant(True)

        tf.cond(tf.math.floormod(self.iterations - 1, FINITE_CHECK_EVERY) == 0, check, lambda: tf.constant(False))

    def _hc_clip(self, grads):
        """clipnorm, clipvalue or global_clipnorm of the wrapped optimizer, on this rank's gradients
        (None: left alone), before error feedback: what is clipped is what a single machine would
        clip, and nothing the exchange holds back is clipped again later."""
        present = [g for g in grads if g is not None]
        clipped = iter(super()._clip_gradients([tf.convert_to_tensor(g) for g in present]))
        return [None if g is None else next(clipped) for g in grads]


register_loader(_DistributedOptimizerMixin)


def DistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="",
                         compression=Compression.none, sparse_as_dense=False,
                         gradient_predivide_factor=1.0, op=hvd.Average, backward_passes_per_step=1,
                         average_aggregated_gradients=False, num_groups=0, groups=None,
                         process_set=hvd.global_process_set, scale_local_gradients=True,
                         min_compress_size=DEFAULT_MIN_COMPRESS_SIZE,
                         fusion_threshold_bytes=DEFAULT_FUSION_THRESHOLD_BYTES, warmup_steps=None, two_way=None,
                         hierarchical=False):
    """Wraps a Keras optimizer (Keras 3, or tf_keras) so gradients are averaged across ranks,
    compressed.

    Takes Horovod's keyword arguments (device_dense, device_sparse, num_groups,
    groups and scale_local_gradients are accepted for compatibility; the
    layout here is fixed by `fusion_threshold_bytes`) plus:
      compression: a `hvd_compress.Compression` (none, fp16, onebit(), quantize(),
        topk(), randomk(), powersgd(), sketch()); its own options (e.g. onebit's
        two_way) are its arguments.
      min_compress_size: tensors with fewer elements travel uncompressed.
      fusion_threshold_bytes: the largest compressed bucket.
      warmup_steps: the first steps travel at full precision (a float32 allreduce), then
        compression starts. Under Adam or AdamW, onebit and sketch (momentum in front) train
        1-bit Adam (its warm-up fills Adam's variance, which is then frozen; None: the learning-rate
        schedule's warm-up if it has one, else 10% of the steps the first model.fit plans (told by
        hvd_compress's callbacks), else 1 / (1 - beta_2) steps, 1000 by default; the choice is kept in
        model files); elsewhere None means 0. A warm-up that covers a whole model.fit is reported.
      hierarchical: on hosts of several ranks, average inside each host at full precision and
        compress only across hosts (exchange.Hierarchical): each host sends one compressed payload
        where the flat exchange sends one per rank. Needs the same number of ranks on every host and
        Horovod's dynamic process sets (hvd.init(process_sets="dynamic")).
    Returns the same optimizer object, now an instance of a subclass of its
    class: everything it holds (settings outside its config, trained slots and
    step count, callables, schedules) is kept. Model files save it under the
    registered name "hvd_compress>DistributedOptimizer" with the wrapped
    optimizer's config and these settings, so keras.models.load_model (either
    Keras, .keras, .h5 and SavedModel) and hvd_compress.load_model give it
    back distributed (hvd.init() first).
    """
    refuse_loss_scale_optimizer(optimizer, "hvd_compress.DistributedOptimizer")
    refuse_two_way(two_way)
    keras_of(optimizer)
    refuse_wrapped(optimizer)
    if isinstance(backward_passes_per_step, bool) or not isinstance(backward_passes_per_step, int) \
            or backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step must be an integer >= 1, got "
                         f"{backward_passes_per_step!r}.")
    if is_keras3(optimizer) and optimizer.gradient_accumulation_steps:
        raise ValueError("gradient_accumulation_steps would accumulate after the exchange; create the "
                         "optimizer without it and give hvd_compress.DistributedOptimizer "
                         f"backward_passes_per_step={optimizer.gradient_accumulation_steps} instead.")
    exchange_ = GradientExchange(compression, process_set, op, gradient_predivide_factor,
                                 sparse_as_dense, min_compress_size, fusion_threshold_bytes,
                                 name=name or f"hc.{type(optimizer).__name__}", warmup_steps=warmup_steps,
                                 hierarchical=hierarchical)
    exchange_.settle(optimizer)  # (before the settings model files save)
    check_compression_fits(optimizer, exchange_.compression)
    if isinstance(exchange_.compression, AutoCompression) and not (hvd.is_initialized() and hvd.rank() != 0):
        log.info("hvd_compress: %r trains at full precision for %d steps, then chooses; it decides in hvd_compress's "
                 "callbacks of model.fit (BroadcastGlobalVariablesCallback, MetricAverageCallback) or in a custom "
                 "loop's auto.train_step (a step that nothing times is refused).", exchange_.compression,
                 exchange_.compression.calibration_steps)
    settings = dict(name=name, compression=exchange_.compression, sparse_as_dense=sparse_as_dense,
                    gradient_predivide_factor=gradient_predivide_factor, op=op,
                    backward_passes_per_step=backward_passes_per_step,
                    average_aggregated_gradients=average_aggregated_gradients, process_set=process_set,
                    min_compress_size=min_compress_size,
                    fusion_threshold_bytes=fusion_threshold_bytes, warmup_steps=warmup_steps,
                    hierarchical=hierarchical)
    wrapped = wrap_in_place(optimizer, _DistributedOptimizerMixin)
    wrapped._hc_init(exchange_, backward_passes_per_step, average_aggregated_gradients, settings)
    return wrapped


def check_compression_fits(optimizer, compression):
    """The refusals and warnings of `compression` under `optimizer`, when it wraps (and when Compression.auto's
    choice replaces its compression)."""
    if compression.requires_optimizer and getattr(optimizer, "use_ema", False):
        raise ValueError("use_ema=True is not supported with a stateful compressor; turn it off.")
    refuse_sparse_updates_to_factored_moments(optimizer, compression)
    warn_momentum_in_front_under_other_optimizers(optimizer, compression)
    warn_measured_losses_under_adam(optimizer, compression)


def warn_momentum_in_front_under_other_optimizers(optimizer, compression):
    """onebit and sketched SGD have a rule for SGD (momentum in front) and for Adam and AdamW (1-bit
    Adam); under any other optimizer they compress the gradient with error feedback, and an adaptive
    optimizer's statistics are then built from compressed gradients: the failure 1-bit Adam exists for
    (the gradient's signs under AdamW lost 21 points on the transformer, docs/algorithms.md). Said once,
    on rank 0, when the optimizer is wrapped."""
    if (compression.update_rule != MOMENTUM_IN_FRONT or isinstance(optimizer, sgd_classes() + adam_classes())
            or (hvd.is_initialized() and hvd.rank() != 0)):
        return
    log.warning("hvd_compress: %r has an update rule for SGD (momentum in front) and for Adam and AdamW (1-bit "
                "Adam); under %s it compresses the gradient itself, and an adaptive optimizer's statistics are then "
                "built from compressed gradients, which loses accuracy. Use SGD, Adam or AdamW with it, or "
                "Compression.quantize() or Compression.powersgd() with %s.", compression, type(optimizer).__name__,
                type(optimizer).__name__)


def warn_measured_losses_under_adam(optimizer, compression):
    """What a compressor measured under Adam and AdamW where it loses accuracy there (its `under_adam`),
    said once, on rank 0, when it wraps one."""
    note = getattr(compression, "under_adam", None)
    if note and isinstance(optimizer, adam_classes()) and not (hvd.is_initialized() and hvd.rank() != 0):
        log.warning("hvd_compress: under %s, %s. Compression.onebit() (1-bit Adam) and Compression.quantize(bits=8) "
                    "kept AdamW's accuracy there; else give a larger ratio or rank and warmup_steps= (Adam's variance is "
                    "then frozen after the warm-up; docs/algorithms.md, 'Which compression under which optimizer').",
                    type(optimizer).__name__, note)


def refuse_sparse_updates_to_factored_moments(optimizer, compression):
    """Adafactor's factored second moment divides by the mean of each row and column of the
    squared gradient: a compressed gradient that is zero on whole rows (top-k, random-k, sketch
    send a few coordinates: their `sparse_update`) makes those 0/0 and the weights NaN."""
    factored = [keras.optimizers.Adafactor for keras in kerases_in_use() if hasattr(keras.optimizers, "Adafactor")]
    if isinstance(optimizer, tuple(factored)) and getattr(compression, "sparse_update", False):
        raise ValueError(f"{compression!r} sends a few coordinates of each gradient, and Adafactor's factored "
                         "second moment divides by the mean of every row and column of the squared gradient, "
                         "which such a gradient leaves zero: the weights would become NaN. Use "
                         "Compression.onebit() or Compression.powersgd() with Adafactor, or Adam(W) with a "
                         "sparsifying compression.")


class DistributedGradientTape:
    """Wraps a tf.GradientTape so `gradient()` returns gradients averaged across ranks, compressed.

    Takes hvd.DistributedGradientTape's keyword arguments. Stateless
    compressions (none, fp16) need nothing else. Stateful ones keep error
    feedback across steps, so their state must outlive the tape, which a
    custom loop creates every step: make `exchange = hc.GradientExchange(
    compression)` once and pass `exchange=exchange` (and put it
    in your tf.train.Checkpoint). The rule is plain error feedback on
    gradients, a = g + e, D = C(a), e = a - D; your optimizer applies the mean.
    The exchange counts its steps itself (`own_steps`, checkpointed with it),
    for what is drawn anew each step: random-k's coordinates, the sketches' hashes.
    """

    def __init__(self, gradtape, device_dense="", device_sparse="", compression=Compression.none,
                 sparse_as_dense=False, op=hvd.Average, gradient_predivide_factor=1.0, num_groups=0,
                 groups=None, process_set=hvd.global_process_set, exchange=None, two_way=None):
        refuse_two_way(two_way)
        refuse_outside_distributed_optimizer(getattr(exchange, "compression", compression),
                                             "hc.DistributedGradientTape(compression=... or exchange=...)")
        if exchange is None:
            exchange = GradientExchange(compression, process_set, op, gradient_predivide_factor,
                                        sparse_as_dense, name="hc.tape")
            if exchange.compression.requires_optimizer:
                raise ValueError(
                    f"{exchange.compression!r} keeps error-feedback state across steps, and a tape "
                    "lives for one step. Create `exchange = hvd_compress.GradientExchange(compression)` "
                    "once, outside the loop, and pass exchange=exchange.")
        self._tape, self.exchange = gradtape, exchange

    def gradient(self, target, sources, output_gradients=None, **kwargs):
        grads = self._tape.gradient(target, sources, output_gradients, **kwargs)
        variables = tf.nest.flatten(sources)
        with tf.init_scope():
            self.exchange.build(variables)
        arranged, _ = self.exchange.arrange(zip(tf.nest.flatten(grads), variables), "A GradientExchange")
        with uneven.for_process_set(self.exchange.process_set).first_in_step(arranged):
            exchanged = self.exchange(arranged)
        position = {vid: i for i, vid in enumerate(self.exchange.variable_ids)}
        return tf.nest.pack_sequence_as(grads, [exchanged[position[id(v)]] for v in variables])

    def __getattr__(self, name):
        return getattr(self._tape, name)


def load_model(filepath, compression=None, custom_optimizers=None, custom_objects=None, optimizer_wrapper=None,
               **distributed_kwargs):
    """Loads a Keras model file (rank 0's, on every rank) with its optimizer distributed; call
    hvd.init() first. Like horovod.tensorflow.keras.load_model, in either Keras:

    - a file saved with an hvd_compress wrapper (DistributedOptimizer, PushSumOptimizer) comes
      back with it and its saved settings, as keras.models.load_model gives it too; `compression`
      and `distributed_kwargs` replace saved settings of a DistributedOptimizer;
    - a file with a plain Keras optimizer (Horovod's wrapper saves as plain too) comes back with
      that optimizer wrapped in place, as DistributedOptimizer(optimizer, compression (default
      Compression.none), **distributed_kwargs), keeping what Keras restored into it;
    - optimizer_wrapper(optimizer), when given (e.g. hvd_compress.PushSumOptimizer), replaces the
      wrapper in both cases.
    custom_optimizers: optimizer classes the file names, as Horovod's argument (equivalent to
    custom_objects keyed by class name). A `.keras` or `.h5` file is read by the Keras that wrote it
    (both record their version), a SavedModel directory by tf_keras; a missing, truncated or
    unknown file gets an error naming the path and the fix.

    A model file holds the model and the optimizer's replicated state (the wrapped optimizer's
    slots, PowerSGD's Q, Accordion's history), not the per-rank and sharded state (error-feedback
    residuals, worker momenta, server-residual shards, PushSum's weight), which starts from zero;
    rank 0 logs one line saying so. Per-rank checkpoints (tf.train.Checkpoint, save_weights in the
    TF format) resume exactly.
    """
    keras = keras_of_file(filepath)
    register_loaders()  # a Keras imported after hvd_compress
    objects = {cls.__name__: cls for cls in custom_optimizers or []}
    objects.update(custom_objects or {})
    overrides = dict(distributed_kwargs, **({} if compression is None else {"compression": compression}))

    def wrap(optimizer):  # a plain optimizer
        if optimizer_wrapper is not None:
            return optimizer_wrapper(optimizer)
        return DistributedOptimizer(optimizer, **{"compression": Compression.none, **overrides})

    def rewrap(optimizer, factory, settings):  # a wrapper the file saved
        if optimizer_wrapper is not None:
            return optimizer_wrapper(optimizer)
        if factory is _DistributedOptimizerMixin.factory:
            return factory(optimizer, **{**settings, **overrides})
        if overrides:
            raise ValueError(f"This file's optimizer is not a DistributedOptimizer, so {sorted(overrides)} do not "
                             "apply; leave them out, or give optimizer_wrapper=.")
        return factory(optimizer, **settings)

    with rewrapping(rewrap):
        model = keras.models.load_model(filepath, custom_objects=objects)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and not is_distributed(optimizer):
        inner = getattr(optimizer, "inner_optimizer", optimizer)
        if wrap(inner) is not inner:  # the model holds `inner`: it must be wrapped in place
            raise ValueError("optimizer_wrapper must wrap the optimizer it is given in place and return it (as "
                             "hvd_compress.DistributedOptimizer and PushSumOptimizer do), not a new object.")
    if optimizer is not None and str(filepath).endswith((".h5", ".hdf5")):
        restore_h5_optimizer_state(keras, model, filepath)
    variables = os.path.join(str(filepath), tf.saved_model.VARIABLES_DIRECTORY,
                             tf.saved_model.VARIABLES_FILENAME)
    if tf.io.gfile.exists(variables + ".index"):
        # SavedModel format: Keras binds the saved optimizer state to its own restored optimizer,
        # not to this new one, so restore it here; the slots created at the first step are
        # filled in then (deferred restoration).
        tf.train.Checkpoint(root=model).restore(variables).expect_partial()
    if not str(filepath).endswith(".keras"):  # for .keras, Keras 3 calls the optimizer's load_own_variables
        state.note_model_file(filepath)
    return model


def restore_h5_optimizer_state(keras, model, filepath):
    """The optimizer state of an .h5 file, which Keras's loaders drop in two cases (each with a
    warning): Keras 3's builds the optimizer for the model's own variables (none, for a Sequential or
    Functional model: its layers hold them), and tf_keras's sets a LossScaleOptimizer's weights
    through its inner optimizer, which has fewer. Here the optimizer is built for the trainable
    variables and gets every saved value."""
    if keras.__name__ == "keras":
        from keras.src.legacy.saving.legacy_h5_format import load_optimizer_weights_from_hdf5_group
    else:
        from tf_keras.src.saving.legacy.hdf5_format import load_optimizer_weights_from_hdf5_group
    import h5py
    with h5py.File(str(filepath), "r") as f:
        if "optimizer_weights" not in f:
            return
        values = [np.asarray(v) for v in load_optimizer_weights_from_hdf5_group(f)]
    getattr(model.optimizer, "inner_optimizer", model.optimizer).build(model.trainable_variables)
    variables = model.optimizer.variables  # a LossScaleOptimizer's and its inner optimizer's, as saved
    variables = variables() if callable(variables) else variables
    if len(variables) != len(values):  # another compression's state, or Keras 3's Nadam (its u_product)
        log.warning("hvd_compress: %s holds %d optimizer variables and this optimizer has %d; the optimizer keeps "
                    "what Keras's loader restored into it, if anything.", filepath, len(values), len(variables))
        return
    for variable, value in zip(variables, values):
        variable.assign(value)


def keras_version_of_archive(path):
    """The Keras version a .keras archive records (metadata.json: Keras 3 and tf_keras both write one), or an
    error naming the file where it is not such an archive."""
    import json
    import zipfile
    try:
        with zipfile.ZipFile(tf.io.gfile.GFile(path, "rb")) as archive:
            return str(json.loads(archive.read("metadata.json"))["keras_version"])
    except (zipfile.BadZipFile, KeyError, ValueError) as error:
        raise ValueError(f"{path!r} is not a complete .keras archive ({error}); it may be truncated or corrupted "
                         "(a save interrupted, a copy cut short): load an earlier checkpoint, or write it again."
                         ) from None


def keras_of_file(filepath):
    """The Keras that reads a model file: the writer's for .keras and .h5 (each records its Keras version),
    tf_keras for a SavedModel directory. A path that is missing or not a model file gets an error saying which."""
    path = str(filepath)
    if not tf.io.gfile.exists(path):
        raise FileNotFoundError(f"No model file at {path!r}: check the path (and that rank 0's file is where every "
                                "rank can read it).")
    if path.endswith(".keras"):
        version = keras_version_of_archive(path)
    elif path.endswith((".h5", ".hdf5")):
        import h5py
        try:
            with h5py.File(path, "r") as f:
                version = f.attrs.get("keras_version", b"2")
        except OSError as error:
            raise ValueError(f"{path!r} is not a readable HDF5 file ({error}); it may be truncated or corrupted: "
                             "load an earlier checkpoint, or write it again.") from None
        version = version.decode() if isinstance(version, bytes) else str(version)
    elif tf.io.gfile.isdir(path) and tf.io.gfile.exists(os.path.join(path, tf.saved_model.SAVED_MODEL_FILENAME_PB)):
        version = "2"
    else:
        raise ValueError(f"{path!r} is not a Keras model file: load_model reads a .keras file, an .h5 file or a "
                         "SavedModel directory (for weights alone, build the model and call model.load_weights).")
    if version.startswith("3"):
        return keras3()
    if tf_keras() is None:
        raise ValueError(f"{path} is a tf_keras file ({version}); install tf_keras to load it.")
    return tf_keras()
