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

import numpy as np
import tensorflow as tf

import horovod.tensorflow as hvd
from hvd_compress import exchange
from hvd_compress.auto import refuse_outside_distributed_optimizer
from hvd_compress.compression import Compression
from hvd_compress.compression import from_config as compression_from_config, to_config as compression_config
from hvd_compress.gradient_exchange import (DEFAULT_FUSION_THRESHOLD_BYTES, DEFAULT_MIN_COMPRESS_SIZE,
                                            GradientExchange, check_known_variables)
from hvd_compress.keras_compat import (WrapperCore, keras_of, refuse_saved_process_set, refuse_wrapped,
                                       register_loader, saved_process_set, wrap_in_place)
from hvd_compress.optimizer import refuse_loss_scale_optimizer, refuse_xla
from hvd_compress import gradient_exchange, overlap, state

log = logging.getLogger("hvd_compress")

#: DiLoCo's outer optimizer (Douillard et al. 2023): Nesterov SGD at this rate and momentum
OUTER_LEARNING_RATE, OUTER_MOMENTUM = 0.7, 0.9


def _is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_count(value, low):
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


class Piece:
    """Rows [start, stop) (along the first axis) of variable `index`, of `rows` in all: a part of a fragment."""

    def __init__(self, index, start, stop, shape):
        self.index, self.start, self.stop = index, start, stop
        self.rows = shape[0] if shape else 1
        self.shape = tuple(shape) if self.whole else (stop - start,) + tuple(shape[1:])
        self.size = int(np.prod(self.shape, dtype=np.int64))

    @property
    def whole(self):
        return self.start == 0 and self.stop == self.rows

    def of(self, value):
        """This piece of a value shaped like the variable."""
        return value if self.whole else value[self.start:self.stop]

    def write(self, variable, value):
        """Sets this piece of `variable` to `value` (the rest as it was)."""
        if self.whole:
            return variable.assign(value)
        return variable.assign(tf.concat([variable[:self.start], value, variable[self.stop:]], 0))


def fragment_plan(shapes, fragments):
    """The pieces of each fragment. A variable larger than 1/F of the model is cut by rows into pieces of about
    that size; then the largest piece first, each onto the fragment holding the fewest elements so far (the
    lowest-numbered on a tie), so each fragment carries about 1/F of the model and a stack of equal layers is
    dealt out in turn, as Streaming DiLoCo's strided pattern. Pieces of a fragment are in the variables' order."""
    shapes = [tuple(tf.TensorShape(s).as_list()) for s in shapes]
    sizes = [int(np.prod(s, dtype=np.int64)) for s in shapes]
    target = max(1, -(-sum(sizes) // fragments))
    pieces = []
    for i, (shape, size) in enumerate(zip(shapes, sizes)):
        rows = shape[0] if shape else 1
        cuts = min(rows, max(1, -(-size // target)))
        bounds = [rows * c // cuts for c in range(cuts + 1)]
        pieces += [Piece(i, a, b, shape) for a, b in zip(bounds, bounds[1:])]
    load, plan = [0] * fragments, [[] for _ in range(fragments)]
    for piece in sorted(pieces, key=lambda p: -p.size):
        f = min(range(fragments), key=load.__getitem__)
        plan[f].append(piece)
        load[f] += piece.size
    return [sorted(fragment, key=lambda p: (p.index, p.start)) for fragment in plan]


class OuterStep:
    """theta, the outer momentum and the exchange of the pseudo-gradients, for one fixed list of variables cut into
    fragments (one exchange each; fragment f starts its sync at inner steps phase_f + k H and, after sync_delay
    steps during which the exchange runs on a background thread, takes its outer step)."""

    def __init__(self, sync_every, outer_learning_rate, outer_momentum, nesterov, compression, error_decay,
                 fragments, sync_delay, merge_alpha, process_set, min_compress_size, fusion_threshold_bytes, name):
        refuse_outside_distributed_optimizer(compression, "hc.DiLoCo(compression=...)")
        if not _is_count(sync_every, 1):
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
        if not _is_count(fragments, 1) or fragments > sync_every:
            raise ValueError(f"fragments must be a whole number from 1 to sync_every={sync_every} (each fragment "
                             f"syncs at its own step of the period), got {fragments!r}.")
        if not _is_count(sync_delay, 0) or sync_delay >= sync_every:
            raise ValueError(f"sync_delay must be a number of inner steps from 0 to sync_every - 1 = {sync_every - 1} "
                             f"(a fragment's exchange must land before its next one starts), got {sync_delay!r}.")
        if not _is_number(merge_alpha) or not 0 <= merge_alpha < 1:
            raise ValueError(f"merge_alpha must be a number in [0, 1) (0: every rank takes the new theta; Streaming "
                             f"DiLoCo's alpha keeps that share of the local weights), got {merge_alpha!r}.")
        if merge_alpha and not sync_delay:
            raise ValueError(f"merge_alpha={merge_alpha} mixes in the local progress made while an exchange is in "
                             "flight, and sync_delay=0 leaves none: give sync_delay= >= 1, or leave merge_alpha=0.")
        self.sync_every, self.nesterov = sync_every, nesterov
        self.learning_rate, self.momentum = float(outer_learning_rate), float(outer_momentum)
        self.error_decay, self.merge_alpha = float(error_decay), float(merge_alpha)
        self.fragments, self.sync_delay = fragments, sync_delay
        #: the inner step (1..H) of each period at which fragment f starts its sync; the last fragment's is H
        self.phases = [(f + 1) * sync_every // fragments for f in range(fragments)]
        self.exchanges = [GradientExchange(compression, process_set, min_compress_size=min_compress_size,
                                           fusion_threshold_bytes=fusion_threshold_bytes, warmup_steps=0,
                                           name=name if fragments == 1 else f"{name}.fragment{f}")
                          for f in range(fragments)]
        for ex in self.exchanges:
            ex.settle(None)
        self.compression = self.exchanges[0].compression
        if self.error_decay != 1 and not self.compression.requires_optimizer:
            raise ValueError(f"error_decay={error_decay} decays the error feedback of a compression, and "
                             f"{self.compression!r} keeps none: leave error_decay=1, or give a compression "
                             "such as Compression.topk(ratio=0.01).")
        self.background = overlap.BackgroundExchanges(f"{name}.background") if sync_delay else None
        self.process_set, self.name = process_set, name
        self.built = False

    def build(self, variables, new_replicated, holder):
        """theta (from the variables' values), the outer momentum and the exchanges in flight through
        new_replicated(name, initial value) -> variable, and each fragment's exchange plan and state (per-rank
        state tracked by `holder`)."""
        if self.built:
            return
        # Plain references (this object is not tracked: the optimizer must not own the model's variables).
        self.variables = list(variables)
        self.variable_ids = [id(v) for v in self.variables]
        #: each fragment's pieces of the variables
        self.members = fragment_plan([v.shape for v in self.variables], self.fragments)
        if not all(self.members):
            raise ValueError(f"DiLoCo(fragments={self.fragments}) cuts the model by rows of its variables, and it "
                             f"has {sum(map(len, self.members))} rows: give fewer fragments.")

        def per_variable(kind, like):
            return [new_replicated(f"diloco_{kind}/{i}", like(v)) for i, v in enumerate(self.variables)]

        self.snapshots = per_variable("snapshot", lambda v: tf.cast(v, tf.float32))
        self.momenta = per_variable("momentum", lambda v: tf.zeros(v.shape, tf.float32)) if self.momentum else None
        # The averaged change of each piece whose exchange is in flight (written by the background thread).
        self.pending = [[new_replicated(f"diloco_pending/{f}/{p}", tf.zeros(piece.shape, tf.float32))
                         for p, piece in enumerate(pieces)] for f, pieces in enumerate(self.members)
                        ] if self.sync_delay else None
        # The inner steps taken: the optimizer's own count also advances on a step a LossScaleOptimizer skips
        # (tf_keras's), which would skip a sync.
        self.inner_steps = new_replicated("diloco_inner_steps", tf.zeros([], tf.int64))
        for f, (ex, members) in enumerate(zip(self.exchanges, self.members)):
            prefix = "" if self.fragments == 1 else f"fragment{f}/"
            names = [f"{gradient_exchange.variable_name(self.variables[p.index])}[{p.start}:{p.stop}]" for p in members]
            specs = [tf.TensorSpec(p.shape, tf.float32, name=name) for p, name in zip(members, names)]
            ex.build(specs, holder=holder, state_key=self.state_key(f),
                     new_replicated=lambda spec, prefix=prefix: new_replicated(prefix + spec.name,
                                                                               spec.initial_value()))
        if self.sync_delay:
            self._run_in_background = [self._exchange_into_pending(f) for f in range(self.fragments)]
            # One token per landed exchange: the step that lands it waits in a dequeue, which holds no TensorFlow
            # thread while it waits (the background exchange needs them: all of them under TF_NUM_INTEROP_THREADS=1).
            self.landed = [tf.queue.FIFOQueue(1, [tf.int32], [[]]) for _ in range(self.fragments)]
        self.built = True

    def check_ranks_agree(self):
        """Each exchange's check that the ranks agree (a collective, once per plan), at the first step and on the
        training thread: an eager Horovod op is named by its type, so the background thread's would collide with
        the training thread's. (Not at build: rank 0 alone may load a model file, which builds the optimizer.)"""
        for ex in self.exchanges:
            ex.agreement.check()

    @staticmethod
    def state_key(fragment):
        """The checkpoint key of fragment f's per-rank state (the first fragment's is every exchange's)."""
        return state.RANK_STATE if fragment == 0 else f"{state.RANK_STATE}_{fragment}"

    @property
    def bytes_per_sync(self):
        """Bytes one rank sends per sync period, every fragment once (it receives as many)."""
        return sum(ex.bytes_sent for ex in self.exchanges)

    @property
    def bytes_per_step(self):
        """Bytes one rank sends per inner step, averaged over the H steps of a sync period."""
        return self.bytes_per_sync / self.sync_every

    @property
    def peak_bytes_per_step(self):
        """The most bytes one rank starts sending at one inner step: its largest fragment's."""
        return max(ex.bytes_sent for ex in self.exchanges)

    @property
    def uncompressed_bytes(self):
        """What Horovod's fp32 ring allreduce of the whole model sends per rank."""
        return sum(ex.uncompressed_bytes for ex in self.exchanges)

    def steps_to_next_sync(self):
        """Inner steps from now until the next step at which a fragment starts its sync."""
        count = int(self.inner_steps.numpy()) if self.built else 0
        return min(phase - count if count < phase else -(count - phase) % self.sync_every or self.sync_every
                   for phase in self.phases)

    def settle(self):
        """Waits for the exchanges in flight (their results are then in `pending`): before a checkpoint or model
        file is written, or the world changes."""
        if self.background is not None:
            self.background.wait_all()

    def replan(self):
        """After an elastic reset, on every rank: the exchanges in flight land in `pending`, and every exchange is
        planned for the new world."""
        self.settle()
        for ex in self.exchanges:
            ex.replan()

    def _due(self, count, phase):
        return tf.logical_and(count >= phase, tf.equal(tf.math.floormod(count - phase, self.sync_every), 0))

    def __call__(self):
        """After an inner step: counts it; each fragment whose exchange landed takes its outer step, and each
        whose phase this step is starts its sync (and, without a delay, takes its outer step now)."""
        self.check_ranks_agree()
        count = self.inner_steps.assign_add(1)
        for f, phase in enumerate(self.phases):
            if self.sync_delay:
                tf.cond(self._due(count, phase + self.sync_delay), lambda f=f: self._land(f), tf.no_op)
            sync = (count - phase) // self.sync_every
            tf.cond(self._due(count, phase), lambda f=f, sync=sync: self._start(f, sync), tf.no_op)

    def _deltas(self, f):
        return [p.of(self.snapshots[p.index]) - tf.cast(p.of(self.variables[p.index]), tf.float32)
                for p in self.members[f]]

    def _exchange(self, f, deltas, sync):
        """mean_i C(Delta_i + beta e_i) over the ranks, for fragment f's variables."""
        ex = self.exchanges[f]
        if self.error_decay != 1:  # SparseLoCo: a_i = Delta_i + beta e_i
            for residual in ex.residuals:
                if residual is not None:
                    residual.assign(residual * self.error_decay)
        return ex(deltas, step=tf.cast(sync, tf.int64))

    def _start(self, f, sync):
        with tf.name_scope("hc_diloco_sync"):
            if not self.sync_delay:
                self._outer_step(f, self._exchange(f, self._deltas(f), sync))
                return tf.no_op()

            def post(sync, *deltas):  # copies: TensorFlow may reuse its buffers once this returns
                self.background.post(f, self._exchange_and_report, f, [d.copy() for d in deltas], sync)
                return np.int64(0)

            posted = tf.numpy_function(post, [tf.cast(sync, tf.int64)] + self._deltas(f), tf.int64, stateful=True,
                                       name=f"hc_diloco_post_{f}")
            return posted.op

    def _exchange_into_pending(self, f):
        """Fragment f's exchange as a tf.function, for the background thread: its averaged change into `pending`.
        (Not eagerly: an eager Horovod op is named by its type, and would collide with the training thread's.)"""
        specs = [tf.TensorSpec(p.shape, tf.float32) for p in self.members[f]]

        @tf.function(input_signature=[specs, tf.TensorSpec([], tf.int64)])
        def run(deltas, sync):
            for pending, averaged in zip(self.pending[f], self._exchange(f, list(deltas), sync)):
                pending.assign(averaged)

        return run

    def _exchange_and_report(self, f, deltas, sync):
        """On the background thread: fragment f's exchange, then its token for the step that lands it (also when
        the exchange failed: that step then raises the error)."""
        try:
            self._run_in_background[f](deltas, sync)
        finally:
            self.landed[f].enqueue(0)

    def _land(self, f):
        """sync_delay steps after fragment f's sync started: its exchange done, its outer step. A fragment this
        process did not post (its sync started before a restore) finds its average in `pending` already."""
        with tf.name_scope("hc_diloco_land"):
            posted = tf.numpy_function(lambda: np.bool_(self.background.posted(f)), [], tf.bool, stateful=True,
                                       name=f"hc_diloco_posted_{f}")
            posted.set_shape([])

            def wait():
                with tf.control_dependencies([self.landed[f].dequeue()]):  # waits holding no thread
                    return tf.numpy_function(lambda: (self.background.wait(f), np.int64(0))[1], [], tf.int64,
                                             stateful=True, name=f"hc_diloco_check_{f}")  # its error, if any

            waited = tf.cond(posted, wait, lambda: tf.constant(0, tf.int64))
            with tf.control_dependencies([waited]):
                averaged = [tf.identity(pending) for pending in self.pending[f]]
            self._outer_step(f, averaged)
        return tf.no_op()

    def _outer_step(self, f, averaged):
        """The outer optimizer on fragment f's theta with the averaged change; then every rank's x = theta (or,
        with merge_alpha, alpha x + (1 - alpha) theta)."""
        for piece, delta in zip(self.members[f], averaged):
            theta, x, step = self.snapshots[piece.index], self.variables[piece.index], delta
            if self.momentum:
                m = self.momentum * piece.of(self.momenta[piece.index]) + delta
                piece.write(self.momenta[piece.index], m)
                step = delta + self.momentum * m if self.nesterov else m
            stepped = piece.of(theta) - self.learning_rate * step
            piece.write(theta, stepped)
            if self.merge_alpha:
                stepped = self.merge_alpha * tf.cast(piece.of(x), tf.float32) + (1 - self.merge_alpha) * stepped
            piece.write(x, tf.cast(stepped, x.dtype))


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
        # The exchanges in flight land first (their results are replicated state). The error feedback: in
        # checkpoints, with its owner; never in optimizer.variables nor in model files.
        self._hc_outer.settle()
        children = super()._trackable_children(save_type, **kwargs)
        for f, ex in enumerate(self._hc_outer.exchanges):
            children = state.checkpoint_children(children, ex.rank_state, save_type, key=OuterStep.state_key(f))
        return children

    @property
    def variables(self):
        """Keras's list, read where model files are written (.keras, .h5) and broadcast: the exchanges in flight
        land first (their results are replicated state)."""
        self._hc_outer.settle()
        return super().variables

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
            self._hc_outer.replan()

    def hc_plan_fit(self, end_step):
        """Before a model.fit that ends at optimizer step `end_step` (None: unknown): a fit in which no sync falls
        trains every rank alone; said on rank 0 before its first step."""
        start = int(self.iterations.numpy())
        if end_step is None or end_step - start >= self._hc_outer.steps_to_next_sync():
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
           nesterov=True, compression=Compression.none, error_decay=1.0, fragments=1, sync_delay=0, merge_alpha=0.0,
           process_set=hvd.global_process_set, min_compress_size=DEFAULT_MIN_COMPRESS_SIZE,
           fusion_threshold_bytes=DEFAULT_FUSION_THRESHOLD_BYTES):
    """Wraps a Keras optimizer (Keras 3 or tf_keras) as DiLoCo's inner optimizer (see the module docstring):
    each rank steps alone on its own gradients, sending nothing, and every `sync_every` steps the ranks
    average their change since the last sync (compressed by `compression`, with error feedback) and take an
    outer step with it (Nesterov SGD at outer_learning_rate and outer_momentum; outer_momentum=0: the
    averaged change itself, scaled). Bytes per inner step: one exchange of the model every `sync_every` steps.

    Streaming DiLoCo (Douillard et al. 2025): `fragments`=F cuts the model into F fragments of about equal size
    that sync at staggered steps of the period (peak bytes per step about 1/F of a whole sync); `sync_delay`=tau
    runs each fragment's exchange on a background thread while tau more inner steps train, then takes its
    outer step; `merge_alpha` keeps that share of the local weights at the merge (0: x = theta).

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
                      fragments, sync_delay, merge_alpha, process_set, min_compress_size, fusion_threshold_bytes,
                      name=f"hc.diloco.{type(optimizer).__name__}")
    settings = dict(sync_every=sync_every, outer_learning_rate=outer.learning_rate, outer_momentum=outer.momentum,
                    nesterov=nesterov, compression=outer.compression, error_decay=outer.error_decay,
                    fragments=fragments, sync_delay=sync_delay, merge_alpha=outer.merge_alpha, process_set=process_set, min_compress_size=min_compress_size,
                    fusion_threshold_bytes=fusion_threshold_bytes)
    wrapped = wrap_in_place(optimizer, _DiLoCoMixin)
    wrapped._hc_init(outer, settings)
    return wrapped
