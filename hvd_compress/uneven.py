"""Uneven data: where the ranks' data of unknown length runs out at different steps, every rank ends the
pass over its data (model.fit's epoch, a custom loop's loop) at the same step, the one where the first
rank ran out, with the ranks identical and nothing left waiting.

Every step's exchange needs every rank. A rank with more batches than another would go on into a step
whose collectives nobody joins (a hang), or join them with the other rank's next epoch (training
wrong in silence). For data of known length, hvd_compress's callbacks refuse different step counts
before the first step; for data of unknown length (a generator, a filtered dataset) nobody knows until
a rank runs out. While a StopTogether is on:

- every step of the wrapped optimizer begins, before any collective, with every rank saying it has a
  batch (a minimum-allreduce of 1; `first_in_step`);
- a rank whose pass ended (its data ran out, or its loop stopped) runs no step: it says it has none
  instead (`end`: minus one minus its rank), once per pass;
- a step that draws "none" stops before any collective or update and raises OutOfRangeError, which
  model.fit and `stop_together` take as the end of the data: that rank's pass ends too, without
  saying it again.

So each rank takes part once in each agreement, and every rank ends at the shortest rank's count; the
batches the longer ranks had left in that pass are not used. Horovod's hvd.join() and PyTorch DDP's
`Join` serve the same case differently: the ranks with data go on and the others add zeros. Stopping
together keeps every rank's per-rank state (error feedback, momentum) in step with the others' and
needs nothing of the compressors. It costs one 4-byte allreduce a step while on; model.fit turns it on
(through hvd_compress's callbacks) only for data of unknown length, and `stop_together` for a custom
loop.
"""
import contextlib
import logging

import tensorflow as tf

import horovod.tensorflow as hvd

log = logging.getLogger("hvd_compress")


class StopTogether:
    """The agreement of one wrapped optimizer's ranks (its process set) on whether each has a batch."""

    NAME = "hc.every_rank_has_a_batch"

    def __init__(self, process_set):
        """Made (for_process_set) where a wrapper or a GradientExchange is made, not in a traced step: a variable
        made while a tf.function traces makes it trace again."""
        self.process_set = process_set
        self._pass_ended = False
        self._answer = tf.function(self._agree)  # the same collective as the steps', run alone
        with tf.init_scope():
            # Per rank, never saved: plain variables of this object, which no Keras object tracks.
            self._on = tf.Variable(False, trainable=False, name="hc_stop_together_on")
            # 0, or what a step of this rank drew: minus one minus the rank that ran out (the highest)
            self._drawn = tf.Variable(0, trainable=False, name="hc_stop_together_drawn")
            # steps that every rank agreed to take
            self._agreed = tf.Variable(0, trainable=False, dtype=tf.int64, name="hc_stop_together_agreed")

    def _agree(self, has_batch):
        # A named collective fed by a tensor that is not a constant (the graph optimizer would fold it away).
        return hvd.allreduce(has_batch, op=hvd.Min, name=self.NAME, process_set=self.process_set,
                             ignore_name_scope=True)

    @property
    def on(self):
        return bool(self._on.numpy())

    def turn(self, on):
        self._on.assign(bool(on))
        self._pass_ended = False

    def begin_pass(self):
        """Where a pass over the data (an epoch) begins."""
        self._pass_ended = False

    @property
    def steps_agreed(self):
        """Steps that every rank agreed to take, so far."""
        return int(self._agreed.numpy())

    @contextlib.contextmanager
    def first_in_step(self, grads):
        """Around the first collective of a step and everything after it: while on, every rank first
        agrees that each has a batch; where one has none, nothing in the context runs and the step raises
        OutOfRangeError. The agreement waits for one of the step's gradients `grads` (None where absent),
        the last, which backpropagation computes first: a rank whose batch does not come must not say it
        has one (in a graph, ops that do not depend on the data may run before the data's end is found).
        On one rank there is nothing to agree on, and nothing is added to the step."""
        if self.process_set.size() == 1:
            yield
            return

        def agree():
            everyone = self._agree(tf.cast(self._on.read_value(), tf.int32))

            def stop():
                with tf.control_dependencies([self._drawn.assign(everyone)]):
                    return tf.py_function(_out_of_data, [-everyone - 1], tf.bool)  # raises OutOfRangeError

            def go_on():
                with tf.control_dependencies([self._agreed.assign_add(1)]):
                    return tf.constant(True)

            return tf.cond(everyone > 0, go_on, stop)

        data = [g.values if isinstance(g, tf.IndexedSlices) else g for g in grads if g is not None][-1:]
        with tf.control_dependencies(data):
            agreed = tf.cond(self._on.read_value(), agree, lambda: tf.constant(True))
        with tf.control_dependencies([agreed]):
            yield

    def end(self):
        """Where this rank's pass ended, once per pass: unless one of its steps drew the end already, it
        tells the others (who are in a step's agreement, or here). Returns whether a step drew the end."""
        if not self.on or self._pass_ended:
            return False
        self._pass_ended = True
        drawn = int(self._drawn.numpy())
        if drawn:
            self._drawn.assign(0)
            if self.process_set.rank() == 0:
                log.info("hvd_compress: rank %d ran out of data first: every rank ended the pass at that step",
                         -drawn - 1)
            return True
        self._answer(tf.constant(-1 - self.process_set.rank(), tf.int32))
        return False


_by_process_set = {}


def for_process_set(process_set):
    """The StopTogether of the ranks of `process_set` (one per process set, shared by the wrappers, tapes and
    callbacks that train on it)."""
    key = process_set.process_set_id
    if key not in _by_process_set:
        _by_process_set[key] = StopTogether(process_set)
    return _by_process_set[key]


def _out_of_data(rank):
    raise StopIteration(f"hvd_compress: rank {int(rank)} ran out of data; every rank ends this pass over its data "
                        "at this step")  # (tf.py_function raises StopIteration as OutOfRangeError)


class EndsTogether:
    """model.train_function, for model.fit with data of unknown length (hvd_compress's callbacks put it in
    place): where this rank's data runs out, its StopTogether ends the pass before Keras ends the epoch,
    and before any other callback runs. With steps_per_execution > 1, Keras 3 runs the steps of one call
    while data comes and returns with fewer where it ran out: that too is the end of this rank's data."""

    def __init__(self, train_function, stop_together, steps_per_execution=1):
        self.train_function, self.stop_together = train_function, stop_together
        self.steps_per_execution = steps_per_execution

    def __call__(self, iterator):
        before = self.stop_together.steps_agreed if self.steps_per_execution > 1 else None
        try:
            outputs = self.train_function(iterator)
        except (StopIteration, tf.errors.OutOfRangeError):
            self.stop_together.end()
            raise
        if before is not None and self.stop_together.steps_agreed - before < self.steps_per_execution:
            self.stop_together.end()
        return outputs


@contextlib.contextmanager
def stop_together(process_set=hvd.global_process_set):
    """For a custom loop over data whose length may differ between the ranks: one pass over the data,
    ended on every rank at the step where the first rank runs out (see this module's docstring):

        for epoch in range(epochs):
            with hc.stop_together():
                for x, y in dataset:
                    train_step(x, y)

    Every rank must have traced its step (run one) before a pass in which it has no batch at all: the
    first trace runs collectives of its own. The steps' first collective must be hvd_compress's (a DistributedOptimizer's, a PushSumOptimizer's or a
    DistributedGradientTape's, on `process_set`): each costs one 4-byte allreduce more inside the context. A
    step that finds another rank out of data raises OutOfRangeError, which leaves the loop, and the context
    ends there without it; every rank then has run the same steps."""
    agreement = for_process_set(process_set)
    agreement.turn(True)
    try:
        yield
    except (StopIteration, tf.errors.OutOfRangeError):
        if not agreement.end():  # this rank's own data ran out inside the loop (e.g. next() on an iterator)
            log.info("hvd_compress.stop_together: this rank's data ran out")
    else:
        agreement.end()
    finally:
        agreement.turn(False)
