"""Keras callbacks for either Keras (Keras 3 or tf_keras): compression metrics in the logs (and
so in TensorBoard), Accordion's adaptive compression and batch size, SGP's consensus, and the two Horovod
callbacks that Horovod's Keras layer cannot run under Keras 3 (broadcasting the initial state,
averaging metrics).

They subclass the Callback of the Keras that `tf.keras` is: TF_USE_LEGACY_KERAS decides, as it decides the
user's own `tf.keras` (tf_keras under TF_USE_LEGACY_KERAS=1, else Keras 3), so importing hvd_compress imports
no other Keras."""
import sys

import numpy as np
import tensorflow as tf

import horovod.tensorflow as hvd
from hvd_compress import accordion, gossip, uneven
from hvd_compress.keras_compat import WrapperCore, is_distributed, sgd_classes



class Callback(tf.keras.callbacks.Callback):
    """The base of hvd_compress's callbacks: the Callback of the Keras that `tf.keras` is. tf_keras's model.fit
    cannot run Keras 3's callbacks (it asks them for hooks they lack); Keras 3's runs tf_keras's."""

    def set_model(self, model):
        tf_keras = sys.modules.get("tf_keras")
        if (tf.keras.callbacks.Callback.__module__.startswith("keras.") and tf_keras is not None
                and isinstance(model, tf_keras.Model)):
            raise TypeError(
                f"hvd_compress.callbacks.{type(self).__name__} is a Keras 3 callback (tf.keras is Keras 3 here), and "
                "this model is tf_keras's: set TF_USE_LEGACY_KERAS=1 before TensorFlow is imported to train "
                "tf_keras models (Horovod's Keras layer needs it too), or build the model with Keras 3.")
        super().set_model(model)


def hc_optimizer(model):
    """The model's optimizer inside any LossScaleOptimizer."""
    optimizer = model.optimizer
    return getattr(optimizer, "inner_optimizer", optimizer)


def tf_variable(v):
    """The tf.Variable behind a Keras 3 variable (Horovod's collectives take tf.Variables)."""
    return v if isinstance(v, tf.Variable) else v.value


def broadcast_variables(variables, root_rank=0, process_set=hvd.global_process_set, name="hc.broadcast_variables"):
    """Every rank's `variables` take rank `root_rank`'s values, as Horovod's `hvd.broadcast_variables`, for
    tf.Variables and Keras 3's variables alike, in one collective: the variables' bytes travel as one uint8
    buffer (each dtype bit for bit). Horovod's own traces a function of one broadcast a variable for every new
    list of variables, which costs a model.fit more than the broadcast itself on small models and sends one
    collective a variable. `variables` may be tf_keras's `optimizer.variables`, a method (Keras 3's is a list)."""
    variables = [tf_variable(v) for v in (variables() if callable(variables) else variables)]
    if not variables:
        return
    pieces = [tf.reshape(tf.bitcast(_as_bitcastable(v.read_value()), tf.uint8), [-1]) for v in variables]
    received = hvd.broadcast(tf.concat(pieces, 0), root_rank, name=name, process_set=process_set)
    for v, piece in zip(variables, tf.split(received, [int(p.shape[0]) for p in pieces])):
        v.assign(_from_bytes(piece, v.dtype, v.shape))


def _as_bitcastable(value):
    return tf.cast(value, tf.uint8) if value.dtype == tf.bool else value


def _from_bytes(piece, dtype, shape):
    """The inverse of broadcast_variables's bytes: a value of `dtype` and `shape`."""
    wire = tf.uint8 if dtype == tf.bool else dtype
    size = wire.size
    value = tf.bitcast(tf.reshape(piece, list(shape) + ([size] if size > 1 else [])), wire)
    return tf.cast(value, tf.bool) if dtype == tf.bool else value


def auto_compression_of(model):
    """The model's optimizer's Compression.auto() while it has not decided, else None."""
    auto = getattr(hc_optimizer(model), "hc_auto", None)
    return auto if auto is not None and auto.decision is None else None


def plan_fit(model, params):
    """Before model.fit's first step: the optimizer step at which the fit ends (its epochs x steps per epoch,
    counted from epoch 0 as Keras counts them, or at least one epoch on from the optimizer's step), for the
    exchange's warm-up (GradientExchange.plan_fit); None where the fit's length is unknown."""
    optimizer = hc_optimizer(model)
    steps, epochs = (params or {}).get("steps"), (params or {}).get("epochs")
    if not isinstance(optimizer, WrapperCore):
        return
    if not steps or not epochs:
        optimizer.hc_plan_fit(None)
        return
    passes = getattr(optimizer, "_hc_backward_passes", 1)  # backward passes (batches) per optimizer step
    done = int(optimizer.iterations.numpy())
    optimizer.hc_plan_fit(max(epochs * steps // passes, done + steps // passes))


def check_distributed_training(model, params, process_set=hvd.global_process_set):
    """Before the first step of model.fit on more than one rank (a collective; BroadcastGlobalVariablesCallback
    and MetricAverageCallback run it at on_train_begin, unless given allow_undistributed=True):
    - the model's optimizer (inside any LossScaleOptimizer) must be distributed, by hvd_compress or
      by Horovod: otherwise every rank would train alone and the ranks drift apart in silence;
    - every rank must run the same number of steps per epoch (Keras's params["steps"]): otherwise
      the rank with more waits at the epoch's end, forever, in a collective that the others never
      join."""
    if process_set.size() == 1:
        return
    if getattr(model, "optimizer", None) is not None and not is_distributed(model.optimizer):
        raise ValueError(
            f"model.optimizer is a plain {type(hc_optimizer(model)).__name__} on "
            f"{process_set.size()} ranks: each rank would train alone and the ranks drift apart. Compile the model "
            "with hvd_compress.DistributedOptimizer(optimizer, compression=...) (or load its file with "
            "hvd_compress.load_model, which wraps the saved optimizer); to train each rank alone on purpose, give "
            "the hvd_compress callbacks allow_undistributed=True.")
    steps = params.get("steps") if params else None
    everyone = hvd.allgather_object(steps, process_set=process_set, name="hc.steps_per_epoch")
    if len(set(everyone)) > 1:
        raise ValueError(
            f"The ranks would run different numbers of steps per epoch: {everyone} (by rank). Every step's "
            "exchange needs every rank, so the rank with more steps would wait forever at the epoch's end. Give "
            "each rank the same number of batches: shard the data evenly (e.g. dataset.shard(hvd.size(), "
            "hvd.rank()) on a dataset whose size divides by hvd.size() times the batch size, or .take() the "
            "smallest count), or pass model.fit(..., steps_per_epoch=N) with the same N everywhere.")


def stop_together_of(model):
    """The uneven.StopTogether of the model's hvd_compress optimizer; None for another optimizer."""
    process_set = getattr(hc_optimizer(model), "hc_process_set", None)
    return None if process_set is None else uneven.for_process_set(process_set)


def stop_together_in_fit(model, params, on, process_set):
    """At model.fit's start (on=True, a collective) and end: where any rank's data has an unknown length
    (Keras's params["steps"] is None) and more than one rank trains, the ranks end each epoch together where
    the first runs out (uneven.StopTogether; model.train_function in an uneven.EndsTogether while the fit
    runs). A fit that raised left it on: the next fit sets it again."""
    agreement = stop_together_of(model)
    if agreement is None or agreement.process_set.size() == 1:
        return
    unknown = on and any(hvd.allgather_object((params or {}).get("steps") is None, process_set=process_set,
                                              name="hc.unknown_length"))
    agreement.turn(unknown)
    wrapped = isinstance(model.train_function, uneven.EndsTogether)
    if unknown and not wrapped:
        steps_per_execution = int(np.asarray(getattr(model, "steps_per_execution", 1) or 1))
        model.train_function = uneven.EndsTogether(model.train_function, agreement, steps_per_execution)
    elif wrapped and not unknown:
        model.train_function = model.train_function.train_function


def end_of_epoch_steps(model):
    """The first hook after an epoch's steps (validation's start, or the epoch's end), before any collective
    of a callback: this rank's StopTogether ends the pass (the ranks whose epoch Keras ended by its count of
    steps, not by the data running out, say so to any rank still in a step)."""
    agreement = stop_together_of(model)
    if agreement is not None:
        agreement.end()


class _DistributedTrainingCallback(Callback):
    """What BroadcastGlobalVariablesCallback and MetricAverageCallback share: check_distributed_training
    at on_train_begin (where allow_undistributed is False), the check that the first step went
    through the wrapper, and the ranks ending each epoch together on data of unknown length
    (stop_together_in_fit)."""

    def __init__(self, process_set=hvd.global_process_set, allow_undistributed=False):
        super().__init__()
        self.process_set, self.allow_undistributed = process_set, allow_undistributed
        self.first_batch = False

    def on_train_begin(self, logs=None):
        self.first_batch = True
        plan_fit(self.model, self.params)
        if not self.allow_undistributed:
            check_distributed_training(self.model, self.params, self.process_set)
        stop_together_in_fit(self.model, self.params, True, self.process_set)

    def on_epoch_begin(self, epoch, logs=None):
        agreement = stop_together_of(self.model)
        if agreement is not None:
            agreement.begin_pass()

    def on_test_begin(self, logs=None):
        end_of_epoch_steps(self.model)

    def on_epoch_end(self, epoch, logs=None):
        end_of_epoch_steps(self.model)

    def on_train_end(self, logs=None):
        stop_together_in_fit(self.model, self.params, False, self.process_set)
        exchange = getattr(hc_optimizer(self.model), "compression_exchange", None)
        if exchange is not None:
            exchange.note_fit_end(int(hc_optimizer(self.model).iterations.numpy()))

    def on_train_batch_begin(self, batch, logs=None):
        auto = auto_compression_of(self.model)
        if auto is not None:
            auto.batch_begins(int(hc_optimizer(self.model).iterations.numpy()))

    def on_train_batch_end(self, batch, logs=None):
        """After the first batch: the step Keras ran must have been the wrapper's. An optimizer wrapped
        after model.fit traced its step (Keras keeps that step until model.compile) is not in it. Compression.auto()
        times the step and, once its calibration is over, decides (hvd_compress/auto.py)."""
        auto = auto_compression_of(self.model)
        if auto is not None and auto.step_ended(hc_optimizer(self.model), self.model.trainable_variables):
            self.model.make_train_function(force=True)  # the step of the chosen exchange
        if self.first_batch:
            self.first_batch = False
            optimizer = hc_optimizer(self.model)
            if isinstance(optimizer, WrapperCore) and not optimizer._hc_stepped:
                raise ValueError(
                    f"The step Keras ran did not go through hvd_compress.{optimizer.saved_name}: the optimizer was "
                    "wrapped after this model had traced its training step, which Keras keeps. Call "
                    "model.compile(optimizer=...) again after wrapping.")


class BroadcastGlobalVariablesCallback(_DistributedTrainingCallback):
    """Horovod's BroadcastGlobalVariablesCallback for either Keras: at the start of training,
    before the first step, every rank takes rank `root_rank`'s model and optimizer variables (the
    replicated state; per-rank state stays each rank's own: docs/state_and_checkpoints.md, "The three scopes").
    It runs when the first batch begins, after every callback's on_train_begin (Accordion's
    plans the exchange), and builds the optimizer first, so its slots exist and are broadcast too.
    A model that is not built yet (a Sequential without keras.Input, a subclassed model never
    called) gets its variables in the first step: then it runs when the first batch ends, as
    Horovod's does, and the ranks are identical from the second step on.
    Once per callback, as Horovod's. It also checks, before the first step, that the training is
    distributed (check_distributed_training; allow_undistributed=True turns that off)."""

    def __init__(self, root_rank=0, process_set=hvd.global_process_set, allow_undistributed=False):
        super().__init__(process_set, allow_undistributed)
        self.root_rank, self.done = root_rank, False

    def on_train_batch_begin(self, batch, logs=None):
        super().on_train_batch_begin(batch, logs)
        if not self.done and self.model.built:
            self._broadcast()

    def on_train_batch_end(self, batch, logs=None):
        if not self.done:
            self._broadcast()
        super().on_train_batch_end(batch, logs)

    def _broadcast(self):
        self.model.optimizer.build(self.model.trainable_variables)
        broadcast_variables(self.model.variables + list(self.model.optimizer.variables), root_rank=self.root_rank,
                            process_set=self.process_set)
        self.done = True


class MetricAverageCallback(_DistributedTrainingCallback):
    """Horovod's MetricAverageCallback for either Keras: at every epoch end, each numeric value in
    the logs becomes its average over the ranks (put it before callbacks that read the logs).
    It also checks, before the first step, that the training is distributed
    (check_distributed_training; allow_undistributed=True turns that off)."""

    def __init__(self, process_set=hvd.global_process_set, allow_undistributed=False):
        super().__init__(process_set, allow_undistributed)

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        for key in sorted(logs or {}):  # the same order on every rank
            if np.ndim(logs[key]) == 0 and np.issubdtype(np.asarray(logs[key]).dtype, np.number):
                logs[key] = float(hvd.allreduce(tf.constant(float(logs[key]), tf.float64), op=hvd.Average,
                                                process_set=self.process_set, name=f"hc.metric.{key}"))


class Consensus(Callback):
    """For SGP (hvd_compress.PushSumOptimizer) and DiLoCo (hvd_compress.DiLoCo), whose ranks hold different models
    while they train: once every rank has finished its own steps, every rank's model becomes the exact average of
    all ranks' models (gossip.consensus: one allreduce of the models; over MPI the messages still in flight are
    first taken out of MPI into the per-rank mass in flight, which the next step mixes in). Under DiLoCo the
    average is every rank's x_i after a sync (where the models are alike already) and between syncs the average
    of the ranks' progress; the next sync's pseudo-gradient starts from it.

    - At the end of model.fit, always: the model that is evaluated and saved afterwards is the average.
    - With every_epoch=True, at the end of every epoch too, before fit's validation: the validation metrics and
      the callbacks after this one in the list (ModelCheckpoint, EarlyStopping, ReduceLROnPlateau, a rank-0
      save) see the average model. Training goes on from it (an average is a valid PushSum state).
      Without it, callbacks that decide from validation metrics (EarlyStopping, ReduceLROnPlateau) decide
      from each rank's own model, and may stop the ranks at different epochs.

    A collective: every rank runs it at the same points, as every rank runs the same epochs."""

    def __init__(self, every_epoch=False, process_set=hvd.global_process_set):
        super().__init__()
        self.every_epoch, self.process_set = bool(every_epoch), process_set
        self.stepped = False  # a training step ran since the last average

    def on_train_begin(self, logs=None):
        optimizer = hc_optimizer(self.model)
        if not getattr(optimizer, "ranks_diverge", False):
            raise ValueError(f"hvd_compress.callbacks.Consensus averages the ranks of SGP and DiLoCo, and this model's "
                             f"optimizer is a {type(optimizer).__name__}, whose ranks agree after every step already. "
                             "Drop the callback, or compile with hvd_compress.PushSumOptimizer(optimizer) or "
                             "hvd_compress.DiLoCo(optimizer, sync_every=...).")

    def on_train_batch_end(self, batch, logs=None):
        self.stepped = True

    def on_test_begin(self, logs=None):  # fit's validation runs after the epoch's steps, before on_epoch_end
        end_of_epoch_steps(self.model)
        if self.every_epoch:
            self._average()

    def on_epoch_end(self, epoch, logs=None):
        end_of_epoch_steps(self.model)
        if self.every_epoch:
            self._average()

    def on_train_end(self, logs=None):
        self._average()

    def _average(self):
        if self.stepped:
            gossip.consensus(self.model, self.process_set)
            self.stepped = False


class CompressionMetrics(Callback):
    """Adds, at every epoch end, to the Keras logs:

    - bytes_per_step: bytes one worker sends per step through hvd_compress
      (it receives as many);
    - compression_ratio: Horovod's fp32 ring allreduce bytes / bytes_per_step;
    - residual_norm: global norm of this rank's error-feedback residuals;
    - with recall=True (Compression.sketch only; off by default: it adds a full
      allreduce per step), the epoch's mean `recall` of the true top-k of the
      summed vector by the coordinates sketched SGD applied (k: the heavy
      coordinates its candidates are sized for), and `captured_mass`, the share
      of those top-k coordinates' squared sum that the applied ones hold.

    Put it before keras.callbacks.TensorBoard in the callbacks list so
    TensorBoard sees the values.
    """

    def __init__(self, recall=False):
        super().__init__()
        self.recall = bool(recall)

    def on_train_begin(self, logs=None):
        if self.recall:
            exchange = getattr(hc_optimizer(self.model), "compression_exchange", None)
            if exchange is None:
                raise TypeError("CompressionMetrics(recall=True) needs the model compiled with "
                                "hvd_compress.DistributedOptimizer.")
            exchange.measure_recall()

    def on_epoch_end(self, epoch, logs=None):
        exchange = getattr(hc_optimizer(self.model), "compression_exchange", None)
        if exchange is None or not exchange.built or logs is None:
            return
        logs["bytes_per_step"] = float(exchange.bytes_sent)
        logs["compression_ratio"] = float(exchange.uncompressed_bytes / max(exchange.bytes_sent, 1e-12))
        logs["residual_norm"] = float(tf.convert_to_tensor(exchange.residual_norm()))
        recall, mass, steps = exchange.recall_totals.numpy() if self.recall else (0, 0, 0)
        if steps:  # Accordion: steps at a sketch setting only
            logs["recall"], logs["captured_mass"] = float(recall / steps), float(mass / steps)
            exchange.recall_totals.assign(tf.zeros([3]))


class _RegimeSwitching(Callback):
    """What Accordion's two callbacks share: the detection interval, one decision on every
    rank at the start of each interval (hvd_compress/accordion.py), bytes and logs."""

    def __init__(self, eta, interval, groups, verbose):
        if interval != "epoch" and (isinstance(interval, bool) or not isinstance(interval, int)
                                    or interval < 1):
            raise ValueError(f"interval must be 'epoch' or a number of steps >= 1, got {interval!r}.")
        super().__init__()
        self.detector = accordion.RegimeDetector(eta, groups)
        self.interval, self.verbose = interval, verbose
        #: one entry per decision: epoch, optimizer step, learning rate, norms, critical per group
        self.decisions = []

    def _exchange(self):
        exchange = getattr(hc_optimizer(self.model), "compression_exchange", None)
        if exchange is None:
            raise TypeError(f"{type(self).__name__} needs the model compiled with "
                            "hvd_compress.DistributedOptimizer, got "
                            f"{type(hc_optimizer(self.model)).__name__}.")
        return exchange

    def on_train_begin(self, logs=None):
        self._attach(hc_optimizer(self.model), self._exchange())
        # Creates the detector's state now (restored from a checkpoint if one was loaded).
        self.model.optimizer.build(self.model.trainable_variables)
        self._apply(self.detector.critical.numpy() > 0.5)
        self._epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        if self.interval == "epoch" and self.detector.steps.numpy() > 0:
            self._decide()

    def on_train_batch_begin(self, batch, logs=None):
        if self.interval != "epoch" and self.detector.steps.numpy() >= self.interval:
            self._decide()

    def _bytes_so_far(self):
        return float(self.detector.bytes_total.numpy()) + float(self.detector.steps.numpy()) * \
            self._exchange().bytes_sent

    def _decide(self):
        self.detector.bytes_total.assign(self._bytes_so_far())  # the interval's steps, at its setting
        optimizer = hc_optimizer(self.model)
        learning_rate = accordion.current_learning_rate(optimizer)
        critical, norms = self.detector.decide(learning_rate, self._exchange().process_set)
        self._apply(critical)
        self.decisions.append(dict(epoch=self._epoch, step=int(optimizer.iterations.numpy()),
                                   learning_rate=learning_rate, norms=norms.tolist(),
                                   critical=critical.tolist()))
        if self.verbose and hvd.rank() == 0:
            regimes = ", ".join(f"{name} {'critical' if c else 'calm'} (norm {n:.3g})"
                                for name, c, n in zip(self.detector.names, critical, norms))
            print(f"{type(self).__name__}: epoch {self._epoch}, step {self.decisions[-1]['step']}: "
                  f"{self._describe(critical)}; {regimes}", flush=True)

    def on_epoch_end(self, epoch, logs=None):
        if logs is None:
            return
        for name, c in zip(self.detector.names, self.detector.critical.numpy()):
            logs[f"accordion_critical/{name}"] = float(c)
        logs["bytes_per_step"] = float(self._exchange().bytes_sent)
        logs["cumulative_bytes"] = self._bytes_so_far()


class Accordion(_RegimeSwitching):
    """Accordion's adaptive compression (Agarwal et al., MLSys 2021): each layer uses `low`
    compression while in a critical regime and `high` otherwise (rule in
    hvd_compress/accordion.py).

        opt = hc.DistributedOptimizer(tf.keras.optimizers.SGD(0.1, momentum=0.9))
        model.fit(ds, callbacks=[hc.callbacks.Accordion(
            low=hc.Compression.powersgd(rank=4), high=hc.Compression.powersgd(rank=1))])

    low/high: two settings of one family (PowerSGD rank, top-k or random-k
    ratio, sketch size), or low=Compression.none with high=Compression.onebit().
    They replace the optimizer's own `compression`. eta: the relative change
    of a layer's accumulated-gradient norm that marks a critical regime.
    interval: "epoch" or a number of optimizer steps. A learning-rate drop
    marks every layer critical for the next interval (put the callback after
    a LearningRateScheduler). Logs, at every epoch end: accordion_critical/<layer>
    (1 = low compression), bytes_per_step and cumulative_bytes (per worker).
    """

    def __init__(self, low, high, eta=0.5, interval="epoch", verbose=1):
        super().__init__(eta, interval, "variable", verbose)
        self.compression = accordion.AdaptiveCompression(low, high)

    def _attach(self, optimizer, exchange):
        exchange.use_accordion(self.compression, self.detector)

    def _apply(self, critical):
        """Nothing to do: the exchange reads the detector's regimes in every step."""

    def _describe(self, critical):
        return f"{int(np.sum(critical))} of {len(critical)} layers at low compression"


class AccordionBatchSize(_RegimeSwitching):
    """Accordion's batch-size use: `small` batches per rank in critical regimes, `large` otherwise,
    the learning rate scaled by the linear rule (large / small times higher).

    The data pipeline keeps batches of `small` per rank (the dataset's batch
    size); a large batch is large / small of them accumulated before one
    exchange and update. Their gradients are summed, which is exactly one step
    on the large batch at large / small times the learning rate (SGD's linear
    scaling rule, Goyal et al. 2017), so it works with any learning-rate
    schedule and sends large / small times fewer bytes per sample. The
    decision uses the whole model's accumulated-gradient norm. Logs
    accordion_critical/model, batch_size (per rank), bytes_per_step (per
    exchange) and cumulative_bytes.
    """

    def __init__(self, small, large, eta=0.5, interval="epoch", verbose=1):
        for name, value in (("small", small), ("large", large)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a batch size per rank >= 1, got {value!r}.")
        if large % small or large <= small:
            raise ValueError(f"large ({large}) must be a multiple of small ({small}) greater than it: "
                             "a large batch is large / small accumulated small ones.")
        super().__init__(eta, interval, "model", verbose)
        self.small, self.large = small, large

    def _attach(self, optimizer, exchange):
        if not isinstance(optimizer, sgd_classes()):
            raise TypeError("AccordionBatchSize scales the learning rate by the linear rule, which holds "
                            f"for SGD; got {type(optimizer).__name__}.")
        exchange.use_accordion(exchange.compression, self.detector)
        if not exchange.built:
            optimizer._hc_allow_passes_up_to(self.large // self.small)

    def _apply(self, critical):
        hc_optimizer(self.model).set_backward_passes_per_step(1 if critical[0] else self.large // self.small)

    def _describe(self, critical):
        return f"batch {self.small if critical[0] else self.large} per rank"

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        if logs is not None:
            logs["batch_size"] = float(self.small if self.detector.critical.numpy()[0] > 0.5 else self.large)
