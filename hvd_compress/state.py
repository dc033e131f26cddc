"""Every piece of state and its scope, and where each scope is kept.

Three scopes (docs/state_and_checkpoints.md, "The three scopes"):
- per-rank: differs by rank by design: worker error-feedback residuals e_i,
  the worker momenta of dist-EF-SGD and sketched SGD, Accordion's local
  gradient sums, accumulated micro-batch gradients, PushSum's weight w_i and
  mass in flight;
- sharded: rank j holds part j of something whole, laid out for one world
  size: the two-way server residual e_s;
- replicated: the same on every rank: step counters, PowerSGD's Q, Accordion's
  history and regimes, the wrapped optimizer's own slots.

Replicated state is ordinary optimizer variables (`optimizer.variables`), so
Horovod's broadcasts (`BroadcastGlobalVariablesCallback`,
`hvd.broadcast_variables(opt.variables(), 0)`, elastic `state.sync()`) and
model files (`model.save`, h5 or SavedModel) see it. Per-rank and sharded
state lives apart, in a `RankLocalState`, which no broadcast sees: it is saved
by checkpoints (`tf.train.Checkpoint`, `save_weights` in the TF format) with
the rank and world size it belongs to, and a restore keeps it only on that
rank at that world size; anywhere else it is reset (to zero; w = 1) and the
reset is reported. Model files leave it out (see `RankLocalState`).
"""
import hashlib
import logging
from typing import Callable, NamedTuple, Optional

import tensorflow as tf
from tensorflow.python.trackable import base as trackable

import horovod.tensorflow as hvd

log = logging.getLogger("hvd_compress")

PER_RANK, SHARDED, REPLICATED = "per-rank", "sharded", "replicated"
SCOPES = (PER_RANK, SHARDED, REPLICATED)


class StateSpec(NamedTuple):
    """One piece of state an exchange (or PushSum, or Accordion) declares."""
    name: str
    shape: tuple
    scope: str
    dtype: tf.DType = tf.float32
    #: (shape, dtype) -> initial tensor; zeros when None
    initializer: Optional[Callable] = None

    def initial_value(self):
        return (self.initializer or tf.zeros)(self.shape, self.dtype)


def safe_name(name):
    """A variable or checkpoint-key name from any name ("dense/kernel:0" -> "dense_kernel")."""
    return name.split(":")[0].replace("/", "_").replace(".", "_")


class Restore(NamedTuple):
    """What a checkpoint restore did to one RankLocalState."""
    writer: tuple  # (rank, world size) that wrote the checkpoint
    kept: bool  # True: it was this rank's at this size, restored; False: reset


class RankLocalState(trackable.Trackable):
    """The per-rank and sharded state of one owner, with the (rank, size) it belongs to, and the ranks per
    host of a hierarchical plan (`local_size`; 1 for a flat one).

    A checkpoint saves every variable plus `owner` = [rank, size, local_size] (files from before hierarchical
    plans hold [rank, size]: local size 1). A restore (immediate, or deferred to when this object is attached)
    keeps the values only when the checkpoint's owner is this rank at this world size and host layout and
    every variable is there with its shape; otherwise it resets everything to its initial value. Either
    way `restored` records what happened, for the owner's one-line report.

    Not a tf.Module and not a child of anything `hvd.broadcast_variables` is
    given, so its variables are never broadcast. SavedModel exports leave it
    out (its restore is Python logic, which a SavedModel cannot carry): the
    owners drop it from their children when saving a SavedModel.
    """

    def __init__(self, rank, size, local_size=1):
        self.rank, self.size, self.local_size = int(rank), int(size), int(local_size)
        self.specs, self.variables = {}, {}
        self.restored = None  # the last Restore, until taken by the owner's report
        self.reported = False  # True once the owner has reported a restore at build time

    @property
    def owner(self):
        """[rank, size, local_size], saved with the state."""
        return tf.constant([self.rank, self.size, self.local_size], tf.int64)

    def add(self, spec):
        """Creates the variable of a per-rank or sharded StateSpec (names are unique)."""
        if spec.scope not in (PER_RANK, SHARDED):
            raise ValueError(f"{spec.name} is {spec.scope} state; RankLocalState keeps per-rank and "
                             "sharded state only.")
        if spec.name in self.variables:
            raise ValueError(f"state {spec.name!r} declared twice")
        self.specs[spec.name] = spec
        self.variables[spec.name] = tf.Variable(spec.initial_value(), trainable=False,
                                                name=f"hc_{safe_name(spec.name)}")
        return self.variables[spec.name]

    def reset(self):
        """Every variable back to its initial value."""
        for name, variable in self.variables.items():
            variable.assign(self.specs[name].initial_value())

    def _serialize_to_tensors(self):
        tensors = {"owner": self.owner}  # a constant: no variable, so a stateless owner may be made in a tf.function
        tensors.update({safe_name(name): v for name, v in self.variables.items()})
        return tensors

    def _restore_from_tensors(self, restored_tensors):
        if not tf.executing_eagerly():
            raise NotImplementedError("hvd_compress restores per-rank state eagerly; call "
                                      "Checkpoint.restore outside tf.function.")
        owner = [int(x) for x in restored_tensors["owner"].numpy()]
        writer, writer_local_size = tuple(owner[:2]), (owner[2] if len(owner) > 2 else 1)
        kept = writer == (self.rank, self.size) and writer_local_size == self.local_size and all(
            safe_name(name) in restored_tensors and restored_tensors[safe_name(name)].shape == v.shape
            for name, v in self.variables.items())
        if kept:
            for name, v in self.variables.items():
                v.assign(restored_tensors[safe_name(name)])
        else:
            self.reset()
        self.restored = Restore(writer, kept)
        if self.reported and not kept and self.variables:  # after the owner's build: nobody else will say it
            log.warning("hvd_compress: rank %d reset its %s: the checkpoint's copy belongs to rank %d of %d, "
                        "this is rank %d of %d.", self.rank, describe(self.specs.values()), *writer,
                        self.rank, self.size)
        return tf.no_op()

    def take_restore(self):
        """The restore since the last call (or None), for the owner's report; later restores log
        themselves."""
        restored, self.restored, self.reported = self.restored, None, True
        return restored


def describe(specs):
    """'error-feedback residuals and server residual shards' from the specs' names."""
    kinds = []
    for spec in specs:
        kind = spec.name.split("/")[0].replace("_", " ")
        if kind not in kinds:
            kinds.append(kind)
    return ", ".join(kinds) or "state"


RANK_STATE = "hc_rank_state"  # the checkpoint key of a holder's RankLocalState


def track(holder, rank_state, key=RANK_STATE):
    """Makes `rank_state` the checkpoint dependency `key` of holder (an optimizer or a module),
    replacing an earlier one; a restore pending for it happens now. A holder of several exchanges
    (DiLoCo's fragments) gives each its own key."""
    holder._track_trackable(rank_state, key, overwrite=True)


def checkpoint_children(children, rank_state, save_type, key=RANK_STATE):
    """A holder's checkpoint children: its RankLocalState under `key` in checkpoints, never in a
    SavedModel (a model file carries replicated state only; see RankLocalState)."""
    children = {k: v for k, v in children.items() if k != key}
    if rank_state is not None and save_type != "savedmodel":
        children[key] = rank_state
    return children


def check_ranks_agree(settings, rank_state, process_set, name, previous_size=None):
    """One allgather, before the first collective of a (re-)planned step: every rank raises the
    same ValueError when the ranks' settings differ (instead of hanging in collectives that do
    not pair up), and rank 0 logs one line when a checkpoint restore or a new world size reset
    per-rank and sharded state on some rank."""
    fingerprint = hashlib.sha256(settings.encode()).hexdigest()[:16]
    everyone = hvd.allgather_object((fingerprint, settings, rank_state.take_restore()),
                                    process_set=process_set, name=f"{name}.settings")
    if len({f for f, _, _ in everyone}) > 1:
        lines = "\n".join(f"  rank {r}: {s[:300]}" for r, (_, s, _) in enumerate(everyone))
        raise ValueError("hvd_compress: the ranks were started with different compression settings "
                         "or models, so their collectives would not match. Start every rank with "
                         f"the same arguments. Settings per rank:\n{lines}")
    if process_set.rank() != 0 or not rank_state.specs:  # nothing per-rank (FetchSGD): nothing was reset
        return
    what = describe(rank_state.specs.values())
    if previous_size is not None:
        log.warning("hvd_compress: %s re-planned for %d ranks (was %d): reset the per-rank and sharded "
                    "state (%s) on every rank; replicated state is kept.", name, rank_state.size,
                    previous_size, what)
    restores = [r for _, _, r in everyone]
    reset = [rank for rank, r in enumerate(restores) if r is not None and not r.kept]
    if reset:
        kept = [rank for rank, r in enumerate(restores) if r is not None and r.kept]
        writers = sorted({r.writer for r in restores if r is not None})
        log.warning("hvd_compress: %s reset its per-rank and sharded state (%s) on rank(s) %s of %d: the "
                    "checkpoint's copy was written by %s and belongs to that rank at that world size "
                    "only%s", name, what, ", ".join(map(str, reset)), len(restores),
                    ", ".join(f"rank {r} of {s}" for r, s in writers),
                    f"; rank(s) {', '.join(map(str, kept))} kept their own." if kept else ".")


class RanksAgreement:
    """check_ranks_agree for one plan, due at its first step, not at the plan itself: a model
    file's loader plans (it builds the optimizer), and rank 0 alone may load a file, e.g. to
    evaluate it, where a collective would wait forever."""

    def __init__(self):
        self.due = None

    def plan(self, settings, rank_state, process_set, name, previous_size=None):
        self.due = (settings, rank_state, process_set, name, previous_size)

    def replan(self, settings):
        """New settings for the check still due (none due: nothing)."""
        if self.due is not None:
            self.due = (settings, *self.due[1:])

    def check(self):
        """At a step (every rank traces it): the collective, eagerly, once per plan."""
        if self.due is not None:
            with tf.init_scope():
                check_ranks_agree(*self.due)
            self.due = None


def note_model_file(source, optimizer_restored=True):
    """On rank 0, one line: a model file (h5, SavedModel, .keras, Keras 3's .weights.h5) restored
    the model and the replicated state, and per-rank and sharded state starts from zero; or, where
    Keras skipped the optimizer's variables (an optimizer not built yet), that only the model was."""
    if not (hvd.is_initialized() and hvd.rank() == 0):
        return
    if not optimizer_restored:
        log.warning("hvd_compress: %s restored the model only: Keras skipped the optimizer's variables (its "
                    "optimizer was not built yet, or the file's has other variables), so the optimizer's state "
                    "starts from zero. To restore it, build the optimizer first "
                    "(optimizer.build(model.trainable_variables)) and load again.", source)
        return
    log.warning("hvd_compress: %s restored the model and the optimizer's replicated state; per-rank "
                "and sharded state (error-feedback residuals, worker momenta, server residuals, PushSum "
                "weights) is not kept in model files and starts from zero. Save per-rank checkpoints "
                "(tf.train.Checkpoint; tf_keras: save_weights in the TF format) to resume exactly.",
                source)


def check_world(rank, size, process_set):
    """Ops for the step, before any collective: the world (this process's global rank, the
    process set's size) must still be the one planned for
    (after an elastic reset without a re-plan the collectives of the old layout would not pair
    up, or would move other ranks' shards)."""
    message = (f"hvd_compress: the step was planned for rank {rank} of {size} ranks and the world has "
               "changed (elastic training?). Use hvd_compress.elastic.KerasState, which re-plans on "
               "a reset, or call optimizer.hc_replan() after the reset and retrace the step.")
    return [tf.debugging.assert_equal(hvd.size_op(process_set.process_set_id), size, message=message),
            tf.debugging.assert_equal(hvd.rank_op(), rank, message=message)]
