"""Stochastic Gradient Push: decentralized PushSum training over hvd.alltoall.

Assran, Loizou, Ballas, Rabbat, "Stochastic Gradient Push for Distributed Deep
Learning", ICML 2019. Each rank i keeps a PushSum numerator x_i and weight w_i;
the model (the Keras variables) holds the de-biased z_i = x_i / w_i. Per step:

    u_i = the wrapped optimizer's update from z_i's gradient (its own, no allreduce)
    x_i = w_i z_i + u_i                  (the paper's x_i <- x_i - lr grad, on the numerator)
    send (x_i, w_i) / (p + 1) to each of the p out-peers of step t, keep that share
    x_i, w_i <- kept share + everything received;  z_i = x_i / w_i

The update lands on the numerator, so the average of all mass (in flight included)
moves by the mean update whatever the w_i. Without overlap w_i stays 1 (every graph
here is regular: a rank receives as many shares as it sends); with overlap a rank
holds about 2/3 of its weight while a third is in flight, and a step on z_i instead
would train at about 2/3 of the learning rate.

Every step's mixing matrix is column-stochastic (each rank splits all of its
mass), so sum_i w_i = n and sum_i x_i are preserved, and ranks reach consensus
on the average. Graphs (out-peers of rank i at step t, L = ceil(log2 n)):
- "exponential": i + 2^(t mod L)                      (the paper's, 1 peer)
- "exponential2": i + 2^(t mod L), i + 2^((t+1) mod L)  (2 peers)
- "ring": i + 1                                       (static)
all mod n, for any n >= 2.

Transports. transport="alltoall" (the default, any launch): one hvd.alltoall per
step whose splits are zero except for the peers; every rank calls it every step,
so the ranks run in lockstep. transport="mpi" (an MPI launch, mpi4py): each rank
posts its sends to its out-peers and its receives from its in-peers on a
communication thread (p2p.Mailbox) and waits only for its in-peers' messages.

overlap=True (overlap SGP, tau = 1): the message sent at step t is mixed in at
step t + 1, so it can travel while the next gradient is computed; the PushSum
weights account for the mass in flight. Over alltoall the collective still runs
within step t (the message is held in a variable until t + 1); over MPI it
travels on the communication thread during step t + 1's compute, and a rank that
is late by less than a step delays nobody. Both transports give the same bits.
average_every=H: an exact allreduce average every H steps (0: never).
"""
import math

import numpy as np
import tensorflow as tf

import horovod.tensorflow as hvd
from hvd_compress import exchange, ops, p2p, state, uneven
from hvd_compress.keras_compat import (WrapperCore, refuse_saved_process_set, refuse_wrapped, register_loader,
                                       saved_process_set, wrap_in_place)
from hvd_compress.gradient_exchange import check_known_variables
from hvd_compress.optimizer import refuse_loss_scale_optimizer, refuse_xla
from hvd_compress.state import PER_RANK, RankLocalState, StateSpec

GRAPHS = ("exponential", "exponential2", "ring")
#: alltoall: one hvd.alltoall per step, every rank in lockstep; mpi: point-to-point (p2p.Mailbox).
TRANSPORTS = ("alltoall", "mpi")


def out_peers(graph, rank, size, step):
    """The ranks that `rank` sends to at `step` (a Python function of Python ints)."""
    if graph not in GRAPHS:
        raise ValueError(f"graph must be one of {GRAPHS}, got {graph!r}.")
    phases = max(1, math.ceil(math.log2(size)))
    if graph == "ring":
        hops = [1]
    elif graph == "exponential":
        hops = [2 ** (step % phases)]
    else:
        hops = [2 ** (step % phases), 2 ** ((step + 1) % phases)]
    peers = []
    for hop in hops:
        peer = (rank + hop) % size
        if peer != rank and peer not in peers:
            peers.append(peer)
    return peers


def in_peers(graph, rank, size, step):
    """The ranks that send to `rank` at `step`, in rank order."""
    return [r for r in range(size) if rank in out_peers(graph, r, size, step)]


def schedule_period(graph, size):
    """Steps after which a graph's schedule repeats."""
    return 1 if graph == "ring" else max(1, math.ceil(math.log2(size)))


def mixing_matrix(graph, size, step):
    """P[j, i]: the share of rank i's mass that rank j holds after step (columns sum to 1)."""
    matrix = np.zeros((size, size))
    for i in range(size):
        peers = out_peers(graph, i, size, step)
        share = 1.0 / (len(peers) + 1)
        matrix[i, i] += share
        for j in peers:
            matrix[j, i] += share
    return matrix


def _steps_or_none(value, minimum):
    """Whether `value` is None or a number of steps (an int, not a bool) of at least `minimum`."""
    return value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= minimum)


class PushSum:
    """The gossip step for a fixed list of variables; state through the given factory."""

    def __init__(self, graph, overlap, average_every, process_set, name="hc.pushsum", transport="alltoall",
                 max_drift=None):
        if graph not in GRAPHS:
            raise ValueError(f"graph must be one of {GRAPHS}, got {graph!r}.")
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}.")
        if transport == "mpi" and process_set != hvd.global_process_set:
            raise ValueError("transport='mpi' gossips among all ranks of the job: leave process_set at its default, "
                             "or use transport='alltoall'.")
        if transport == "mpi" and hvd.is_initialized():
            p2p.mpi_world()  # a Gloo launch, or no mpi4py: refused here, before any collective
        if not isinstance(overlap, bool):
            raise TypeError(f"overlap must be True or False, got {overlap!r}.")
        if not _steps_or_none(average_every, 0):
            raise ValueError(f"average_every must be None, 0 (never) or a positive number of steps, "
                             f"got {average_every!r}.")
        if not _steps_or_none(max_drift, 1):
            raise ValueError(f"max_drift must be None (no bound but the graph's) or a number of steps >= 1, "
                             f"got {max_drift!r}.")
        if max_drift is not None and transport != "mpi":
            raise ValueError(f"max_drift bounds point-to-point gossip (transport='mpi'); over {transport!r} the ranks "
                             "run in lockstep already: leave max_drift=None.")
        self.graph, self.overlap, self.average_every = graph, overlap, average_every or 0
        self.max_drift = max_drift
        self.process_set, self.name, self.transport = process_set, name, transport
        uneven.for_process_set(process_set)  # its variables now: made in a traced step, they would retrace it
        self.mailbox = None  # transport="mpi": this process's p2p.Mailbox, from the first plan on
        self.agreement = state.RanksAgreement()  # due at the first step of each plan
        self.built = False

    def build(self, variables, holder):
        """Plans the gossip for this world and creates its per-rank state (w_i and the mass in
        flight), tracked for checkpoints by `holder` (the optimizer)."""
        if self.built:
            return
        self.variable_ids = [id(v) for v in variables]
        self.shapes = [tf.TensorShape(v.shape) for v in variables]
        self.sizes = [int(shape.num_elements()) for shape in self.shapes]
        self.holder, self.rank_state = holder, None
        self.plan_world()
        self.built = True

    def plan_world(self):
        """Plans for this rank and world size (again after an elastic reset): w_i = 1 and no mass in
        flight, so the ranks restart from the (broadcast) model as a valid PushSum state."""
        previous = None if self.rank_state is None else self.rank_state.size
        self.size, self.rank = self.process_set.size(), self.process_set.rank()
        if self.size < 2:
            raise ValueError("PushSumOptimizer needs at least 2 ranks.")
        if self.transport == "mpi" and self.mailbox is None:
            self.mailbox = p2p.Mailbox(self.max_drift)
        self.rank_state = RankLocalState(self.rank, self.size)
        self.weight = self.rank_state.add(StateSpec("pushsum_weight/all", (), PER_RANK, initializer=tf.ones))
        d = sum(self.sizes) + 1
        self.in_flight = (self.rank_state.add(StateSpec("pushsum_in_flight/all", (d,), PER_RANK))
                          if self.overlap else None)
        # Bytes one rank sends per step: (d + 1) floats to each out-peer.
        peers = max(len(out_peers(self.graph, self.rank, self.size, t))
                    for t in range(schedule_period(self.graph, self.size)))
        self.bytes_sent = 4 * d * peers
        state.track(self.holder, self.rank_state)  # a pending checkpoint restore happens here
        settings = (f"PushSum(graph={self.graph}, overlap={self.overlap}, average_every={self.average_every}, "
                    f"transport={self.transport}, max_drift={self.max_drift}) "
                    f"variables={[tuple(s) for s in self.shapes]}")
        self.agreement.plan(settings, self.rank_state, self.process_set, self.name, previous)
        self.world = (hvd.rank(), self.size)

    def _send(self, payload, step):
        """alltoall of `payload` to this step's out-peers; returns the sum of what arrives."""
        period = schedule_period(self.graph, self.size)
        d = payload.shape[0]

        def for_phase(phase):
            peers = out_peers(self.graph, self.rank, self.size, phase)
            splits = [d if r in peers else 0 for r in range(self.size)]
            senders = in_peers(self.graph, self.rank, self.size, phase)
            outgoing = tf.tile(payload, [len(peers)])
            received, _ = hvd.alltoall(outgoing, splits=splits, process_set=self.process_set,
                                       name=f"{self.name}.phase{phase}")
            return tf.reduce_sum(tf.reshape(received, [len(senders), d]), axis=0)

        if period == 1:
            return for_phase(0)
        branches = [lambda p=p: for_phase(p) for p in range(period)]
        return tf.switch_case(tf.cast(step % period, tf.int32), branches)

    def before_step(self, variables):
        """z_i before the wrapped optimizer's step, as float32, where w_i differs from 1 (overlap); None where it
        stays 1, and w_i z_i + u_i is the stepped z_i. (A value read now: tf.cast alone would return a float32
        variable itself, read after the step.)"""
        return [tf.cast(tf.identity(v), tf.float32) for v in variables] if self.overlap else None

    def __call__(self, variables, step, before=None):
        """One gossip round on the variables, stepped by the wrapped optimizer from `before` (before_step's)."""
        self.agreement.check()
        with tf.control_dependencies(state.check_world(*self.world, self.process_set)):
            w = tf.identity(self.weight)
        # The share (x_i, w_i) / (p + 1) in one pass (ops.push_sum_share), x_i = w_i z_i + u_i: the stepped z_i (times
        # w_i, which is 1) where before is None, else the stepped z_i - (1 - w_i) before (u_i = stepped z_i - before).
        # The mass travels in float32 whatever the variables' dtype (float16 variables included).
        peers = len(out_peers(self.graph, self.rank, self.size, 0))
        share = ops.push_sum_share([tf.cast(v, tf.float32) for v in variables], w, peers + 1, before)
        average_now = (tf.equal((step + 1) % self.average_every, 0) if self.average_every else tf.constant(False))
        if self.transport == "mpi":
            mixed = self._post_and_mix(share, step, average_now)
        else:
            received = self._send(share, step)
            if self.overlap:
                mixed = share + self.in_flight
                self.in_flight.assign(received)
            else:
                mixed = share + received
        if self.average_every:
            mixed = tf.cond(average_now, lambda: self._exact_average(mixed), lambda: mixed)
        self._write(variables, mixed)

    def _post_and_mix(self, share, step, average_now):
        """transport="mpi": posts this step's share to its out-peers and returns it mixed with what arrived, added
        in alltoall's order (the same bits): with overlap, share + what the in-peers sent the step before (after
        `flush`, or from a checkpoint, the mass held in `in_flight`, which is then zeroed), plus on an averaging
        step what this step's in-peers sent, so that nothing is in flight; without, share + what this step's
        in-peers sent. The sums are NumPy's (p2p.added), in the communication's own function, each addition one
        pass over the model, into a buffer that TensorFlow takes without a copy."""
        mailbox, period = self.mailbox, schedule_period(self.graph, self.size)

        def run(share, step, held, average_now):
            step = int(step)
            earlier = mailbox.collect_pending()
            took_held = earlier is None and self.overlap
            if took_held:
                earlier = held
            phase = step % period
            mailbox.post(step, share, out_peers(self.graph, self.rank, self.size, phase),
                         in_peers(self.graph, self.rank, self.size, phase))
            parts = [share] if earlier is None else [share, earlier]
            if not self.overlap or average_now:
                parts.append(mailbox.collect(step))
            return p2p.added(parts), np.bool_(took_held)

        held = self.in_flight if self.overlap else tf.zeros([], tf.float32)
        mixed, took_held = tf.numpy_function(run, [share, step, held, average_now], [tf.float32, tf.bool],
                                             stateful=True, name=f"{self.name}.p2p")
        mixed.set_shape(share.shape)
        took_held.set_shape([])
        if self.overlap:  # what it held is mixed in now
            with tf.control_dependencies([mixed]):
                tf.cond(took_held, lambda: self.in_flight.assign(tf.zeros_like(self.in_flight)).op, tf.no_op)
        return mixed

    def flush(self):
        """transport="mpi" with overlap, between steps: waits for the messages of the last step and keeps them in
        `in_flight` (per-rank state), so a checkpoint holds all of this rank's mass and MPI holds none of it."""
        if self.mailbox is not None and self.mailbox.pending and tf.executing_eagerly():
            self.in_flight.assign(self.mailbox.collect_pending())

    def _exact_average(self, mixed):
        """Allreduce average of everything, mass in flight included (which is then zero)."""
        if self.transport == "mpi":  # nothing in flight: _post_and_mix collected this step's messages
            return hvd.allreduce(mixed, op=hvd.Average, process_set=self.process_set, name=f"{self.name}.average")
        total = mixed + self.in_flight if self.overlap else mixed
        if self.overlap:
            self.in_flight.assign(tf.zeros_like(self.in_flight))
        return hvd.allreduce(total, op=hvd.Average, process_set=self.process_set,
                             name=f"{self.name}.average")

    def _write(self, variables, mixed):
        w = mixed[-1]
        self.weight.assign(w)
        offset = 0
        for v, size, shape in zip(variables, self.sizes, self.shapes):
            v.assign(tf.cast(tf.reshape(mixed[offset:offset + size] / w, shape), v.dtype))
            offset += size


class _PushSumOptimizerMixin(WrapperCore):
    saved_name = "PushSumOptimizer"
    ranks_diverge = True

    def _hc_init(self, pushsum):
        object.__setattr__(self, "_hc_pushsum", pushsum)

    def _hc_settings(self):
        """PushSumOptimizer's keyword arguments as JSON data (for model files)."""
        return dict(graph=self._hc_pushsum.graph, overlap=self._hc_pushsum.overlap,
                    average_every=self._hc_pushsum.average_every or None, transport=self._hc_pushsum.transport,
                    max_drift=self._hc_pushsum.max_drift,
                    process_set_ranks=saved_process_set(self._hc_pushsum.process_set))

    @staticmethod
    def factory(optimizer, process_set_ranks=None, **settings):
        if process_set_ranks is not None:
            refuse_saved_process_set(process_set_ranks, "PushSumOptimizer")
        return PushSumOptimizer(optimizer, **settings)

    @property
    def pushsum(self):
        return self._hc_pushsum

    @property
    def hc_process_set(self):
        return self._hc_pushsum.process_set

    @property
    def bytes_per_step(self):
        return self._hc_pushsum.bytes_sent

    def _trackable_children(self, save_type="checkpoint", **kwargs):
        # w_i and the mass in flight: in checkpoints, with their owner; never in optimizer.variables
        # (which Horovod broadcasts) nor in model files. Over MPI the mass in flight comes out of MPI first.
        self._hc_pushsum.flush()
        return state.checkpoint_children(super()._trackable_children(save_type, **kwargs),
                                         getattr(self._hc_pushsum, "rank_state", None), save_type)

    def build(self, var_list):
        with tf.init_scope():  # the plan runs a collective (see _DistributedOptimizerMixin.build)
            super().build(var_list)
            self._hc_pushsum.build(list(var_list), holder=self)

    def hc_replan(self):
        """After an elastic reset, on every rank (hvd_compress.elastic.KerasState calls it)."""
        if self._hc_pushsum.built:
            self._hc_pushsum.plan_world()

    def _hc_agree_on_finiteness(self, grads):
        """Before a LossScaleOptimizer checks for an overflow: every rank agrees on whether the
        step is finite, so all skip it or none does (the gossip pairs up)."""
        return exchange.agree_on_finiteness(grads, self._hc_pushsum.process_set, f"{self._hc_pushsum.name}.finite")

    def _hc_step(self, pairs):
        """The wrapped optimizer's step on this rank's gradients, then the gossip."""
        refuse_xla("hvd_compress.PushSumOptimizer")
        object.__setattr__(self, "_hc_stepped", True)
        variables = [v for _, v in pairs]
        with tf.init_scope():
            self.build(variables)
        check_known_variables(self._hc_pushsum.variable_ids, variables, "PushSumOptimizer")
        step = tf.identity(self.iterations)
        before = self._hc_pushsum.before_step(variables)
        iteration = self._hc_wrapped_apply(pairs)
        self._hc_pushsum(variables, step, before)
        return iteration


register_loader(_PushSumOptimizerMixin)


def PushSumOptimizer(optimizer, graph="exponential", overlap=False, average_every=None,
                     process_set=hvd.global_process_set, transport="alltoall", max_drift=None):
    """Wraps a Keras optimizer (Keras 3 or tf_keras) for Stochastic Gradient Push (see the module
    docstring).

    No gradient allreduce happens: each rank steps on its own gradient, then
    gossips its parameters. Use `consensus(model)` to evaluate or save the
    average model, and BroadcastGlobalVariablesCallback(0) so all ranks start alike.
    transport="mpi" sends point-to-point over MPI (launch with horovodrun --mpi or
    mpirun; needs mpi4py): a rank waits only for its in-peers, and with overlap=True
    the messages travel while the next step computes; max_drift=D then keeps every rank within D + 1 steps
    of the slowest (D + 2 with overlap; docs/algorithms.md, "How far ranks drift apart"). Over alltoall the
    ranks run in lockstep.
    """
    refuse_loss_scale_optimizer(optimizer, "hvd_compress.PushSumOptimizer")
    refuse_wrapped(optimizer)
    pushsum = PushSum(graph, overlap, average_every, process_set, transport=transport, max_drift=max_drift)
    wrapped = wrap_in_place(optimizer, _PushSumOptimizerMixin)  # the user's instance, all it holds kept
    wrapped._hc_init(pushsum)
    return wrapped


def consensus(model, process_set=hvd.global_process_set):
    """Sets every rank's model to the exact average of all ranks' models (a collective).

    For evaluation and export: the model to save is the average. Training can
    go on afterwards (the average is a valid PushSum state with weight 1 on
    every rank when no message is in flight).
    """
    optimizer = getattr(model, "optimizer", None)
    pushsum = getattr(getattr(optimizer, "inner_optimizer", optimizer), "pushsum", None)
    if pushsum is not None:
        pushsum.flush()  # over MPI: nothing left in MPI's hands
    for i, v in enumerate(model.weights):  # bfloat16 (which Horovod cannot sum) averaged as float32
        average = hvd.allreduce(tf.cast(v, exchange.DenseAllreduce.summed_dtype(v.dtype)), op=hvd.Average,
                                process_set=process_set, name=f"hc.consensus.{i}")
        v.assign(tf.cast(average, v.dtype))


def parameter_spread(model, process_set=hvd.global_process_set):
    """Max over parameters of (max - min across ranks): how far the ranks are from consensus."""
    flat = tf.concat([tf.reshape(tf.cast(v, tf.float32), [-1]) for v in model.trainable_weights], 0)
    high = hvd.allreduce(flat, op=hvd.Max, process_set=process_set, name="hc.spread.max")
    low = hvd.allreduce(flat, op=hvd.Min, process_set=process_set, name="hc.spread.min")
    return float(tf.reduce_max(high - low))
