"""hvd_compress.DistributedOptimizer: compressed gradient exchange with error feedback.

A drop-in for `horovod.tensorflow.keras.DistributedOptimizer` (same keyword
arguments) for Keras 3 and tf_keras optimizers, in `model.fit` and in custom
loops (hvd_compress/keras_compat.py: how each Keras reaches the wrapper).

Layout. At the first step the trainable variables are split into
- compressed: float tensors of at least `min_compress_size` elements, fused in
  order into buckets of at most `fusion_threshold_bytes` (one payload and one
  or two collectives per bucket per step);
- dense: the rest (biases, integer tensors), averaged uncompressed by one
  grouped allreduce, with the chosen Horovod compression (none/fp16).
Every rank checks, before the first collective, that all ranks have the same
compression settings and variables (a clear error instead of a hang).

State. Replicated state (the wrapped optimizer's slots, PowerSGD's Q,
Accordion's history) is optimizer variables: Horovod's broadcasts, elastic
sync and model files carry it. Per-rank and sharded state (residuals,
momenta, server-residual shards) is kept apart, in checkpoints only, with the
rank and world size it belongs to; a restore onto another rank or world size
starts it afresh, and rank 0 logs one line (hvd_compress/state.py).

Keras features (docs/design.md): under a LossScaleOptimizer every rank agrees
on whether a step overflowed (`_hc_agree_on_finiteness`), and a skipped step
leaves all state as it was; clipnorm/clipvalue/global_clipnorm clip each
rank's gradient once, before error feedback; sparse gradients are densified;
variables with a None gradient are left alone (zeros travel in their place);
state of float16/bfloat16 variables is float32.

Update rules:
- onebit under SGD (with or without momentum, Nesterov or not): dist-EF-SGD
  (Zheng, Huang, Kwok, NeurIPS 2019).
  Momentum moves in front of the compressor and the learning rate inside the
  compressed quantity; SGD's own update is bypassed for compressed tensors:
      m_i = mu m_i + g_i;   p_i = mu m_i + g_i (Nesterov) or m_i
      a_i = lr_t p_i + e_i;  D_i = C(a_i);  e_i = a_i - D_i        (worker EF)
      two-way:  A = mean_i D_i + e_s;  D = C(A);  e_s = A - D      (server EF)
      one-way:  D = mean_i D_i
      x = x - D
  The residuals e_i and e_s hold learning-rate-scaled quantities. Where the
  paper leaves them alone when the rate changes, here both are multiplied by
  lr_t / lr_{t-1} (in the same pass), so old-rate leftovers do not leak into
  the weights after a drop (measured: GradientExchange._residual_scale).
- sketch under SGD: sketched SGD (Ivkin et al., NeurIPS 2019), the same
  rule with a = lr u + e where u is the worker's momentum, e zeroed where the
  update was applied and u too unless mask_momentum=False (hvd_compress/sketch.py).
- Everything else (onebit or sketch under Adam etc., top-k, random-k, PowerSGD): plain error
  feedback on gradients, a_i = g_i + e_i, D_i = C(a_i), e_i = a_i - D_i, and
  the mean D (server-compressed again for two-way onebit) is handed to the
  wrapped optimizer as the gradient, which applies its own momentum (Keras
  SGD's update in TensorFlow's fused kernels, the same bits:
  keras_compat.fused_sgd_update).
  Top-k sends (values, int32 indices) by allgather; random-k sends values at
  coordinates every rank draws alike, by allreduce. Both select over a whole
  bucket (global top-k within a bucket, not per layer).
"""
import logging
import os

import numpy as np
import tensorflow as tf
from tensorflow.python.ops import control_flow_util

import horovod.tensorflow as hvd
from hvd_compress import exchange, ops, state
from hvd_compress.accordion import HIGH, LOW, AdaptiveCompression
from hvd_compress.compression import Compression, OneBitCompressor, StatefulCompressor
from hvd_compress.compression import from_config as compression_from_config, to_config as compression_config
from hvd_compress.keras_compat import (WrapperCore, is_distributed, is_keras3, keras3, keras_of, kerases_in_use,
                                       loss_scale_optimizer_classes, refuse_saved_process_set, refuse_wrapped,
                                       register_loader, register_loaders, rewrapping, saved_process_set, sgd_classes,
                                       tf_keras, wrap_in_place)
from hvd_compress.sketch import SketchCompressor
from hvd_compress.state import PER_RANK, REPLICATED, RankLocalState, StateSpec, safe_name

#: hvd reductions a model file names
REDUCE_OPS = ("Average", "Sum", "Adasum", "Min", "Max", "Product")
#: Steps between the checks that the weights an optimizer updated from compressed gradients are finite.
FINITE_CHECK_EVERY = 10
DEFAULT_MIN_COMPRESS_SIZE = 1024
DEFAULT_FUSION_THRESHOLD_BYTES = 16 << 20  # several buckets: one is decoded while the next are on the wire
log = logging.getLogger("hvd_compress")


class Layout:
    """Which variables are compressed, how they are fused into buckets, and the dense rest."""

    def __init__(self, variables, compression, min_compress_size, fusion_threshold_bytes):
        self.shapes = [tuple(tf.TensorShape(v.shape).as_list()) for v in variables]
        self.sizes = [int(np.prod(s, dtype=np.int64)) for s in self.shapes]
        self.compressed, self.dense, self.empty = [], [], []
        for i, (v, size) in enumerate(zip(variables, self.sizes)):
            if size == 0:
                self.empty.append(i)
            elif (compression.requires_optimizer and tf.as_dtype(v.dtype).is_floating and size >= min_compress_size
                  and compression.compresses(self.shapes[i])):
                self.compressed.append(i)
            else:
                self.dense.append(i)
        self.buckets = [[self.compressed[j] for j in bucket] for bucket in
                        exchange.fuse_in_order([4 * self.sizes[i] for i in self.compressed], fusion_threshold_bytes)]
        #: position of a compressed variable among the per-variable slots
        self.slot = {i: position for position, i in enumerate(self.compressed)}

    def bucket_size(self, bucket):
        return sum(self.sizes[i] for i in bucket)


def _new_replicated_variable(spec):
    return tf.Variable(spec.initial_value(), trainable=False, name=f"hc_{safe_name(spec.name)}")


class GradientExchange(tf.Module):
    """The compressed exchange with error feedback, for one fixed list of variables.

    It plans the layout at the first step and creates its state, each piece
    with its scope (hvd_compress/state.py): per-rank and sharded state in a
    RankLocalState (checkpointed with its owner, never broadcast), replicated
    state through the factory `build` is given (optimizer variables for
    DistributedOptimizer, so Horovod's broadcasts and model files see it;
    this module's own variables otherwise). Each step turns local gradients
    into averaged gradients or, for dist-EF-SGD, the parameter deltas D
    (`direct_update`). For custom loops create one, once, and pass it to every
    DistributedGradientTape; checkpoint it with tf.train.Checkpoint(exchange=...).
    After an elastic reset, `replan()` plans for the new world.
    """

    def __init__(self, compression, two_way=True, process_set=hvd.global_process_set, op=hvd.Average,
                 gradient_predivide_factor=1.0, sparse_as_dense=False,
                 min_compress_size=DEFAULT_MIN_COMPRESS_SIZE,
                 fusion_threshold_bytes=DEFAULT_FUSION_THRESHOLD_BYTES, name="hc"):
        super().__init__(name=name.replace(".", "_"))
        compression = _check_arguments(compression, two_way, op, min_compress_size,
                                       fusion_threshold_bytes)
        self.compression, self.two_way, self.process_set = compression, two_way, process_set
        self.op, self.predivide, self.sparse_as_dense = op, gradient_predivide_factor, sparse_as_dense
        self.min_compress_size, self.fusion_threshold_bytes = min_compress_size, fusion_threshold_bytes
        self.collective_name = name
        self.monitor = None  # an accordion.RegimeDetector, fed every step's local gradients
        self.accumulate = False  # True: keeps per-rank sums of micro-batch gradients (backward passes)
        self.built = False
        self.traced = False  # a step was traced (or run eagerly)
        self.recall_totals = None  # [sum of recalls, sum of captured mass, steps] once measure_recall() ran
        self._replicated_variables = []  # this module's replicated state when no factory is given
        object.__setattr__(self, "rank_state", None)  # tracked by the holder (state.track)
        object.__setattr__(self, "agreement", state.RanksAgreement())  # due at the first step of each plan

    def _trackable_children(self, save_type="checkpoint", **kwargs):
        return state.checkpoint_children(super()._trackable_children(save_type, **kwargs),
                                        self.rank_state, save_type)

    @property
    def adaptive(self):
        return isinstance(self.compression, AdaptiveCompression)

    def use_accordion(self, compression, detector):
        """Switches to Accordion's two settings (accordion.AdaptiveCompression) watched by
        `detector`; before the first step, since both settings are planned then."""
        if self.built:
            if repr(compression) == repr(self.compression) and repr(detector) == repr(self.monitor):
                return
            raise ValueError(f"This optimizer already ran a step with {self.compression!r}; Accordion "
                             "plans both of its settings at the first step. Add the callback to the "
                             "first model.fit of a new or freshly loaded optimizer.")
        if self.monitor is not None and repr(detector) != repr(self.monitor):
            raise ValueError(f"This optimizer is already watched by {self.monitor!r}; use one Accordion "
                             "callback (compression or batch size) per optimizer.")
        if isinstance(compression, AdaptiveCompression) and detector.groups != "variable":
            raise ValueError("Adaptive compression follows the regime of each compressed variable: "
                             "it needs a RegimeDetector(groups='variable').")
        self.compression, self.monitor = compression, detector

    # -- planning and state -------------------------------------------------------------
    def build(self, variables, new_replicated=None, holder=None, direct_update=False):
        """Plans the layout and creates the state; direct_update selects dist-EF-SGD's rule.

        new_replicated(spec) -> variable creates replicated state (default: this
        module's variables); holder tracks the per-rank state for checkpoints
        (default: this module).
        """
        if self.built:
            return
        variables = list(variables)
        self.direct_update = direct_update
        # Kept as plain facts, not references: the module must not track the model's variables.
        self.variable_ids = [id(v) for v in variables]
        self.variable_names = [variable_name(v) for v in variables]
        self.variable_dtypes = [tf.as_dtype(v.dtype) for v in variables]
        # Under Accordion every compressed tensor is its own bucket, so each layer switches alone.
        self.layout = Layout(variables, self.compression, self.min_compress_size,
                             1 if self.adaptive else self.fusion_threshold_bytes)
        object.__setattr__(self, "_new_replicated", new_replicated or self._new_module_variable)
        object.__setattr__(self, "_holder", holder or self)
        object.__setattr__(self, "replicated", {})  # name -> variable: created once, kept across worlds
        # A tape brings no step counter, and random-k, PowerSGD without warm start and the sketches
        # draw from the step: an exchange that owns its state counts its own steps. A stateless one
        # (none, fp16) creates no variable, so a tape may make it inside a tf.function.
        self.own_steps = (None if new_replicated or not self.compression.requires_optimizer else
                          self._state_variable(StateSpec("steps", (), REPLICATED, tf.int64), None))
        # dist-EF-SGD's residuals follow the learning rate (_residual_scale): the last step's rate.
        self.previous_learning_rate = (self._state_variable(StateSpec("previous_learning_rate", (), REPLICATED), None)
                                       if direct_update else None)
        self.world = None
        self._plan_world()
        self.built = True

    def _new_module_variable(self, spec):
        variable = _new_replicated_variable(spec)
        self._replicated_variables.append(variable)
        return variable

    def replan(self):
        """After the world changed (an elastic reset): plans every exchange for the new rank and
        size, keeps the replicated state and starts per-rank and sharded state afresh. Every
        rank calls it; retrace the step afterwards (its first trace checks that the ranks agree)."""
        self._plan_world()

    def _plan_world(self):
        """Plans every bucket's exchange for this rank and world size and creates the per-rank and
        sharded state anew; the first step checks that every rank agrees and reports a checkpoint's
        reset. No collective here."""
        rank, size = self.process_set.rank(), self.process_set.size()
        previous, self.world = self.world, (hvd.rank(), size)
        # Plan every exchange first: a bad size is refused before any collective runs.
        # Accordion plans each setting per bucket; otherwise a bucket has one.
        settings = self.compression.settings if self.adaptive else [self.compression]
        self.alternatives = []
        for b, bucket in enumerate(self.layout.buckets):
            shapes = [self.layout.shapes[i] for i in bucket]
            self.alternatives.append([exchange.plan(c, exchange.Bucket(
                b, shapes, rank, size, self.process_set, self._collective(b, k), self.two_way))
                for k, c in enumerate(settings)])
        rank_state = RankLocalState(rank, size)

        def new_state(spec):
            return self._state_variable(spec, rank_state)

        def per_variable(kind, i):  # keyed by position: Keras's layer names depend on what was built before
            return new_state(StateSpec(f"{kind}/{i}", self.layout.shapes[i], PER_RANK,
                                       state_dtype(self.variable_dtypes[i])))

        # Worker error feedback (and momentum in front, in direct-update mode) for the variables
        # of buckets whose exchange wants it; None where the exchange keeps its own (FetchSGD).
        fed = {i for bucket, alternatives in zip(self.layout.buckets, self.alternatives)
               if all(ex.worker_feedback for ex in alternatives) for i in bucket}
        self.residuals = [per_variable("residual", i) if i in fed else None for i in self.layout.compressed]
        self.momenta = ([per_variable("momentum", i) if i in fed else None for i in self.layout.compressed]
                        if self.direct_update else [])
        if self.accumulate:
            self.accumulated = [per_variable("accumulated_gradient", i) for i in range(len(self.variable_ids))]
            self.passes = new_state(StateSpec("accumulated_passes/all", (), PER_RANK, tf.int64))
        # Each exchange's own state (the onebit server residual, PowerSGD's Q), by bucket and setting.
        self.exchange_state = [[{spec.name: new_state(spec._replace(name=f"{spec.name}/{self._collective(b, k)}"))
                                 for spec in ex.state} for k, ex in enumerate(alternatives)]
                               for b, alternatives in enumerate(self.alternatives)]
        if self.monitor is not None:
            self.monitor.build(self.variable_names, self.layout, new_state)
        object.__setattr__(self, "rank_state", rank_state)
        state.track(self._holder, rank_state)  # a pending checkpoint restore happens here
        self._plan_agreement(previous)
        dense_compression = Compression.none if self.compression.requires_optimizer else self.compression
        self.dense_exchange = exchange.plan_dense(
            dense_compression, [self.layout.shapes[i] for i in self.layout.dense],
            [self.variable_dtypes[i] for i in self.layout.dense], rank, size, self.process_set, self.op,
            self.predivide, self.fusion_threshold_bytes, f"{self.collective_name}.dense")

    def _collective(self, b, k):
        """The name of bucket b's collectives (setting k of Accordion's)."""
        return f"{self.collective_name}.bucket{b}" + (f".setting{k}" if self.adaptive else "")

    def _state_variable(self, spec, rank_state):
        """The variable of a StateSpec: replicated state is created once (and reused when the world
        changes), per-rank and sharded state in this world's RankLocalState."""
        if spec.scope != REPLICATED:
            return rank_state.add(spec)
        if spec.name not in self.replicated:
            self.replicated[spec.name] = self._new_replicated(spec)
        return self.replicated[spec.name]

    def _plan_agreement(self, previous_world):
        """Every rank checks, at the first step of this plan, that all ranks have these settings."""
        settings = (f"{self.compression!r} two_way={self.two_way} op={self.op} "
                    f"min_compress_size={self.min_compress_size} "
                    f"fusion_threshold_bytes={self.fusion_threshold_bytes} "
                    f"direct_update={self.direct_update} "
                    f"variables={[(s, d.name) for s, d in zip(self.layout.shapes, self.variable_dtypes)]}")
        self.agreement.plan(settings, self.rank_state, self.process_set, self.collective_name,
                            None if previous_world is None else previous_world[1])

    @property
    def low_rank_q(self):
        """PowerSGD's warm-started Q factors (replicated state)."""
        return [v for name, v in self.replicated.items() if name.startswith("powersgd_q/")]

    @property
    def server_residuals(self):
        """This rank's shards of the two-way server residuals (sharded state)."""
        return [v for name, v in self.rank_state.variables.items() if name.startswith("server_residual/")]

    @property
    def exchanges(self):
        """The exchange each bucket runs now (Accordion: the setting of its regime, critical -> low)."""
        if not self.adaptive:
            return [alternatives[0] for alternatives in self.alternatives]
        return [alternatives[LOW if critical else HIGH]
                for alternatives, critical in zip(self.alternatives, self.monitor.critical.numpy() > 0.5)]

    @property
    def bytes_sent(self):
        """Bytes one worker sends per step (it receives as many)."""
        return sum(ex.bytes_sent for ex in self.exchanges) + self.dense_exchange.bytes_sent

    @property
    def uncompressed_bytes(self):
        """What Horovod's fp32 ring allreduce of every gradient would send per step."""
        return exchange.allreduce_bytes(4 * sum(self.layout.sizes), self.process_set.size())

    def residual_norm(self):
        """Global norm of the worker residuals and of what the exchanges hold back (this rank's
        server residuals; FetchSGD: an estimate from its error sketches), every setting's."""
        tensors = [r for r in self.residuals if r is not None]
        for alternatives, states in zip(self.alternatives, self.exchange_state):
            for ex, own in zip(alternatives, states):
                tensors += ex.residual(own)
        return tf.linalg.global_norm(tensors) if tensors else tf.constant(0.0)

    # -- one step -----------------------------------------------------------------------
    def arrange(self, grads_and_vars, owner):
        """(gradients, variables) in the planned order, None for planned variables that are not in
        grads_and_vars or whose gradient is None: those are left alone this step."""
        pairs = list(grads_and_vars)
        check_known_variables(self.variable_ids, [v for _, v in pairs], owner)
        position = {vid: i for i, vid in enumerate(self.variable_ids)}
        grads, variables = [None] * len(position), [None] * len(position)
        for g, v in pairs:
            grads[position[id(v)]], variables[position[id(v)]] = g, v
        return grads, variables

    def prepare(self, grads):
        """Checks and densifies the gradients (None -> zeros, so that the collectives pair up;
        IndexedSlices -> dense)."""
        prepared = []
        for g, name, shape, dtype in zip(grads, self.variable_names, self.layout.shapes, self.variable_dtypes):
            if g is None:
                g = tf.zeros(shape, dtype)
            elif isinstance(g, tf.IndexedSlices):  # Embeddings, tf.gather: densified, then compressed
                g = tf.convert_to_tensor(g)
            if not g.dtype.is_floating:
                raise TypeError(
                    f"The gradient of {name} has dtype {g.dtype.name}; hvd_compress averages float "
                    "gradients only. Make integer variables non-trainable.")
            prepared.append(g)
        return prepared

    def __call__(self, grads, learning_rate=None, momentum=0.0, nesterov=False, step=None):
        """Returns one tensor per variable, in its dtype: a delta to subtract (compressed variables
        in direct-update mode; an exchange.EncodedPart for exchange.subtract where the bucket's update
        stays encoded, `_subtracts_encoded`) or an averaged gradient (everything else); None where the gradient
        is None (zeros travel in its place, and its state is left as it was). step: the optimizer's
        iteration; None (a tape) uses and advances the exchange's own count, `own_steps`."""
        self.traced = True
        self.agreement.check()
        with tf.name_scope("hc_exchange"):  # name scopes read by benchmarks/overhead.py
            counted = step is None and self.own_steps is not None
            if counted:
                step = self.own_steps.read_value()
            elif step is None:  # stateless: no exchange reads the step
                step = tf.constant(0, tf.int64)
            residual_scale = self._residual_scale(learning_rate) if self.direct_update else None
            info = exchange.StepInfo(step, learning_rate, momentum if learning_rate is not None else 0.0, nesterov,
                                     residual_scale=residual_scale)
            absent = {i for i, g in enumerate(grads) if g is None}
            with tf.control_dependencies(state.check_world(*self.world, self.process_set)):
                grads = [tf.identity(g) for g in self.prepare(grads)]
            out = list(grads)
            dense = self.dense_exchange([grads[i] for i in self.layout.dense])
            for i, g in zip(self.layout.dense, dense):
                out[i] = g
            if self.monitor is not None:
                self.monitor.observe(grads)
            for b, (bucket, alternatives) in enumerate(zip(self.layout.buckets, self.alternatives)):
                parts = [tf.reshape(self._error_fed(i, grads[i], learning_rate, momentum, nesterov, residual_scale)
                                    if i not in absent else tf.zeros(self.layout.shapes[i]), [-1]) for i in bucket]
                # Accordion's settings run under tf.cond, whose branches return tensors: decoded there.
                encoded = len(alternatives) == 1 and self._subtracts_encoded(bucket)
                runs = [lambda ex=ex, own=own: self._run(ex, own, bucket, parts, info._replace(encoded_update=encoded))
                        for ex, own in zip(alternatives, self.exchange_state[b])]
                if len(runs) == 1:
                    residuals, updates = runs[0]()
                else:  # Accordion: both settings are in the graph, the detector's regime picks one (no retrace)
                    residuals, updates = tf.cond(self.monitor.critical[b] > 0.5, runs[LOW], runs[HIGH])
                for i, residual, update in zip(bucket, residuals, updates):
                    shape, kept = self.layout.shapes[i], self.residuals[self.layout.slot[i]]
                    if i not in absent and kept is not None:
                        with tf.name_scope("hc_state_update"):
                            kept.assign(tf.reshape(residual, shape))
                    if isinstance(update, exchange.EncodedPart):  # decoded into the variable by exchange.subtract
                        out[i] = update
                    else:
                        if self.op == hvd.Sum:
                            update = update * self.process_set.size()
                        out[i] = tf.cast(tf.reshape(update, shape), self.variable_dtypes[i])
            if counted:
                self.own_steps.assign_add(1)
            return [None if i in absent else g for i, g in enumerate(out)]

    def _subtracts_encoded(self, bucket):
        """Whether the bucket's update may reach the optimizer encoded (exchange.EncodedPart), to be
        decoded straight into its variables: in direct-update mode (the optimizer subtracts it),
        averaged (hvd.Sum scales it first) and for float32 variables."""
        return (self.direct_update and self.op == hvd.Average
                and all(self.variable_dtypes[i] == tf.float32 for i in bucket))

    def _run(self, ex, own_state, bucket, parts, step):
        """Runs one bucket's exchange and stores its new state: (this worker's residual, mean update),
        each a list of one flat tensor per variable of the bucket."""
        result = ex(parts, own_state, step)
        with tf.name_scope("hc_state_update"):
            for name, value in result.state.items():
                own_state[name].assign(value)
        if self.momenta and ex.masks_momentum:  # sketched SGD: zero u where it applied the update
            if result.applied is None:
                raise TypeError(f"{type(ex).__name__} masks momentum but its Step says nowhere where the update "
                                f"was applied: return Step(..., applied=indices).")
            with tf.name_scope("hc_state_update"):
                self._zero_momentum_at(bucket, result.applied, self.layout.bucket_size(bucket))
        if self.recall_totals is not None and result.applied is not None:
            self._record_recall(tf.concat(parts, 0), result.applied, ex)
        return result.residual, result.update

    def measure_recall(self):
        """Turns on the recall metric (CompressionMetrics(recall=True)) before the first step is
        traced. Each step then also allreduces the whole error-fed vector (a debugging cost) and
        adds to `recall_totals`: the fraction of the true top-k of the summed vector that the applied
        set holds (k: the heavy coordinates the exchange's candidates are sized for; the applied set
        holds all the candidates unless apply_candidates=False), and the fraction of those k
        coordinates' squared mass that it captures."""
        if self.recall_totals is not None:
            return
        if self.traced:
            raise ValueError("The recall metric must be turned on before the first step: add "
                             "hc.callbacks.CompressionMetrics(recall=True) to the first model.fit of this optimizer.")
        settings = self.compression.settings if self.adaptive else [self.compression]
        if not any(isinstance(c, SketchCompressor) and c.mode == "sketched" for c in settings):
            raise ValueError(f"Recall is measured for Compression.sketch's sketched SGD (the coordinates it applies "
                             f"are the same on every rank, and the vector they come from is the sum of the ranks' "
                             f"error-fed values; FetchSGD's lives in sketch space only); this optimizer uses "
                             f"{self.compression!r}.")
        with tf.init_scope():
            object.__setattr__(self, "recall_totals", tf.Variable(tf.zeros([3]), trainable=False,
                                                                  name="hc_recall_totals"))

    def _record_recall(self, flat, applied, ex):
        summed = hvd.allreduce(flat, op=hvd.Sum, process_set=self.process_set, name=ex.bucket.name + ".recall")
        _, true = ops.top_k_abs(summed, ex.k)
        in_true = tf.gather(ops.scatter_dense(true, tf.ones([ex.k]), ex.bucket.num_elements), applied)
        recall = tf.reduce_sum(in_true) / ex.k
        mass = tf.math.divide_no_nan(tf.reduce_sum(in_true * tf.square(tf.gather(summed, applied))),
                                     tf.reduce_sum(tf.square(tf.gather(summed, true))))  # 0 for a zero vector
        self.recall_totals.assign_add(tf.stack([recall, mass, 1.0]))

    def _zero_momentum_at(self, bucket, indices, num_elements):
        keep = 1.0 - ops.scatter_dense(indices, tf.ones_like(indices, tf.float32), num_elements)
        offset = 0
        for i in bucket:
            size, shape = self.layout.sizes[i], self.layout.shapes[i]
            m = self.momenta[self.layout.slot[i]]
            m.assign(m * tf.reshape(keep[offset:offset + size], shape))
            offset += size

    def _residual_scale(self, learning_rate):
        """lr / the previous step's lr (1 at the first step), and this step's lr kept as the previous.

        In direct-update mode (dist-EF-SGD, sketched SGD) the residuals hold learning-rate-scaled
        leftovers (a = lr p + e). The paper leaves them as they are when the rate changes, so after a
        drop from 0.1 to 0.001 the old-rate leftovers keep leaking into the weights for epochs. Here
        the worker residuals and the two-way server residual are multiplied by this scale, which is
        the same as keeping them in gradient units: measured on the digits CNN (docs/design.md,
        "dist-EF-SGD's residuals follow the learning rate"), 12-14x less movement of the compressed
        weights in the epoch after a drop, and final accuracy as good or better in 15 of 16 paired runs."""
        previous = tf.convert_to_tensor(self.previous_learning_rate)  # (a Keras 3 variable has no read_value)
        scale = tf.where(previous > 0, tf.math.divide_no_nan(learning_rate, previous), 1.0)
        with tf.control_dependencies([scale]):
            self.previous_learning_rate.assign(learning_rate)
        return scale

    def _error_fed(self, i, g, learning_rate, momentum, nesterov, residual_scale):
        """a_i: lr * (Nesterov) momentum + residual_scale * e_i in direct-update mode, else g_i + e_i;
        g_i itself where the exchange keeps error and momentum (FetchSGD)."""
        g = tf.cast(g, tf.float32)
        e = self.residuals[self.layout.slot[i]]
        if e is None:
            return g
        if not self.direct_update:
            return g + e
        m = self.momenta[self.layout.slot[i]]
        velocity, a = ops.momentum_error_feed(g, m, e, learning_rate, momentum, nesterov, residual_scale)
        with tf.name_scope("hc_state_update"):
            m.assign(velocity)
        return a


def check_known_variables(planned_ids, variables, owner):
    """The layout is planned for the variables of the first step; later steps may leave some out
    (None gradients), but bring no new ones."""
    planned = set(planned_ids)
    for v in variables:
        if id(v) not in planned:
            raise ValueError(f"{owner} planned its layout for the variables of its first step, and {variable_name(v)} "
                             "was not among them. Use one optimizer per list of variables, and give the "
                             "first step all of them.")


def variable_name(v):
    """A variable's full name in either Keras (Keras 3's `name` is the layer-local one)."""
    return getattr(v, "path", None) or v.name


def state_dtype(dtype):
    """Residuals and momenta of float16/bfloat16 variables are float32: error feedback adds up
    many small leftovers, which half precision would round away."""
    return tf.float32 if tf.as_dtype(dtype).is_floating else tf.as_dtype(dtype)


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


def _check_arguments(compression, two_way, op, min_compress_size, fusion_threshold_bytes):
    if isinstance(compression, type) and issubclass(compression, StatefulCompressor):
        compression = compression()  # e.g. Compression.onebit passed uncalled: its defaults
    if not hasattr(compression, "requires_optimizer"):
        raise TypeError(f"compression must be one of hvd_compress.Compression (e.g. "
                        f"Compression.onebit()), got {compression!r}.")
    if not isinstance(two_way, bool):
        raise TypeError(f"two_way must be True or False, got {two_way!r}.")
    if (compression.requires_optimizer or exchange.is_fp16(compression)) and op not in (hvd.Average, hvd.Sum):
        raise ValueError(f"op must be hvd.Average or hvd.Sum with {compression!r}; Adasum and other "
                         "reductions do not apply to compressed payloads (for Adasum in 16 bits use "
                         "Horovod's own DistributedOptimizer).")
    if not isinstance(min_compress_size, int) or min_compress_size < 1:
        raise ValueError(f"min_compress_size must be a positive integer, got {min_compress_size!r}.")
    if not isinstance(fusion_threshold_bytes, int) or fusion_threshold_bytes < 1:
        raise ValueError(f"fusion_threshold_bytes must be a positive integer, got "
                         f"{fusion_threshold_bytes!r}.")
    return compression


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
        settings["compression"] = compression_config(settings["compression"])
        settings["op"] = next((name for name in REDUCE_OPS if getattr(hvd, name) == settings["op"]), settings["op"])
        settings["process_set_ranks"] = saved_process_set(settings.pop("process_set"))
        return settings

    @staticmethod
    def factory(optimizer, compression, op, process_set_ranks=None, **settings):
        """DistributedOptimizer from the settings _hc_settings saved."""
        if process_set_ranks is not None and "process_set" not in settings:  # (hvd_compress.load_model's may be)
            refuse_saved_process_set(process_set_ranks, "DistributedOptimizer")
        if isinstance(compression, dict):
            compression = compression_from_config(compression)
        return DistributedOptimizer(optimizer, compression=compression,
                                    op=getattr(hvd, op) if isinstance(op, str) else op, **settings)

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
        _hc_apply clips each rank's gradient before the exchange, once (docs/design.md)."""
        return grads

    def _hc_direct_update(self):
        """Momentum in front and lr inside (dist-EF-SGD, sketched SGD) for onebit and sketch
        under SGD."""
        compression = self._hc_exchange.compression
        family = compression.high if isinstance(compression, AdaptiveCompression) else compression
        return isinstance(family, (OneBitCompressor, SketchCompressor)) and isinstance(self, sgd_classes())

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
            list(var_list), holder=self, direct_update=self._hc_direct_update(),
            new_replicated=lambda spec: self.add_variable(
                spec.shape, dtype=spec.dtype, initializer=lambda shape, dtype: spec.initial_value(),
                name=f"hc_{safe_name(spec.name)}"))
        if self._hc_backward_passes > 1:
            # Replicated: a variable, so AccordionBatchSize can change it between steps without a retrace.
            self._hc_passes_per_step = self.add_variable(
                [], dtype=tf.int64, name="hc_passes_per_step",
                initializer=lambda shape, dtype: tf.fill(shape, tf.cast(self._hc_backward_passes, dtype)))

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
        direct = self._hc_exchange.direct_update
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
                self._apply_weight_decay([v for _, v in deltas])
                for delta, v in deltas:
                    exchange.subtract(v, delta)  # an EncodedPart is decoded straight into v
                    if v.constraint is not None:
                        v.assign(v.constraint(v))
        if not passed_on:
            return self.iterations.assign_add(1)
        iteration = self._hc_wrapped_apply(passed_on)
        decompressed = [] if direct else [v for i, _, v in applied if i in self._hc_exchange.layout.slot]
        if decompressed:
            self._hc_check_finite(decompressed)
        return iteration

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
                         two_way=True, min_compress_size=DEFAULT_MIN_COMPRESS_SIZE,
                         fusion_threshold_bytes=DEFAULT_FUSION_THRESHOLD_BYTES):
    """Wraps a Keras optimizer (Keras 3, or tf_keras) so gradients are averaged across ranks,
    compressed.

    Takes Horovod's keyword arguments (device_dense, device_sparse, num_groups,
    groups and scale_local_gradients are accepted for compatibility; the
    layout here is fixed by `fusion_threshold_bytes`) plus:
      compression: a `hvd_compress.Compression` (none, fp16, onebit(), topk(),
        randomk()).
      two_way: onebit only; True compresses the averaged update again on a
        sharded server with its own error feedback (the paper's method),
        False allgathers every worker's update.
      min_compress_size: tensors with fewer elements travel uncompressed.
      fusion_threshold_bytes: the largest compressed bucket.
    Returns the same optimizer object, now an instance of a subclass of its
    class: everything it holds (settings outside its config, trained slots and
    step count, callables, schedules) is kept. Model files save it under the
    registered name "hvd_compress>DistributedOptimizer" with the wrapped
    optimizer's config and these settings, so keras.models.load_model (either
    Keras, .keras, .h5 and SavedModel) and hvd_compress.load_model give it
    back distributed (hvd.init() first).
    """
    refuse_loss_scale_optimizer(optimizer, "hvd_compress.DistributedOptimizer")
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
    exchange_ = GradientExchange(compression, two_way, process_set, op, gradient_predivide_factor,
                                 sparse_as_dense, min_compress_size, fusion_threshold_bytes,
                                 name=name or f"hc.{type(optimizer).__name__}")
    if exchange_.compression.requires_optimizer and getattr(optimizer, "use_ema", False):
        raise ValueError("use_ema=True is not supported with a stateful compressor; turn it off.")
    refuse_sparse_updates_to_factored_moments(optimizer, exchange_.compression)
    settings = dict(name=name, compression=exchange_.compression, sparse_as_dense=sparse_as_dense,
                    gradient_predivide_factor=gradient_predivide_factor, op=op,
                    backward_passes_per_step=backward_passes_per_step,
                    average_aggregated_gradients=average_aggregated_gradients, process_set=process_set,
                    two_way=two_way, min_compress_size=min_compress_size,
                    fusion_threshold_bytes=fusion_threshold_bytes)
    wrapped = wrap_in_place(optimizer, _DistributedOptimizerMixin)
    wrapped._hc_init(exchange_, backward_passes_per_step, average_aggregated_gradients, settings)
    return wrapped


def refuse_sparse_updates_to_factored_moments(optimizer, compression):
    """Adafactor's factored second moment divides by the mean of each row and column of the
    squared gradient: a compressed gradient that is zero on whole rows (top-k, random-k, sketch
    send a few coordinates) makes those 0/0 and the weights NaN."""
    from hvd_compress.compression import TopKCompressor
    from hvd_compress.sketch import SketchCompressor
    factored = [keras.optimizers.Adafactor for keras in kerases_in_use() if hasattr(keras.optimizers, "Adafactor")]
    if isinstance(optimizer, tuple(factored)) and isinstance(compression, (TopKCompressor, SketchCompressor)):
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
    compression, two_way=...)` once and pass `exchange=exchange` (and put it
    in your tf.train.Checkpoint). The rule is plain error feedback on
    gradients, a = g + e, D = C(a), e = a - D; your optimizer applies the mean.
    The exchange counts its steps itself (`own_steps`, checkpointed with it),
    for what is drawn anew each step: random-k's coordinates, the sketches' hashes.
    """

    def __init__(self, gradtape, device_dense="", device_sparse="", compression=Compression.none,
                 sparse_as_dense=False, op=hvd.Average, gradient_predivide_factor=1.0, num_groups=0,
                 groups=None, process_set=hvd.global_process_set, exchange=None, two_way=True):
        if exchange is None:
            exchange = GradientExchange(compression, two_way, process_set, op, gradient_predivide_factor,
                                        sparse_as_dense, name="hc.tape")
            if exchange.compression.requires_optimizer:
                raise ValueError(
                    f"{exchange.compression!r} keeps error-feedback state across steps, and a tape "
                    "lives for one step. Create `exchange = hvd_compress.GradientExchange(compression, "
                    "two_way=...)` once, outside the loop, and pass exchange=exchange.")
        self._tape, self.exchange = gradtape, exchange

    def gradient(self, target, sources, output_gradients=None, **kwargs):
        grads = self._tape.gradient(target, sources, output_gradients, **kwargs)
        variables = tf.nest.flatten(sources)
        with tf.init_scope():
            self.exchange.build(variables)
        arranged, _ = self.exchange.arrange(zip(tf.nest.flatten(grads), variables), "A GradientExchange")
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
    custom_objects keyed by class name). A `.keras` file is read by Keras 3, an `.h5` file by the
    Keras that wrote it, a SavedModel directory by tf_keras.

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


def keras_of_file(filepath):
    """The Keras that reads a model file: Keras 3 for .keras, the writer's for .h5, tf_keras for a
    SavedModel directory."""
    path = str(filepath)
    if path.endswith(".keras"):
        return keras3()
    if path.endswith((".h5", ".hdf5")):
        import h5py
        with h5py.File(path, "r") as f:
            version = f.attrs.get("keras_version", b"2")
        if (version.decode() if isinstance(version, bytes) else str(version)).startswith("3"):
            return keras3()
    if tf_keras() is None:
        raise ValueError(f"{path} is a tf_keras file (h5 or SavedModel); install tf_keras to load it.")
    return tf_keras()
