"""What every test worker shares: flags, horovod start-up and the per-rank result file."""
import hashlib
import json
import logging
import os
import pathlib

import horovod.tensorflow as hvd_tf
import tensorflow as tf
from absl import flags

flags.DEFINE_string("out_dir", None, "Where each rank writes rank<N>.json.")
FLAGS = flags.FLAGS


def define_list_of(name, choices, default, help):
    """A comma-separated list flag whose items must be among `choices`, checked when the flags
    are parsed, before any rank starts a collective: --name=a,b runs a, then b."""
    flags.DEFINE_list(name, default, f"{help} Any of, in the order given: {', '.join(choices)}.")
    flags.register_validator(name, lambda values: set(values) <= set(choices),
                             f"--{name}: each must be one of {', '.join(choices)}.")


def launch_size():
    """The number of ranks launched, known before hvd.init(): horovodrun's Gloo launcher sets
    HOROVOD_SIZE, MPI launchers their own variable (Open MPI's, or PMI_SIZE)."""
    return int(os.environ.get("HOROVOD_SIZE") or os.environ.get("OMPI_COMM_WORLD_SIZE") or os.environ["PMI_SIZE"])


def init_world_sizes(world_sizes):
    """hvd.init() with one process set of ranks 0..n-1 per world size n in `world_sizes` (the
    launch's own size: the global set), so one launch covers several world sizes. Returns
    {n: process set} of those this rank belongs to, smallest first."""
    ranks = launch_size()
    assert all(1 <= n <= ranks for n in world_sizes), (world_sizes, ranks)
    process_sets = {n: hvd_tf.ProcessSet(list(range(n))) for n in set(world_sizes) if n < ranks}
    hvd_tf.init(process_sets=list(process_sets.values()))
    if ranks in world_sizes:
        process_sets[ranks] = hvd_tf.global_process_set
    return {n: ps for n, ps in sorted(process_sets.items()) if ps.included()}


def keras_and_broadcast():
    """The Keras `tf.keras` is (TF_USE_LEGACY_KERAS decides, as for users), and the callback that
    broadcasts rank 0's initial state which its users add: Horovod's own for tf_keras,
    hvd_compress's under Keras 3 (where Horovod's fails)."""
    if tf.keras.__name__.startswith("tf_keras"):
        import horovod.tensorflow.keras as hvd_keras
        return tf.keras, hvd_keras.callbacks.BroadcastGlobalVariablesCallback
    import hvd_compress as hc
    return tf.keras, hc.callbacks.BroadcastGlobalVariablesCallback


def op_types(step, *input_specs):
    """The set of op types in the graph of a tf.function traced for these TensorSpecs, its inner
    functions included (what a step ran: fused kernels, the ops it must or must not use)."""
    graph = step.get_concrete_function(*input_specs).graph.as_graph_def()
    return {node.op for node in graph.node} | {node.op for f in graph.library.function for node in f.node_def}


def report(hvd, **result):
    """Writes this rank's result for tests/hvdrun.run_ranks."""
    path = pathlib.Path(FLAGS.out_dir) / f"rank{hvd.rank()}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, path)


def report_cases(run_case):
    """A worker's main for tf_keras: every case in --cases run by run_case(keras, case), reported as {case: result}."""
    import horovod.tensorflow as hvd
    import hvd_compress as hc
    keras = hc.require_legacy_keras()
    hvd.init()
    report(hvd, results={case: run_case(keras, case) for case in FLAGS.cases})


class LoggedLines(logging.Handler):
    """Collects what hvd_compress logs on this rank (attach with `LoggedLines.attach()`)."""

    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())

    @classmethod
    def attach(cls):
        handler = cls()
        logging.getLogger("hvd_compress").addHandler(handler)
        return handler


def weights_digest(model):
    """A digest of the model's weights: equal on two ranks only if every weight is bit-identical."""
    return hashlib.sha256(b"".join(w.tobytes() for w in model.get_weights())).hexdigest()


def bits_fingerprint(variables):
    """A compiled function of no arguments: a fingerprint of the bits of `variables` (TensorFlow's 64-bit
    farmhash of all their bytes), equal on two ranks only if every value is bit-identical. One op call where
    weights_digest reads each variable into NumPy: 0.5 ms a batch of the digits CNN against 1.7 ms."""
    same_width = {1: tf.int8, 2: tf.int16, 4: tf.int32, 8: tf.int64}

    @tf.function(autograph=False)
    def fingerprint():
        values = [tf.convert_to_tensor(v) for v in variables]
        bits = [tf.cast(tf.reshape(tf.bitcast(x, same_width[x.dtype.size]), [-1]), tf.int64) for x in values]
        return tf.fingerprint(tf.reshape(tf.concat(bits, 0), [1, -1]))

    return fingerprint


def is_gossip(method):
    """Whether a method of the workers is SGP ("sgp", "sgp_mpi"), whose ranks agree only after consensus."""
    return method.startswith("sgp")


class IdenticalRanks(tf.keras.callbacks.Callback):
    """Every rank must hold bit-identical weights after every batch (counted in `checked`).
    Skipped for SGP, whose ranks agree only after gossip.consensus.

    Each rank records its weights' digest after every batch; the ranks compare their records at
    the end of each epoch (one collective an epoch instead of one a batch, which cost about 16 ms
    a step on a 2-rank digits run against 5 ms for the digest alone) and fail naming the first
    batch at which they differed."""

    def __init__(self, method):
        super().__init__()
        self.method, self.checked, self.recorded = method, 0, []
        self.fingerprint = None

    def on_train_begin(self, logs=None):
        self.fingerprint = bits_fingerprint(self.model.weights)

    def on_train_batch_end(self, batch, logs=None):
        if not is_gossip(self.method):
            self.recorded.append(self.fingerprint().numpy().tobytes().hex())

    def on_epoch_end(self, epoch, logs=None):
        if is_gossip(self.method):
            return
        everyone = hvd_tf.allgather_object(self.recorded, name="identical_ranks")
        assert len({len(r) for r in everyone}) == 1, f"{self.method}: ranks ran {[len(r) for r in everyone]} batches"
        for batch, digests in enumerate(zip(*everyone)):
            assert len(set(digests)) == 1, f"{self.method}: ranks differ after batch {batch} of epoch {epoch}"
        self.checked += len(self.recorded)
        self.recorded = []


#: The registry's methods (hvd_compress.methods) as the tests' small models (a few thousand weights per
#: tensor) run them: more coordinates or a higher rank than the defaults, so that a few steps move every layer.
SMALL_MODEL = {"topk": dict(ratio=0.05), "randomk": dict(ratio=0.1), "powersgd": dict(rank=2), "sketch": dict(ratio=3),
               "fetchsgd": dict(ratio=3)}


#: Test methods that train under AdamW (hvd_compress/adam.py): the worker's SGD replaced by AdamW, with the
#: named compression and a full-precision warm-up of ADAMW_WARMUP steps (onebit: 1-bit AdamW; top-k: AdamW with its
#: variance frozen after the warm-up).
ADAMW_METHODS = {"onebit_adamw": "onebit", "topk_adamw": "topk"}
ADAMW_WARMUP, ADAMW_LEARNING_RATE = 4, 0.002


def compression(method, **overrides):
    """Method `method` of the registry (or of ADAMW_METHODS), with the small-model settings and then `overrides`."""
    import hvd_compress as hc
    method = ADAMW_METHODS.get(method, method)
    return hc.methods.compression(method, **{**SMALL_MODEL.get(method, {}), **overrides})


def distributed_optimizer(sgd, method, chosen=None, warmup_steps=ADAMW_WARMUP, **kwargs):
    """hc.DistributedOptimizer(sgd) with the method's compression (or `chosen`); for a method of ADAMW_METHODS,
    an AdamW with sgd's clipping in sgd's place (and the warm-up). kwargs: the wrapper's."""
    import hvd_compress as hc
    chosen = chosen or compression(method)
    if method not in ADAMW_METHODS:
        return hc.DistributedOptimizer(sgd, compression=chosen, **kwargs)
    config = sgd.get_config()
    clipping = {k: config[k] for k in ("clipnorm", "clipvalue", "global_clipnorm") if config.get(k) is not None}
    adamw = hc.keras_compat.keras_of(sgd).optimizers.AdamW(ADAMW_LEARNING_RATE, weight_decay=0.004, **clipping)
    return hc.DistributedOptimizer(adamw, compression=chosen, warmup_steps=warmup_steps, **kwargs)
