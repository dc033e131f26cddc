"""Accordion on several ranks: the update rules across switches against NumPy, the Keras
callbacks in model.fit (same decisions and parameters on every rank, no retrace), the
batch-size variant's linear rule, and checkpoint/resume of the detector.

Runs each check in --checks, one after another in this process; reports {check: results}."""
import hashlib
import pathlib

import numpy as np
import tensorflow as tf
from absl import app, flags

import horovod.tensorflow as hvd
import hvd_compress as hc
import np_reference as ref
import update_rule as rule
from rule_inputs import rate, sgd
from _worker import define_list_of, report
from hvd_compress.accordion import HIGH, LOW, AdaptiveCompression, RegimeDetector
from hvd_compress.exchange import Hierarchical, hierarchical_bytes

import digits

CHECKS = ["rules", "fit", "batch", "checkpoint"]
# The test of `fit` names its layers as the first CNN of a process gets them: run it before
# `batch` and `checkpoint`, which build CNNs too.
define_list_of("checks", CHECKS, ["rules"], "What to run.")
flags.DEFINE_enum("phase", "full", ["full", "resume"], "checkpoint: which half.")
flags.DEFINE_string("work_dir", None, "checkpoint: shared between the phases.")
flags.DEFINE_bool("hierarchical_exchange", False, "fit: hc.DistributedOptimizer(hierarchical=True) (launched as hosts; "
                  "horovodrun would take --hierarchical for its own options).")
FLAGS = flags.FLAGS
SCHEDULE = [LOW, HIGH, HIGH, LOW, HIGH, HIGH]  # one choice per step of rule.FLAGS.steps = 6


def digest(arrays):
    return hashlib.sha256(b"".join(np.asarray(a).tobytes() for a in arrays)).hexdigest()


def run_switching(low, high, nesterov=True):
    """update_rule's two variables trained with the choice of each step forced by SCHEDULE."""
    w = tf.Variable(np.zeros(rule.SHAPE, np.float32), name="w")
    b = tf.Variable(np.zeros(rule.DENSE, np.float32), name="b")
    opt = hc.DistributedOptimizer(sgd(nesterov), compression=high)
    exchange = opt.compression_exchange
    exchange.use_accordion(AdaptiveCompression(low, high), RegimeDetector())
    opt.build([w, b])
    step = tf.function(lambda gw, gb: opt.apply_gradients([(gw, w), (gb, b)]))
    for t, choice in enumerate(SCHEDULE):
        exchange.monitor.critical.assign([float(choice == LOW)])
        step(*map(tf.constant, rule.grads_of(hvd.rank(), t)))
    assert step.experimental_get_tracing_count() == 1  # switching is a variable, not a retrace
    accumulated = exchange.monitor.accumulated[0].numpy()
    return w.numpy().reshape(-1), b.numpy(), accumulated


def check_decisions(accumulated):
    """RegimeDetector.decide on every rank: no history -> critical; the same norms -> calm; the
    same norms after a learning-rate drop -> critical."""
    w = tf.Variable(np.zeros(rule.SHAPE, np.float32))
    detector = RegimeDetector(eta=0.5)
    layout = type("Layout", (), dict(compressed=[0], empty=[], shapes=[tuple(rule.SHAPE)]))
    detector.build([w.name], layout, lambda spec: tf.Variable(spec.initial_value()))
    regimes = []
    for learning_rate in (0.1, 0.1, 0.01):
        detector.accumulated[0].assign(accumulated)
        detector.steps.assign(3.0)
        critical, norms = detector.decide(learning_rate)
        regimes.append(bool(critical[0]))
        assert detector.steps.numpy() == 0 and not detector.accumulated[0].numpy().any()
    assert regimes == [True, False, True], regimes
    # The norm is the mean over ranks of each rank's accumulated-gradient norm.
    assert np.isclose(norms[0], hvd.allreduce(tf.norm(accumulated), op=hvd.Average).numpy(), rtol=1e-5)


def check_rules():
    size, digests = hvd.size(), {}
    rates = [rate(t) for t in range(len(SCHEDULE))]
    # onebit <-> uncompressed under dist-EF-SGD: e_i kept across, zero after a full-precision step.
    w, b, accumulated = run_switching(hc.Compression.none, hc.Compression.onebit())
    model = ref.DistEFSGD(int(np.prod(rule.SHAPE)), size, rule.MU, True, None, True)
    want = np.zeros(int(np.prod(rule.SHAPE)), np.float32)
    for t, choice in enumerate(SCHEDULE):
        model.step(want, [rule.grads_of(r, t)[0].reshape(-1) for r in range(size)], rates[t],
                   compressed=choice == HIGH)
    np.testing.assert_allclose(w, want, rtol=1e-5, atol=1e-6, err_msg="onebit <-> none")
    np.testing.assert_allclose(b, rule.reference_dense(True, size), rtol=1e-5, atol=1e-6)
    # The detector saw this rank's local gradients, summed over the steps.
    np.testing.assert_allclose(accumulated, sum(rule.grads_of(hvd.rank(), t)[0] for t in range(len(SCHEDULE))),
                               rtol=1e-5, atol=1e-5)
    digests["onebit"] = digest([w, b])
    check_decisions(accumulated)
    # PowerSGD rank 3 <-> 1: one error shared, a warm-started Q per rank.
    low, high = hc.Compression.powersgd(rank=3, seed=2), hc.Compression.powersgd(rank=1, seed=2)
    w, b, _ = run_switching(low, high)
    want = rule.reference_powersgd(None, size, True, schedule=[[low, high][c] for c in SCHEDULE])
    np.testing.assert_allclose(w, want, rtol=1e-4, atol=1e-5, err_msg="powersgd 3 <-> 1")
    digests["powersgd"] = digest([w, b])
    # top-k 20% <-> 2% and random-k 25% <-> 5%: the residual carries over.
    for name, low, high in (("topk", hc.Compression.topk(ratio=0.2), hc.Compression.topk(ratio=0.02)),
                            ("randomk", hc.Compression.randomk(ratio=0.25, seed=3),
                             hc.Compression.randomk(ratio=0.05, seed=3))):
        w, b, _ = run_switching(low, high)
        want = rule.reference_sparse(None, size, True, schedule=[[low, high][c] for c in SCHEDULE])
        np.testing.assert_allclose(w, want, rtol=1e-5, atol=1e-6, err_msg=f"{name} switching")
        digests[name] = digest([w, b])
    # Sketch 2x <-> 6x fewer floats (sketched SGD's direct update): the same on every rank.
    low = hc.Compression.sketch(ratio=2, seed=5)
    w, b, _ = run_switching(low, hc.Compression.sketch(ratio=6, seed=5))
    # more than one step's applied coordinates (every candidate)
    assert np.all(np.isfinite(w)) and np.count_nonzero(w) > low.sizes(w.size)[3]
    digests["sketch"] = digest([w, b])
    return dict(digests=digests)


def fixed_batches(batch_size):
    """This rank's shard as the same batches every epoch (no shuffle state to restore)."""
    (x, y), (x_test, y_test) = digits.load(0)
    steps = len(x) // (hvd.size() * batch_size)
    x, y = x[hvd.rank()::hvd.size()][:steps * batch_size], y[hvd.rank()::hvd.size()][:steps * batch_size]
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch_size), steps


def compiled_cnn(compression=hc.Compression.none, lr=0.1, hierarchical=False):
    keras = tf.keras
    tf.keras.utils.set_random_seed(0)
    model = digits.cnn(keras, seed=0)
    opt = hc.DistributedOptimizer(keras.optimizers.SGD(lr, momentum=0.9, nesterov=True), compression=compression,
                                  hierarchical=hierarchical)
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    count_traces(opt)
    return model, opt


def count_traces(opt):
    """Counts in opt.traces how often the step is traced (its Python runs only then), in either
    Keras (Keras 3's train_function is no tf.function to ask)."""
    step, opt.traces = opt._hc_step, 0

    def counted(pairs):
        opt.traces += 1
        return step(pairs)

    opt._hc_step = counted


def lr_drop_at(epoch, lr=0.1):
    keras = tf.keras
    return keras.callbacks.LearningRateScheduler(lambda e: lr * (0.1 if e >= epoch else 1.0))


def check_fit():
    keras = tf.keras
    train, steps = fixed_batches(32)
    model, opt = compiled_cnn(hierarchical=FLAGS.hierarchical_exchange)
    accordion = hc.callbacks.Accordion(low=hc.Compression.powersgd(rank=4), high=hc.Compression.powersgd(rank=1),
                                       interval=7)
    history = model.fit(train, epochs=5, callbacks=[lr_drop_at(4), accordion, keras.callbacks.TerminateOnNaN()],
                        verbose=0)
    exchange = opt.compression_exchange
    bytes_by_setting = [settings_bytes(ex) for ex in exchange.exchanges]
    return dict(model=digest(model.get_weights()), decisions=accordion.decisions,
                traces=opt.traces,
                logs={key: [float(v) for v in values] for key, values in history.history.items()},
                bytes_by_setting=bytes_by_setting, dense_bytes=exchange.dense_exchange.bytes_sent,
                cross_host_bytes_by_setting=([settings_cross_host_bytes(ex) for ex in exchange.exchanges]
                                             if FLAGS.hierarchical_exchange else None),
                steps_per_epoch=steps, uncompressed_bytes=exchange.uncompressed_bytes)


def settings_bytes(ex):
    """What one worker sends per step with Accordion's low and with its high setting in this exchange."""
    if not isinstance(ex, Hierarchical):
        return [choice.bytes_sent for choice in ex.choices]
    return [hierarchical_bytes(ex.bucket.num_elements, ex.splits[ex.hosts.local_rank], b, ex.hosts.local_size)
            for b in settings_cross_host_bytes(ex)]


def settings_cross_host_bytes(ex):
    """Hierarchical: what one worker sends to other hosts per step at each setting."""
    return [choice.bytes_sent for choice in ex.inner.choices] if ex.inner else [0.0, 0.0]


def check_batch():
    """AccordionBatchSize: k accumulated batches of 8 = one batch of 8k at k times the rate, and
    the callback switches the number of passes in model.fit."""
    keras = tf.keras
    (x, y), _ = digits.load(0)
    x, y = x[hvd.rank()::hvd.size()][:256], y[hvd.rank()::hvd.size()][:256]
    small, large = hc.callbacks.AccordionBatchSize(8, 32, verbose=0), None
    model, opt = compiled_cnn(lr=0.05)
    small.set_model(model)
    small.on_train_begin()
    opt.set_backward_passes_per_step(4)
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    large, large_opt = compiled_cnn(lr=0.05 * 4)
    large.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    for a, b in zip(model.get_weights(), large.get_weights()):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-6)
    assert int(opt.iterations.numpy()) == int(large_opt.iterations.numpy()) == 256 // 32
    # In model.fit, decided by the detector.
    train, steps = fixed_batches(8)
    model, opt = compiled_cnn(compression=hc.Compression.onebit(), lr=0.02)
    callback = hc.callbacks.AccordionBatchSize(8, 32)
    history = model.fit(train, epochs=6, callbacks=[lr_drop_at(5, 0.02), callback], verbose=0)
    return dict(model=digest(model.get_weights()), decisions=callback.decisions,
                iterations=int(opt.iterations.numpy()), steps_per_epoch=steps, traces=opt.traces,
                logs={key: [float(v) for v in values] for key, values in history.history.items()})


def check_checkpoint():
    """6 epochs with a learning-rate drop at epoch 3; `full` saves after epoch 3 (per rank),
    `resume` restores it in a new process and must decide and end exactly as `full`."""
    work = pathlib.Path(FLAGS.work_dir) / f"rank{hvd.rank()}"
    train, _ = fixed_batches(32)
    model, opt = compiled_cnn(compression=hc.Compression.onebit())
    checkpoint = tf.train.Checkpoint(model=model, optimizer=opt)
    accordion = hc.callbacks.Accordion(low=hc.Compression.none, high=hc.Compression.onebit(), verbose=0)
    callbacks = [lr_drop_at(3), accordion]
    if FLAGS.phase == "full":
        keras = tf.keras
        callbacks.append(keras.callbacks.LambdaCallback(
            on_epoch_end=lambda epoch, logs: checkpoint.save(str(work / "ckpt")) if epoch == 2 else None))
        first = 0
    else:
        checkpoint.restore(tf.train.latest_checkpoint(str(work))).assert_existing_objects_matched()
        first = 3
    model.fit(train, initial_epoch=first, epochs=6, callbacks=callbacks, verbose=0)
    detector = accordion.detector
    return dict(model=digest(model.get_weights()), optimizer=digest([v.numpy() for v in opt.variables]),
                decisions=[d for d in accordion.decisions if d["epoch"] >= 3],
                bytes_total=float(detector.bytes_total.numpy()),
                previous_norms=detector.previous_norms.numpy().tolist())


def main(_):
    hvd.init()
    run = {"rules": check_rules, "fit": check_fit, "batch": check_batch, "checkpoint": check_checkpoint}
    report(hvd, **{check: run[check]() for check in FLAGS.checks})


if __name__ == "__main__":
    app.run(main)
