"""hc.DistributedOptimizer's refusals and edge cases, in one process (Horovod with one rank)."""
import numpy as np
import pytest
import tensorflow as tf

import horovod.tensorflow as hvd
import hvd_compress as hc

keras = hc.require_legacy_keras()


@pytest.fixture(scope="module", autouse=True)
def horovod_single_rank():
    hvd.init()


def sgd():
    return keras.optimizers.SGD(0.1, momentum=0.9)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(compression=hc.Compression.onebit(), two_way="yes"), TypeError, "two_way"),
    (dict(compression="onebit"), TypeError, "hvd_compress.Compression"),
    (dict(compression=hc.Compression.onebit(), op=hvd.Adasum), ValueError, "op must be"),
    (dict(backward_passes_per_step=0), ValueError, "backward_passes_per_step"),
    (dict(min_compress_size=0), ValueError, "min_compress_size"),
])
def test_bad_arguments_are_refused_before_training(kwargs, error, match):
    with pytest.raises(error, match=match):
        hc.DistributedOptimizer(sgd(), **kwargs)


def test_legacy_optimizers_are_refused():
    with pytest.raises(TypeError, match=r"Keras optimizer .* Legacy optimizers .* are not supported"):
        hc.DistributedOptimizer(keras.optimizers.legacy.SGD(0.1))


def test_keras3_gradient_accumulation_is_refused_with_the_fix():
    import keras as keras3
    with pytest.raises(ValueError, match="backward_passes_per_step=4"):
        hc.DistributedOptimizer(keras3.optimizers.SGD(0.1, gradient_accumulation_steps=4))


def test_k_larger_than_the_tensor_is_refused_at_the_first_step():
    w = tf.Variable(tf.ones([2000]))
    opt = hc.DistributedOptimizer(sgd(), compression=hc.Compression.topk(k=5000))
    with pytest.raises(ValueError, match="larger than a tensor of 2000 elements"):
        opt.apply_gradients([(tf.ones([2000]), w)])


def test_none_zero_size_and_small_gradients():
    big, small, empty = tf.Variable(tf.ones([3000])), tf.Variable(tf.ones([3])), tf.Variable(tf.ones([0, 4]))
    opt = hc.DistributedOptimizer(sgd(), compression=hc.Compression.onebit())
    opt.apply_gradients([(None, big), (tf.ones([3]), small), (tf.ones([0, 4]), empty)])
    layout = opt.compression_exchange.layout
    assert (layout.compressed, layout.dense, layout.empty) == ([0], [1], [2])
    np.testing.assert_array_equal(big.numpy(), 1.0)  # a None gradient counts as zero
    np.testing.assert_allclose(small.numpy(), 0.9)


def test_integer_gradients_are_refused():
    w = tf.Variable(tf.ones([3000]))
    opt = hc.DistributedOptimizer(sgd(), compression=hc.Compression.onebit())
    with pytest.raises(TypeError, match="dtype int32"):
        opt.apply_gradients([(tf.ones([3000], tf.int32), w)])


def test_sparse_gradients_are_exchanged_without_a_flag():
    embedding = keras.layers.Embedding(500, 8)
    embedding.build((None,))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(embedding(tf.constant([1, 2, 3])))
    grad = tape.gradient(loss, embedding.embeddings)
    assert isinstance(grad, tf.IndexedSlices)
    for sparse_as_dense in (False, True):
        before = embedding.embeddings.numpy()
        opt = hc.DistributedOptimizer(sgd(), compression=hc.Compression.onebit(), sparse_as_dense=sparse_as_dense)
        opt.apply_gradients([(grad, embedding.embeddings)])
        moved = np.flatnonzero(np.any(embedding.embeddings.numpy() != before, 1))
        assert 1 in moved and 2 in moved and 3 in moved


def test_a_variable_without_gradient_is_left_alone():
    a, b = tf.Variable(tf.ones([3000])), tf.Variable(tf.ones([3000]))
    opt = hc.DistributedOptimizer(keras.optimizers.AdamW(0.1, weight_decay=0.1),
                                  compression=hc.Compression.topk(ratio=0.1))
    for _ in range(3):
        opt.apply_gradients([(tf.ones([3000]), a), (None, b)])
    assert np.all(b.numpy() == 1.0) and np.all(a.numpy() != 1.0)
    assert float(tf.reduce_max(tf.abs(opt.compression_exchange.residuals[1]))) == 0.0


def test_variables_must_not_change_between_steps():
    a, b = tf.Variable(tf.ones([3000])), tf.Variable(tf.ones([3000]))
    opt = hc.DistributedOptimizer(sgd(), compression=hc.Compression.onebit())
    opt.apply_gradients([(tf.ones([3000]), a)])
    with pytest.raises(ValueError, match="not among them"):
        opt.apply_gradients([(tf.ones([3000]), b)])


def test_backward_passes_per_step_applies_every_k_passes():
    w = tf.Variable(tf.zeros([3000]))
    opt = hc.DistributedOptimizer(keras.optimizers.SGD(0.1), compression=hc.Compression.onebit(),
                                  backward_passes_per_step=3, average_aggregated_gradients=True)
    step = tf.function(lambda g: opt.apply_gradients([(g, w)]))
    for value in (1.0, 2.0):
        step(tf.fill([3000], value))
        np.testing.assert_array_equal(w.numpy(), 0.0)
        assert int(opt.iterations.numpy()) == 0
    step(tf.fill([3000], 3.0))  # the mean of the three passes, 2.0, at lr 0.1, one bit per element
    np.testing.assert_allclose(w.numpy(), -0.2, rtol=1e-6)
    assert int(opt.iterations.numpy()) == 1


def test_fp16_compression_bytes_and_result():
    w = tf.Variable(tf.zeros([3000]))
    opt = hc.DistributedOptimizer(keras.optimizers.SGD(1.0), compression=hc.Compression.fp16)
    opt.apply_gradients([(tf.fill([3000], 0.1), w)])
    np.testing.assert_allclose(w.numpy(), -np.float32(np.float16(0.1)))
    assert opt.compression_exchange.layout.dense == [0]


def test_tape_needs_an_exchange_for_stateful_compression():
    with tf.GradientTape() as tape:
        pass
    with pytest.raises(ValueError, match="GradientExchange"):
        hc.DistributedGradientTape(tape, compression=hc.Compression.onebit())


def test_auto_is_refused_where_nothing_would_decide():
    """Compression.auto() decides in hc.DistributedOptimizer only; a tape (or the exchange a tape is given) would
    keep it at full precision in silence."""
    with tf.GradientTape() as tape:
        pass
    for kwargs in (dict(compression=hc.Compression.auto()), dict(exchange=hc.GradientExchange(hc.Compression.auto()))):
        with pytest.raises(ValueError, match=r"hc.DistributedGradientTape\(compression=\.\.\. or exchange=\.\.\.\): "
                                             r"Compression.auto\(.*hvd_compress.advise"):
            hc.DistributedGradientTape(tape, **kwargs)


def test_auto_refuses_an_untimed_step_and_a_step_traced_before_it_decided():
    """Compression.auto() as a user may call it wrong: a step outside auto.train_step or hvd_compress's fit callbacks
    (nothing times it, so nothing would decide) is refused where it is traced; a tf.function traced during the
    calibration that runs after the decision (it would go on with the calibration's full-precision exchange) fails
    with the fix and changes nothing; a function made anew then trains with the choice."""
    model = keras.Sequential([keras.Input([8]), keras.layers.Dense(4)])
    auto = hc.Compression.auto(calibration_steps=3)
    opt = hc.DistributedOptimizer(keras.optimizers.AdamW(1e-2), compression=auto)
    x, y = tf.random.normal([16, 8], seed=1), tf.random.normal([16, 4], seed=2)

    def one_batch():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x) - y) ** 2)
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        return loss

    model.compile(optimizer=opt, loss="mse")
    for untimed in (tf.function(one_batch), one_batch,  # traced, eager, and model.fit without hvd_compress's callbacks
                    lambda: model.fit(x, y, epochs=1, verbose=0)):
        with pytest.raises(ValueError, match=r"nothing times this optimizer step.*auto\.train_step"):
            untimed()
    step, decided, losses = tf.function(one_batch), False, []
    while not decided:
        loss, decided = auto.train_step(opt, model.trainable_variables, lambda: step().numpy())
        losses.append(float(loss))
    assert auto.decision is not None and opt.hc_auto is None
    steps = int(opt.iterations.numpy())
    with pytest.raises(tf.errors.InvalidArgumentError, match="has chosen its compression since this step was traced"):
        step()
    step = tf.function(one_batch)  # the chosen exchange's step
    losses += [float(step()) for _ in range(5)]
    assert int(opt.iterations.numpy()) == steps + 5 and losses[-1] < losses[0], losses


def test_tape_exchange_state_is_checkpointed(tmp_path):
    def trained_exchange(steps):
        w = tf.Variable(tf.zeros([2048]))
        exchange = hc.GradientExchange(hc.Compression.topk(ratio=0.01))
        for t in range(steps):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(w * tf.random.stateless_normal([2048], [t, 0]))
            hc.DistributedGradientTape(tape, exchange=exchange).gradient(loss, [w])
        return w, exchange

    w, exchange = trained_exchange(3)
    path = tf.train.Checkpoint(exchange=exchange).save(str(tmp_path / "ckpt"))
    fresh_w, fresh = trained_exchange(0)
    tf.train.Checkpoint(exchange=fresh).restore(path)
    fresh.build([fresh_w])  # what the first step does; the restored values fill the new variables
    np.testing.assert_array_equal(fresh.residuals[0].numpy(), exchange.residuals[0].numpy())
    assert np.abs(exchange.residuals[0].numpy()).sum() > 0
    assert int(fresh.own_steps.numpy()) == 3  # the step count a tape has not, restored too


def test_a_tapes_exchange_counts_its_own_steps():
    """Random-k draws new coordinates every step from the step number; a tape has none, so its
    exchange counts (it used to fail on None; sketched SGD hashed every step alike)."""
    w = tf.Variable(tf.ones([4000]))
    compressor = hc.Compression.randomk(ratio=0.01, seed=4)
    exchange = hc.GradientExchange(compressor)

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(w * w)
        return hc.DistributedGradientTape(tape, exchange=exchange).gradient(loss, [w])[0]

    for t in range(3):
        sent = np.flatnonzero(step().numpy())
        want = np.sort(compressor.indices(4000, 40, t, 0).numpy())
        np.testing.assert_array_equal(sent, want, err_msg=f"step {t}")
    assert int(exchange.own_steps.numpy()) == 3


@pytest.mark.parametrize("kwargs, match", [
    (dict(), "ratio= .* or k="),
    (dict(ratio=4, k=10), "ratio= .* or k="),
    (dict(ratio=0.5), "ratio must be a number > 1"),
    (dict(k=10), "needs cols="),
    (dict(k=10, cols=5), "cols=5 < k=10"),
    (dict(k=10, rows=0, cols=100), "rows must be a positive integer"),
    (dict(ratio=4, cols=100), "give cols= with k="),
    (dict(ratio=4, candidates=0), "candidates must be a positive integer"),
    (dict(ratio=4, candidates=10, second_round=False), "no effect with second_round=False"),
    (dict(ratio=4, mode="fetch"), "mode must be one of"),
    (dict(ratio=4, mode="fetchsgd", second_round=True), "mode='fetchsgd' runs one round"),
    (dict(ratio=4, mode="fetchsgd", candidates=10), "mode='fetchsgd' runs one round"),
    (dict(ratio=4, mode="fetchsgd", apply_candidates=True), "apply_candidates .* needs mode='sketched'"),
    (dict(ratio=4, second_round=False, apply_candidates=False), "apply_candidates .* needs .* second_round=True"),
    (dict(ratio=4, apply_candidates="all"), r"apply_candidates \(True or False\)"),
    (dict(ratio=4, mode="fetchsgd", mask_momentum=False), "mask_momentum .* needs mode='sketched'"),
    (dict(ratio=4, mask_momentum=1), r"mask_momentum \(True or False\)"),
])
def test_sketch_sizes_that_cannot_work_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        hc.Compression.sketch(**kwargs)


def test_the_recall_metric_is_refused_where_it_cannot_be_measured():
    """Before any collective: for a compressor other than the sketch, and after the first step."""
    model = tf.keras.Sequential([tf.keras.layers.Input((2,)), tf.keras.layers.Dense(1)])
    model.compile(optimizer=hc.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), compression=hc.Compression.topk(ratio=0.5)),
                  loss="mse")
    with pytest.raises(ValueError, match="Recall is measured for Compression.sketch"):
        model.fit(np.ones((4, 2)), np.ones((4, 1)), callbacks=[hc.callbacks.CompressionMetrics(recall=True)], verbose=0)
    fetchsgd = hc.Compression.sketch(ratio=2, mode="fetchsgd")
    model.compile(optimizer=hc.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), compression=fetchsgd), loss="mse")
    with pytest.raises(ValueError, match="FetchSGD's lives in sketch space only"):
        model.fit(np.ones((4, 2)), np.ones((4, 1)), callbacks=[hc.callbacks.CompressionMetrics(recall=True)], verbose=0)
    model.compile(optimizer=hc.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), compression=hc.Compression.sketch(ratio=2)),
                  loss="mse")
    model.fit(np.ones((4, 2)), np.ones((4, 1)), verbose=0)
    with pytest.raises(ValueError, match=r"before the first step: add hc.callbacks.CompressionMetrics\(recall=True\)"):
        model.fit(np.ones((4, 2)), np.ones((4, 1)), callbacks=[hc.callbacks.CompressionMetrics(recall=True)], verbose=0)


def test_accordion_refuses_fetchsgd():
    """Its error lives in sketch space, where the other setting's steps would not add to it."""
    for low, high in [(hc.Compression.none, hc.Compression.sketch(ratio=8, mode="fetchsgd")),
                      (hc.Compression.sketch(ratio=2, mode="fetchsgd"), hc.Compression.sketch(ratio=8, mode="fetchsgd"))]:
        with pytest.raises(ValueError, match="Accordion cannot switch FetchSGD"):
            hc.callbacks.Accordion(low=low, high=high)


def test_a_sketch_larger_than_the_bucket_is_refused():
    with pytest.raises(ValueError, match="larger than a bucket"):
        hc.Compression.sketch(k=50, cols=100).sizes(20)


@pytest.mark.parametrize("kwargs, match", [
    (dict(rank=0), "rank must be a positive integer"),
    (dict(rank=2.0), "rank must be a positive integer"),
    (dict(min_compression=0.5), "min_compression"),
])
def test_powersgd_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        hc.Compression.powersgd(**kwargs)


def test_powersgd_compresses_only_what_it_shrinks():
    kernel = tf.Variable(tf.ones([3, 3, 16, 32]))    # viewed as [144, 32]: 4608 vs 4 * 176: compressed
    narrow = tf.Variable(tf.ones([2000, 2]))         # 4000 values vs 4 * 2002: would grow: dense
    vector = tf.Variable(tf.ones([5000]))            # not a matrix: dense
    opt = hc.DistributedOptimizer(sgd(), compression=hc.Compression.powersgd(rank=4))
    opt.apply_gradients([(tf.ones([3, 3, 16, 32]), kernel), (tf.ones([2000, 2]), narrow),
                         (tf.ones([5000]), vector)])
    exchange = opt.compression_exchange
    assert (exchange.layout.compressed, exchange.layout.dense) == ([0], [1, 2])
    assert exchange.low_rank_q[0].shape == [32, 4]
    # A rank-1 gradient is recovered exactly by a rank-4 approximation: no residual left.
    assert float(exchange.residual_norm()) < 1e-5 * np.sqrt(4608)  # relative to |M| (float32)


def test_powersgd_without_warm_start_draws_a_fresh_shared_q():
    kernel = tf.Variable(tf.zeros([64, 48]))
    opt = hc.DistributedOptimizer(keras.optimizers.SGD(1.0),
                                  compression=hc.Compression.powersgd(rank=2, warm_start=False))
    gradient = tf.constant(np.outer(np.arange(64), np.ones(48)), tf.float32)  # rank 1
    opt.apply_gradients([(gradient, kernel)])
    exchange = opt.compression_exchange
    assert exchange.low_rank_q == []  # no state kept for Q
    np.testing.assert_allclose(kernel.numpy(), -gradient.numpy(), rtol=1e-4, atol=1e-3)
    assert float(exchange.residual_norm()) < 1e-5 * float(tf.norm(gradient))


def test_compressions_measured_to_lose_accuracy_under_adam_say_so_when_they_wrap_it(caplog):
    """top-k, random-k and PowerSGD lost points under AdamW on the transformer: wrapping Adam or AdamW with
    them logs what was measured and what kept the accuracy; SGD, and onebit (1-bit Adam) under AdamW, log nothing."""
    import keras as keras3
    for keras_ in (keras, keras3):
        for compression in (hc.Compression.topk(ratio=0.01), hc.Compression.randomk(ratio=0.01),
                            hc.Compression.powersgd()):
            for optimizer in (keras_.optimizers.Adam(0.01), keras_.optimizers.AdamW(0.01)):
                caplog.clear()
                with caplog.at_level("WARNING", logger="hvd_compress"):
                    hc.DistributedOptimizer(optimizer, compression=compression)
                assert "lost" in caplog.text and "1-bit Adam" in caplog.text, (compression, optimizer)
        for optimizer, compression in ((keras_.optimizers.SGD(0.1), hc.Compression.topk(ratio=0.01)),
                                       (keras_.optimizers.AdamW(0.01), hc.Compression.onebit())):
            caplog.clear()
            with caplog.at_level("WARNING", logger="hvd_compress"):
                hc.DistributedOptimizer(optimizer, compression=compression)
            assert caplog.text == "", (compression, optimizer)


@pytest.mark.parametrize("compression", [hc.Compression.onebit(), hc.Compression.topk(ratio=0.1)],
                         ids=["1-bit Adam", "frozen variance"])
def test_adam_rules_that_average_refuse_a_sum(compression):
    """1-bit Adam and Adam with a frozen variance (error feedback with a warm-up) move Adam's momentum by an average:
    op=hvd.Sum is refused at the first step, before any collective, naming the fix."""
    w = tf.Variable(tf.ones([3000]))
    opt = hc.DistributedOptimizer(keras.optimizers.AdamW(0.01), compression=compression, op=hvd.Sum, warmup_steps=2)
    with pytest.raises(ValueError, match="op=hvd.Average"):
        opt.apply_gradients([(tf.ones([3000]), w)])
    assert np.all(w.numpy() == 1.0)


@pytest.mark.parametrize("warmup_steps", [0, 2])
def test_error_feedback_under_adam_freezes_the_variance_after_a_warm_up(warmup_steps):
    """top-k under AdamW: with a warm-up, Adam's variance stops at the warm-up's last step and its momentum goes on
    (hvd_compress applies the step); without one, Keras's AdamW applies the exchanged mean and v follows it."""
    from hvd_compress.adam import FrozenVarianceAdam
    from hvd_compress.keras_compat import adam_slots
    w = tf.Variable(tf.zeros([3000]))
    adamw = keras.optimizers.AdamW(0.01, weight_decay=0.01)
    opt = hc.DistributedOptimizer(adamw, compression=hc.Compression.topk(ratio=0.1), warmup_steps=warmup_steps)
    rng = np.random.default_rng(0)
    seen = []
    for _ in range(5):
        opt.apply_gradients([(tf.constant(rng.standard_normal(3000).astype(np.float32)), w)])
        m, v, _ = adam_slots(adamw, w)
        seen.append((m.numpy().copy(), v.numpy().copy()))
    exchange = opt.compression_exchange
    if warmup_steps:
        assert isinstance(exchange.rule, FrozenVarianceAdam) and exchange.rule.applies_step
        assert all(np.array_equal(v, seen[warmup_steps - 1][1]) for _, v in seen[warmup_steps:])
    else:
        assert type(exchange.rule).__name__ == "ErrorFeedback" and not exchange.rule.applies_step
        assert not np.array_equal(seen[-1][1], seen[-2][1])
    assert all(not np.array_equal(a[0], b[0]) for a, b in zip(seen, seen[1:]))  # m moves every step
    assert int(opt.iterations) == 5


def test_the_consensus_callback_is_refused_where_ranks_agree_already():
    """hc.callbacks.Consensus averages SGP's ranks; under a DistributedOptimizer it says so before the first step."""
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile(optimizer=hc.DistributedOptimizer(sgd()), loss="mse")
    with pytest.raises(ValueError, match="Consensus averages the ranks of SGP"):
        model.fit(np.zeros((8, 4)), np.zeros((8, 2)), epochs=1, verbose=0, callbacks=[hc.callbacks.Consensus()])


@pytest.mark.parametrize("max_drift, match", [(0, "number of steps"), (-1, "number of steps"),
                                               (1.5, "number of steps"), (True, "number of steps"),
                                               (1, "lockstep already")])
def test_a_drift_bound_that_cannot_apply_is_refused(max_drift, match):
    """A bad number of steps; a bound over the alltoall transport (the default), which runs in lockstep."""
    with pytest.raises(ValueError, match=match):
        hc.PushSumOptimizer(sgd(), max_drift=max_drift)


@pytest.mark.parametrize("name, content, error, match", [
    ("missing.keras", None, FileNotFoundError, "No model file at"),
    ("cut.keras", b"PK\x03\x04 a save interrupted", ValueError, "truncated or corrupted"),
    ("cut.h5", b"\x89HDF\r\n\x1a\n cut short", ValueError, "truncated or corrupted"),
    ("notes.txt", b"not a model", ValueError, "not a Keras model file"),
])
def test_load_model_names_the_file_and_the_fix_where_it_cannot_read_it(tmp_path, name, content, error, match):
    path = tmp_path / name
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(error, match=match) as raised:
        hc.load_model(str(path))
    assert str(path) in str(raised.value)


def test_a_keras_file_tf_keras_wrote_is_read_by_tf_keras(tmp_path):
    """tf_keras writes .keras archives too (ModelCheckpoint("x.keras")); Keras 3 cannot read its optimizer."""
    model = keras.Sequential([keras.layers.Input([3]), keras.layers.Dense(2)])
    model.compile(optimizer=hc.DistributedOptimizer(keras.optimizers.AdamW(1e-3)), loss="mse")
    model.fit(np.ones([4, 3], np.float32), np.ones([4, 2], np.float32), verbose=0)
    model.save(tmp_path / "tf_keras.keras")
    loaded = hc.load_model(str(tmp_path / "tf_keras.keras"))
    assert type(loaded.optimizer).__module__.startswith("hvd_compress") or hc.optimizer.is_distributed(loaded.optimizer)
    assert type(loaded).__module__.startswith("tf_keras")
    np.testing.assert_array_equal(loaded.get_weights()[0], model.get_weights()[0])


def test_a_keras3_file_loaded_without_hvd_compress_says_how_to_load_it(tmp_path):
    """keras.models.load_model(compile=True) where hvd_compress is not imported: Keras 3's error quotes the saved
    config, whose `to_load` names `import hvd_compress` and compile=False."""
    import os
    import subprocess
    import sys
    env = {**os.environ, "TF_USE_LEGACY_KERAS": "0", "TF_CPP_MIN_LOG_LEVEL": "3"}
    save = f"""
import numpy as np, keras, horovod.tensorflow as hvd, hvd_compress as hc
hvd.init()
model = keras.Sequential([keras.layers.Input([3]), keras.layers.Dense(2)])
model.compile(optimizer=hc.DistributedOptimizer(keras.optimizers.Adam(1e-3)), loss="mse")
model.fit(np.ones([4, 3], np.float32), np.ones([4, 2], np.float32), verbose=0)
model.save({str(tmp_path / "m.keras")!r})
"""
    load = f"""
import sys, keras
try:
    keras.models.load_model({str(tmp_path / "m.keras")!r})
except TypeError as error:
    assert "hvd_compress" not in sys.modules
    print(error)
"""
    for code in (save, load):
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env,
                                cwd=tmp_path)
        assert result.returncode == 0, result.stderr[-3000:]
    assert "`import hvd_compress`" in result.stdout and "compile=False" in result.stdout, result.stdout


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(sync_every=0), ValueError, "sync_every must be"),
    (dict(sync_every=True), ValueError, "sync_every must be"),
    (dict(sync_every=4, outer_learning_rate=0), ValueError, "outer_learning_rate must be"),
    (dict(sync_every=4, outer_momentum=1.0), ValueError, "outer_momentum must be"),
    (dict(sync_every=4, nesterov="yes"), TypeError, "nesterov must be"),
    (dict(sync_every=4, error_decay=0.95), ValueError, "error_decay=0.95 decays the error feedback"),
    (dict(sync_every=4, error_decay=1.5, compression=hc.Compression.topk(ratio=0.01)), ValueError, "error_decay must"),
    (dict(sync_every=4, compression="topk"), TypeError, "hvd_compress.Compression"),
    (dict(sync_every=4, fragments=0), ValueError, "fragments must be a whole number from 1 to sync_every=4"),
    (dict(sync_every=4, fragments=5), ValueError, "fragments must be a whole number from 1 to sync_every=4"),
    (dict(sync_every=4, sync_delay=4), ValueError, "sync_delay must be .* from 0 to sync_every - 1 = 3"),
    (dict(sync_every=4, sync_delay=-1), ValueError, "sync_delay must be"),
    (dict(sync_every=4, sync_delay=1, merge_alpha=1.0), ValueError, "merge_alpha must be a number in"),
    (dict(sync_every=4, merge_alpha=0.5), ValueError, "sync_delay=0 leaves none: give sync_delay="),
    (dict(sync_every=4, compression=hc.Compression.auto()), ValueError, r"chooses inside hc.DistributedOptimizer only"),
])
def test_bad_diloco_arguments_are_refused_before_training(kwargs, error, match):
    with pytest.raises(error, match=match):
        hc.DiLoCo(sgd(), **kwargs)


def test_diloco_refuses_a_loss_scale_optimizer_and_a_wrapped_one():
    with pytest.raises(TypeError, match=r"keras.mixed_precision.LossScaleOptimizer\(hvd_compress.DiLoCo"):
        hc.DiLoCo(keras.mixed_precision.LossScaleOptimizer(sgd()), sync_every=4)
    with pytest.raises(ValueError, match="already wrapped"):
        hc.DiLoCo(hc.DistributedOptimizer(sgd()), sync_every=4)


def test_a_fit_in_which_diloco_never_syncs_is_reported_before_its_first_step(caplog):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(hc.DiLoCo(sgd(), sync_every=50), "mse")
    x = np.ones((64, 3), np.float32)
    with caplog.at_level("WARNING", logger="hvd_compress"):
        model.fit(x, x[:, :1], batch_size=8, epochs=2, verbose=0, callbacks=[hc.callbacks.MetricAverageCallback()])
    assert "no sync falls in it" in caplog.text and "sync_every=" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="hvd_compress"):  # steps 17 to 56 hold the sync at 50
        model.fit(x, x[:, :1], batch_size=8, initial_epoch=2, epochs=7, verbose=0,
                  callbacks=[hc.callbacks.MetricAverageCallback()])
    assert "no sync" not in caplog.text
    assert int(model.optimizer.diloco.inner_steps.numpy()) == 56


def test_streaming_diloco_cuts_a_model_with_too_few_rows_before_any_collective():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])  # 3 + 1 rows
    model.compile(hc.DiLoCo(sgd(), sync_every=8, fragments=5), "mse")
    x = np.ones((16, 3), np.float32)
    with pytest.raises(ValueError, match=r"fragments=5\) cuts the model by rows .* has 4 rows: give fewer"):
        model.fit(x, x[:, :1], batch_size=8, epochs=1, verbose=0)
