"""GradientExchange: the compressed exchange of one list of variables, with the worker's side of
each compressor's update rule (compressor.py).

Layout. At the first step the trainable variables are split into
- compressed: float tensors of at least `min_compress_size` elements, fused in
  order into buckets of at most `fusion_threshold_bytes` (one payload and one
  or two collectives per bucket per step); the compressor plans each bucket's
  exchange (`plan(bucket)`);
- dense: the rest (biases, integer tensors), averaged uncompressed by one
  grouped allreduce, with the chosen Horovod compression (none/fp16).
Every rank checks, at the first step, that all ranks have the same
compression settings and variables (a clear error instead of a hang).

State. Replicated state (the wrapped optimizer's slots, PowerSGD's Q,
Accordion's history) is optimizer variables: Horovod's broadcasts, elastic
sync and model files carry it. Per-rank and sharded state (residuals,
momenta, server-residual shards) is kept apart, in checkpoints only, with the
rank and world size it belongs to; a restore onto another rank or world size
starts it afresh, and rank 0 logs one line (hvd_compress/state.py).

Update rules. The worker's side of each (error feedback, dist-EF-SGD's momentum in front, 1-bit Adam, Adam with a
frozen variance, none) is a rules.WorkerRule, chosen once at build from the compressor's `update_rule` and the
wrapped optimizer: it declares its state, feeds each compressed variable's a_i to the exchange and finishes the
step from the exchanged mean (rules.py, adam.py).

Hosts. With hierarchical=True every bucket is averaged inside each host at full precision and compressed
only across hosts (exchange.Hierarchical; the uncompressed tensors exchange.HierarchicalDense): the error
feedback then lives in the exchange, on this rank's shard of its host's mean, and the worker keeps its rule's
momentum only. The hosts' process sets are made at the first step (hosts.HostSets).

Warm-up. For the first `warmup_steps` steps every bucket travels at full precision (a float32 sum
in rank order, exchange.OrderedMean, chosen by exchange.Switching), and the worker's residuals stay
zero; compression starts after. Under 1-bit Adam its default follows the run (adam.default_warmup_steps: the
schedule's warm-up, or 10% of what model.fit plans, which plan_fit gives before the first step), and a warm-up that
covers a whole model.fit is reported before its first step (or, where the fit's length is unknown, after it).
"""
import logging

import numpy as np
import tensorflow as tf

import horovod.tensorflow as hvd
from hvd_compress import adam, exchange, hosts, ops, rules, state, uneven  # adam: registers its rules
from hvd_compress.compressor import UPDATE_RULES, NoneCompressor, StatefulCompressor
from hvd_compress.accordion import AdaptiveCompression
from hvd_compress.state import PER_RANK, REPLICATED, RankLocalState, StateSpec, safe_name

log = logging.getLogger("hvd_compress")

DEFAULT_MIN_COMPRESS_SIZE = 1024
# Several buckets: one is decoded while the next are on the wire. Measured (wire.py --fusion_threshold_bytes, 25M MLP
# under SGD, 2 ranks, 1 Gbit/s, 3 rounds, Zen 5): one bucket of the whole model (128 MiB) made onebit's step 249 ms,
# quantize8's 493 and top-k's 233, against 186, 413 and 211 at 16 MiB; 4 MiB (one bucket more) was level with 16.
DEFAULT_FUSION_THRESHOLD_BYTES = 16 << 20


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


def flat(part, size):
    """A fed part as a flat vector of `size` elements: a tensor, or an exchange.Unsummed of two."""
    if isinstance(part, exchange.Unsummed):
        return exchange.Unsummed(tf.reshape(part.value, [size]), tf.reshape(part.residual, [size]))
    return tf.reshape(part, [size])


def bucket_name(collective_name, b):
    """The name of bucket b's collectives."""
    return f"{collective_name}.bucket{b}"


def plan_buckets(layout, rank, size, process_set, collective_name):
    """The exchange.Buckets of a layout's compressed variables on a world (also hvd_compress.cost's, offline)."""
    return [exchange.Bucket(b, [layout.shapes[i] for i in bucket], rank, size, process_set,
                            bucket_name(collective_name, b)) for b, bucket in enumerate(layout.buckets)]


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
    into averaged gradients or, where its worker rule takes the step itself (`rule.applies_step`:
    dist-EF-SGD, sketched SGD, FetchSGD under SGD, 1-bit Adam, Adam with a frozen variance), the deltas to subtract.
    For custom loops create one, once, and pass it to every
    DistributedGradientTape; checkpoint it with tf.train.Checkpoint(exchange=...).
    After an elastic reset, `replan()` plans for the new world.
    """

    def __init__(self, compression, process_set=hvd.global_process_set, op=hvd.Average,
                 gradient_predivide_factor=1.0, sparse_as_dense=False,
                 min_compress_size=DEFAULT_MIN_COMPRESS_SIZE,
                 fusion_threshold_bytes=DEFAULT_FUSION_THRESHOLD_BYTES, name="hc", two_way=None, warmup_steps=None,
                 hierarchical=False):
        super().__init__(name=name.replace(".", "_"))
        refuse_two_way(two_way)
        compression = _check_arguments(compression, op, min_compress_size, fusion_threshold_bytes, warmup_steps)
        if not isinstance(hierarchical, bool):
            raise TypeError(f"hierarchical must be True or False, got {hierarchical!r}.")
        #: averages inside each host at full precision and compresses across hosts (exchange.Hierarchical)
        self.hierarchical = hierarchical
        self.hosts = None  # hosts.HostSets of the current plan, when hierarchical
        #: full-precision steps before compression starts (None: 1-bit Adam's default, else 0)
        self.requested_warmup_steps = warmup_steps
        #: the optimizer step at which the coming model.fit ends (plan_fit), and the fit last warned about
        self.fit_end, self._warned_fit_end = None, None
        self.compression, self.process_set = compression, process_set
        uneven.for_process_set(process_set)  # its variables now: made in a traced step, they would retrace it
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
        if isinstance(compression, AdaptiveCompression):
            if detector.groups != "variable":
                raise ValueError("Adaptive compression follows the regime of each compressed variable: "
                                 "it needs a RegimeDetector(groups='variable').")
            if self.recall_totals is not None:
                raise ValueError("The recall metric is measured for sketched SGD alone, not under Accordion.")
            compression.detector = detector
        self.compression, self.monitor = compression, detector

    # -- planning and state -------------------------------------------------------------
    def build(self, variables, new_replicated=None, holder=None, optimizer=None, state_key=state.RANK_STATE):
        """Plans the layout, chooses the worker rule (rules.choose: from the compressor's update_rule and
        `optimizer`, the wrapped Keras optimizer, None under a tape) and creates the state.

        new_replicated(spec) -> variable creates replicated state (default: this
        module's variables); holder tracks the per-rank state for checkpoints
        (default: this module) under state_key.
        """
        if self.built:
            return
        variables = list(variables)
        # Kept as plain facts, not references: the module must not track the model's variables.
        self.variable_ids = [id(v) for v in variables]
        self.variable_names = [variable_name(v) for v in variables]
        self.variable_dtypes = [tf.as_dtype(v.dtype) for v in variables]
        self.settle(optimizer)
        rule_class = rules.choose(self.compression.update_rule, optimizer, self.requested_warmup_steps)
        self.layout = Layout(variables, self.compression, self.min_compress_size,
                             self.fusion_threshold_bytes if getattr(self.compression, "fuses_tensors", True) else 1)
        object.__setattr__(self, "rule", rule_class(optimizer, [variables[i] for i in self.layout.compressed],
                                                    self.hierarchical))
        self.warmup_steps, self.warmup_source = self.requested_warmup_steps or 0, "as warmup_steps= gave it"
        if self.requested_warmup_steps is None:
            self._choose_warmup()
        self.rule.check(self.compression, self.op, self.warmup_steps)
        if self.recall_totals is not None and self.warmup_steps:
            raise ValueError("The recall metric is measured for sketched SGD without a warm-up: measure it in a run "
                             "with warmup_steps=0.")
        object.__setattr__(self, "_new_replicated", new_replicated or self._new_module_variable)
        object.__setattr__(self, "_holder", holder or self)
        self.state_key = state_key
        object.__setattr__(self, "replicated", {})  # name -> variable: created once, kept across worlds
        # A tape brings no step counter, and random-k, PowerSGD without warm start and the sketches
        # draw from the step: an exchange that owns its state counts its own steps. A stateless one
        # (none, fp16) creates no variable, so a tape may make it inside a tf.function.
        self.own_steps = (None if new_replicated or not self.compression.requires_optimizer else
                          self._state_variable(StateSpec("steps", (), REPLICATED, tf.int64), None))
        # The step the warm-up counts: the optimizer's, else this exchange's own (not tracked here).
        object.__setattr__(self, "_step_variable",
                           getattr(self._holder, "iterations", None) if self.own_steps is None else self.own_steps)
        self.rule.build(lambda spec: self._state_variable(spec, None))
        self.world = None
        self._plan_world()
        self.built = True
        self._warn_if_the_fit_is_all_warmup()

    def settle(self, optimizer):
        """The compression this exchange trains with under `optimizer` (None: a tape): the user's, with its worker
        rule's measured defaults for the arguments left out (rules.WorkerRule.settle). DistributedOptimizer settles
        when it wraps, so the compression is the same before the first step, after it and in model files."""
        settled = rules.choose(self.compression.update_rule, optimizer, self.requested_warmup_steps).settle(
            self.compression)
        if settled is not self.compression and (not hvd.is_initialized() or hvd.rank() == 0):
            log.info("hvd_compress: under %s, %r trains as %r (the defaults measured best there; give the arguments "
                     "to choose others).", type(optimizer).__name__, self.compression, settled)
        self.compression = settled

    def plan_fit(self, end_step):
        """Before the first step of a model.fit that ends at optimizer step `end_step` (None: unknown; hvd_compress's
        callbacks call it): until a step is traced, 1-bit Adam's default warm-up follows the fit's length
        (adam.default_warmup_steps); a warm-up that covers the whole fit is reported before its first step."""
        self.fit_end = end_step
        if self.built and self.requested_warmup_steps is None and not self.traced and self._choose_warmup():
            self.agreement.replan(self._settings())
        if self.built:
            self._warn_if_the_fit_is_all_warmup()

    def _choose_warmup(self):
        """The rule's default warm-up for the coming fit (1-bit Adam's: adam.default_warmup_steps), said on rank 0;
        whether the rule chooses one."""
        chosen = self.rule.default_warmup(self.fit_end)
        if chosen is None:
            return False
        self.warmup_steps, self.warmup_source = chosen
        self.rule.warmup_steps = self.warmup_steps
        if hvd.rank() == 0:
            log.info("hvd_compress: %s warms up for %d steps at full precision (%s; warmup_steps= sets it).",
                     self.collective_name, self.warmup_steps, self.warmup_source)
        return True

    def note_fit_end(self, step):
        """After a model.fit, at optimizer step `step`: where plan_fit could not tell before (a fit of unknown
        length), whether it ended inside the warm-up, compressing nothing."""
        if self.built and self.fit_end is None and 0 < step <= self.warmup_steps:
            self._warn_warmup(step, f"this model.fit ended at step {step}")

    def _warn_if_the_fit_is_all_warmup(self):
        if self.fit_end is not None and self.fit_end <= self.warmup_steps:
            self._warn_warmup(self.fit_end, f"it covers this whole model.fit, which ends at step {self.fit_end}")

    def _warn_warmup(self, end, when):
        """Once per fit's end step (each of hvd_compress's callbacks may ask)."""
        if self._warned_fit_end == end:
            return
        self._warned_fit_end = end
        if hvd.rank() == 0:
            log.warning("hvd_compress: %s's warm-up is %d steps at full precision (%s), and %s: every step "
                        "of it sends uncompressed gradients, and nothing is compressed. Give the optimizer "
                        "warmup_steps= fewer steps (None: %.0f%% of the steps model.fit plans, under 1-bit Adam).",
                        self.collective_name, self.warmup_steps, self.warmup_source, when, 100 * adam.WARMUP_FRACTION)

    def _in_warmup(self):
        """Whether the coming step travels at full precision (read in the step, and between steps)."""
        return tf.cast(tf.convert_to_tensor(self._step_variable), tf.int64) < self.warmup_steps

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
        buckets = plan_buckets(self.layout, rank, size, self.process_set, self.collective_name)
        if self.hierarchical:
            hosts.check_hosts_can_be_planned(self.process_set)
            self.hosts = hosts.HostSets()
            if self.hosts.cross_size == 1 and hvd.rank() == 0:
                log.warning("hvd_compress: hierarchical=True on a single host: the ranks average inside the host at "
                            "full precision and nothing crosses a host link, so %r compresses nothing here. Use "
                            "hierarchical=False to compress between these ranks.", self.compression)
            self.exchanges = [exchange.Hierarchical(self.compression, bucket, self.hosts, self.rule.feeds_back)
                              for bucket in buckets]
        else:
            self.exchanges = [exchange.plan(self.compression, bucket) for bucket in buckets]
        if self.warmup_steps:
            self.exchanges = [exchange.Switching(exchange.OrderedMean(bucket), ex, self._in_warmup)
                              for bucket, ex in zip(buckets, self.exchanges)]
        rank_state = RankLocalState(rank, size, self.hosts.local_size if self.hierarchical else 1)

        def new_state(spec):
            return self._state_variable(spec, rank_state)

        def per_variable(kind, i):  # keyed by position: Keras's layer names depend on what was built before
            return new_state(StateSpec(f"{kind}/{i}", self.layout.shapes[i], PER_RANK,
                                       state_dtype(self.variable_dtypes[i])))

        self.rule.warmup_steps = self.warmup_steps
        self.rule.plan(lambda kind: [per_variable(kind, i) for i in self.layout.compressed])
        if self.accumulate:
            self.accumulated = [per_variable("accumulated_gradient", i) for i in range(len(self.variable_ids))]
            self.passes = new_state(StateSpec("accumulated_passes/all", (), PER_RANK, tf.int64))
        # Each exchange's own state (the onebit server residual, PowerSGD's Q), by bucket.
        self.exchange_state = [{spec.name: new_state(spec._replace(name=f"{spec.name}/{self._collective(b)}"))
                                for spec in ex.state} for b, ex in enumerate(self.exchanges)]
        if self.monitor is not None:
            self.monitor.build(self.variable_names, self.layout, new_state)
        object.__setattr__(self, "rank_state", rank_state)
        state.track(self._holder, rank_state, self.state_key)  # a pending checkpoint restore happens here
        self._plan_agreement(previous)
        dense_compression = NoneCompressor if self.compression.requires_optimizer else self.compression
        if self.hierarchical:
            self.dense_exchange = exchange.HierarchicalDense(
                dense_compression, [self.layout.shapes[i] for i in self.layout.dense],
                [self.variable_dtypes[i] for i in self.layout.dense], self.hosts, self.op,
                self.fusion_threshold_bytes, f"{self.collective_name}.dense")
            return
        self.dense_exchange = exchange.plan_dense(
            dense_compression, [self.layout.shapes[i] for i in self.layout.dense],
            [self.variable_dtypes[i] for i in self.layout.dense], rank, size, self.process_set, self.op,
            self.predivide, self.fusion_threshold_bytes, f"{self.collective_name}.dense")

    def _collective(self, b):
        """The name of bucket b's collectives."""
        return bucket_name(self.collective_name, b)

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
        self.agreement.plan(self._settings(), self.rank_state, self.process_set, self.collective_name,
                            None if previous_world is None else previous_world[1])

    def _settings(self):
        """What every rank must have alike (checked at the first step of a plan)."""
        return (f"{self.compression!r} op={self.op} "
                f"min_compress_size={self.min_compress_size} "
                f"fusion_threshold_bytes={self.fusion_threshold_bytes} "
                f"rule={type(self.rule).__name__} warmup_steps={self.warmup_steps} "
                f"hierarchical={self.hosts.layout if self.hierarchical else False} "
                f"variables={[(s, d.name) for s, d in zip(self.layout.shapes, self.variable_dtypes)]}")

    @property
    def residuals(self):
        """This rank's residual of each compressed variable (None where its rule keeps none)."""
        return self.rule.residuals

    @property
    def low_rank_q(self):
        """PowerSGD's warm-started Q factors (replicated state)."""
        return [v for name, v in self.replicated.items() if name.startswith("powersgd_q/")]

    @property
    def server_residuals(self):
        """This rank's shards of the two-way server residuals (sharded state)."""
        return [v for name, v in self.rank_state.variables.items() if name.startswith("server_residual")]

    @property
    def bytes_sent(self):
        """Bytes one worker sends per step (it receives as many)."""
        return sum(ex.bytes_sent for ex in self.exchanges) + self.dense_exchange.bytes_sent

    @property
    def cross_host_bytes(self):
        """hierarchical: the bytes one worker sends to other hosts per step (the rest stays inside its host)."""
        if not self.hierarchical:
            raise ValueError("cross_host_bytes is counted for hierarchical=True; bytes_sent counts a flat exchange.")
        return sum(ex.cross_host_bytes for ex in self.exchanges) + self.dense_exchange.cross_host_bytes

    @property
    def uncompressed_bytes(self):
        """What Horovod's fp32 ring allreduce of every gradient would send per step."""
        return exchange.allreduce_bytes(4 * sum(self.layout.sizes), self.process_set.size())

    def residual_norm(self):
        """Global norm of the worker residuals and of what the exchanges hold back (this rank's
        server residuals; FetchSGD: an estimate from its error sketches), every setting's."""
        tensors = [r for r in self.residuals if r is not None]
        for ex, own in zip(self.exchanges, self.exchange_state):
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
        whose rule takes the step itself; an exchange.EncodedPart for exchange.subtract where the bucket's update
        may stay encoded, `_subtracts_encoded`) or an averaged gradient (everything else); None where the gradient
        is None (zeros travel in its place, and its state is left as it was). step: the optimizer's
        iteration; None (a tape) uses and advances the exchange's own count, `own_steps`."""
        self.traced = True
        self.agreement.check()
        if self.hierarchical:  # the hosts' process sets, made by every rank at its first step
            with tf.init_scope():
                self.hosts.resolve()
        with tf.name_scope("hc_exchange"):  # name scopes read by benchmarks/overhead.py
            counted = step is None and self.own_steps is not None
            if counted:
                step = self.own_steps.read_value()
            elif step is None:  # stateless: no exchange reads the step
                step = tf.constant(0, tf.int64)
            info = self.rule.begin(step, learning_rate, momentum, nesterov)
            absent = {i for i, g in enumerate(grads) if g is None}
            with tf.control_dependencies(state.check_world(*self.world, self.process_set)):
                grads = [tf.identity(g) for g in self.prepare(grads)]
            out = list(grads)
            dense = self.dense_exchange([grads[i] for i in self.layout.dense])
            for i, g in zip(self.layout.dense, dense):
                out[i] = g
            if self.monitor is not None:
                self.monitor.observe(grads)
            for bucket, ex, own in zip(self.layout.buckets, self.exchanges, self.exchange_state):
                feed = self.rule.feed_apart if ex.adds_residual else self.rule.feed
                parts = [flat(tf.zeros(self.layout.shapes[i]) if i in absent else feed(
                    self.layout.slot[i], tf.cast(grads[i], tf.float32), info), self.layout.sizes[i])
                    for i in bucket]  # (static sizes, whatever shape the gradient arrived with)
                result = self._run(ex, own, bucket, parts, info)
                updates = result.update
                if not self._subtracts_encoded(bucket):
                    updates = exchange.decoded(updates, [self.layout.sizes[i] for i in bucket])
                    if self.op == hvd.Sum:
                        updates = [u * self.process_set.size() for u in updates]
                residuals = result.residual if result.residual is not None else [None] * len(bucket)
                for i, residual, update in zip(bucket, residuals, updates):
                    if i in absent:  # its state is left as it was (Adam's slots too, as Keras leaves them)
                        continue
                    update = self.rule.finish(self.layout.slot[i], update, residual, info)
                    out[i] = update if isinstance(update, exchange.EncodedPart) else tf.cast(  # (decoded into the
                        tf.reshape(update, self.layout.shapes[i]), self.variable_dtypes[i])  # variable: subtract)
            if counted:
                self.own_steps.assign_add(1)
            return [None if i in absent else g for i, g in enumerate(out)]

    def _subtracts_encoded(self, bucket):
        """Whether the bucket's update may reach the optimizer encoded (exchange.EncodedPart), to be
        decoded straight into its variables: where the rule's delta is the update as it stands
        (`takes_encoded_update`), averaged (hvd.Sum scales it first) and for float32 variables."""
        return (self.rule.takes_encoded_update and self.op == hvd.Average
                and all(self.variable_dtypes[i] == tf.float32 for i in bucket))

    def _run(self, ex, own_state, bucket, parts, step):
        """Runs one bucket's exchange, stores its new state and masks the worker's momentum where it
        says so; returns its Exchanged."""
        result = ex(parts, own_state, step)
        if self.rule.feeds_back and not self.hierarchical and result.residual is None:
            raise TypeError(f"{type(ex).__name__} returned no residual, and {self.compression!r}'s update rule "
                            f"({self.compression.update_rule}) keeps one: return Exchanged(residual, ...).")
        with tf.name_scope("hc_state_update"):
            for name, value in result.state.items():
                own_state[name].assign(value)
        if ex.masks_momentum:  # sketched SGD: the worker's momentum is zeroed where it applied the update
            self.rule.exchange_applied([self.layout.slot[i] for i in bucket], result.applied,
                                       [self.layout.sizes[i] for i in bucket])
        if self.recall_totals is not None and result.applied is not None:
            self._record_recall(exchange.concat(parts), result.applied, ex)
        return result

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
        if isinstance(self.compression, AdaptiveCompression):
            raise ValueError("The recall metric is measured for sketched SGD alone, not under Accordion: measure "
                             "it in a run without the Accordion callback.")
        if getattr(self.compression, "mode", None) != "sketched":
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


def refuse_two_way(two_way):
    """two_way is onebit's own option now."""
    if two_way is not None:
        raise TypeError(f"two_way={two_way!r}: two_way is an option of onebit now; pass "
                        f"compression=hvd_compress.Compression.onebit(two_way={two_way!r}) and leave two_way out.")


def _check_arguments(compression, op, min_compress_size, fusion_threshold_bytes, warmup_steps):
    if isinstance(compression, type) and issubclass(compression, StatefulCompressor):
        compression = compression()  # e.g. Compression.onebit passed uncalled: its defaults
    if not hasattr(compression, "requires_optimizer"):
        raise TypeError(f"compression must be one of hvd_compress.Compression (e.g. "
                        f"Compression.onebit()), got {compression!r}.")
    if compression.requires_optimizer and getattr(compression, "update_rule", None) not in UPDATE_RULES:
        raise TypeError(f"{compression!r} states update_rule={getattr(compression, 'update_rule', None)!r}; a "
                        f"compressor's update_rule is one of {UPDATE_RULES} (hvd_compress.compressor).")
    if (compression.requires_optimizer or exchange.is_fp16(compression)) and op not in (hvd.Average, hvd.Sum):
        raise ValueError(f"op must be hvd.Average or hvd.Sum with {compression!r}; Adasum and other "
                         "reductions do not apply to compressed payloads (for Adasum in 16 bits use "
                         "Horovod's own DistributedOptimizer).")
    if not isinstance(min_compress_size, int) or min_compress_size < 1:
        raise ValueError(f"min_compress_size must be a positive integer, got {min_compress_size!r}.")
    if warmup_steps is not None and (isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int)
                                     or warmup_steps < 0):
        raise ValueError(f"warmup_steps must be None (the default: 0, and under 1-bit Adam a warm-up that follows "
                         f"the run) or an integer >= 0, got {warmup_steps!r}.")
    if not isinstance(fusion_threshold_bytes, int) or fusion_threshold_bytes < 1:
        raise ValueError(f"fusion_threshold_bytes must be a positive integer, got "
                         f"{fusion_threshold_bytes!r}.")
    return compression

