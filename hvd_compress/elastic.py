"""Elastic training (horovod.tensorflow.keras.elastic) with hvd_compress optimizers, in either
Keras.

Horovod's `hvd.elastic.KerasState(model, optimizer)` saves, restores and
broadcasts `model.variables` and `optimizer.variables()`: with hvd_compress
these are the model and the replicated state only, so a sync never moves
per-rank or sharded state between ranks. (Horovod's own calls
`optimizer.variables()`, a plain list in Keras 3, and broadcasts Keras 3's
variables, which its collectives do not take: `KerasState` here does the same
on the tf.Variables behind them.) What Horovod's state cannot do is
re-plan the exchange when the world changes: the two-way server residual is
cut into one shard per rank, the gossip graph depends on the ranks, and the
traced training step has those layouts built in. `KerasState` here is
Horovod's, plus a reset callback that, on every rank,

1. re-plans the optimizer for the new rank and size (`optimizer.hc_replan()`):
   replicated state (the wrapped optimizer's slots, PowerSGD's Q, Accordion's
   history) is kept; per-rank and sharded state (residuals, worker momenta,
   server-residual shards, PushSum's w and mass in flight) starts afresh, and
   rank 0 logs one line saying so;
2. drops the model's traced train function, so the next `model.fit` traces the
   step for the new layout.

The optimizer is built when the state is created (Horovod's sync broadcasts
`optimizer.variables()`, which must have the same length on a new worker as on
the survivors). A step that runs in a changed world without this re-plan
stops with an error that names this class (never silent, never a hang).

    state = hc.elastic.KerasState(model, batch=0, epoch=0)

    @hvd.elastic.run
    def train(state):
        model.fit(..., initial_epoch=state.epoch, callbacks=[
            hvd.elastic.CommitStateCallback(state), hvd.elastic.UpdateEpochStateCallback(state)])
"""
import horovod.tensorflow.keras.elastic as hvd_elastic
import tensorflow as tf

from hvd_compress.callbacks import broadcast_variables, tf_variable


class KerasState(hvd_elastic.KerasState):
    """Horovod's elastic KerasState for models compiled with an hvd_compress optimizer, in either
    Keras (see the module docstring); takes the same arguments."""

    def __init__(self, model, optimizer=None, **kwargs):
        optimizer = optimizer or model.optimizer
        optimizer.build(model.trainable_variables)  # before the state saves optimizer.variables
        super().__init__(model, optimizer=optimizer, **kwargs)
        self._bcast_model = self._broadcast_model
        self.register_reset_callbacks([self._replan])

    def _variables(self):
        """The model's and the optimizer's tf.Variables (Keras 3 wraps them)."""
        return [tf_variable(v) for v in list(self.model.variables) + list(self.optimizer.variables)]

    def _save_model(self):
        self._saved = [tf.identity(v) for v in self._variables()]

    def _load_model(self):
        for v, saved in zip(self._variables(), self._saved):
            v.assign(saved)

    def _broadcast_model(self):
        broadcast_variables(self._variables(), root_rank=0)

    def _replan(self):
        replan = getattr(self.optimizer, "hc_replan", None)
        if replan is not None:
            replan()
        self.model.train_function = None  # retraced by the next fit for the new layout
