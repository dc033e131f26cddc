"""Compressor declarations: configuration errors, and the refusal of plain Horovod for stateful ones."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import horovod.tensorflow as hvd
import hvd_compress as hc
from hvd_compress import exchange


@pytest.fixture(scope="module", autouse=True)
def horovod_single_rank():
    hvd.init()  # a single-process job: enough to build Horovod's optimizer wrapper
    yield


@pytest.mark.parametrize("make, match", [
    (lambda: hc.Compression.onebit(block_size=0), "block_size"),
    (lambda: hc.Compression.onebit(block_size=2.5), "block_size"),
    (lambda: hc.Compression.topk(), "exactly one of ratio"),
    (lambda: hc.Compression.topk(ratio=0.1, k=3), "exactly one of ratio"),
    (lambda: hc.Compression.topk(ratio=1.5), "ratio must be"),
    (lambda: hc.Compression.topk(ratio=0), "ratio must be"),
    (lambda: hc.Compression.topk(k=0), "k must be a positive integer"),
    (lambda: hc.Compression.quantize(bits=3), "bits must be 2, 4 or 8"),
    (lambda: hc.Compression.quantize(block_size=1), "block_size must be"),
])
def test_bad_configuration_is_refused_when_built(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_topk_sizes():
    assert hc.Compression.topk(ratio=0.01).num_selected(1000) == 10
    assert hc.Compression.topk(ratio=0.01).num_selected(30) == 1  # never zero
    with pytest.raises(ValueError, match="larger than a tensor of 4 elements"):
        hc.Compression.topk(k=5).num_selected(4)


@pytest.mark.parametrize("compression", [hc.Compression.onebit(), hc.Compression.onebit,
                                         hc.Compression.topk(ratio=0.01)])
def test_stateful_compressor_in_plain_horovod_names_the_right_wrapper(compression):
    import horovod.tensorflow.keras as hvd_keras

    model = tf.keras.Sequential([tf.keras.layers.Input((3,)), tf.keras.layers.Dense(1)])
    model.compile(optimizer=hvd_keras.DistributedOptimizer(tf.keras.optimizers.SGD(0.1),
                                                           compression=compression), loss="mse")
    with pytest.raises(TypeError, match=r"use hvd_compress\.DistributedOptimizer"):
        model.train_on_batch(np.ones([4, 3]), np.ones([4, 1]))
    with pytest.raises(TypeError, match=r"hvd_compress\.DistributedOptimizer"):
        hvd.allreduce(tf.ones([4]), compression=compression)


def test_sum_compatible_compressors_work_in_plain_horovod():
    x = tf.constant([1.0, -2.5, 3.25])
    for compression in (hc.Compression.none, hc.Compression.fp16, hc.Compression.fp16()):
        np.testing.assert_array_equal(hvd.allreduce(x, compression=compression).numpy(), x.numpy())
    # bfloat16 has no Horovod allreduce; fp16 carries it and casts back.
    y = hvd.allreduce(tf.cast(x, tf.bfloat16), compression=hc.Compression.fp16)
    assert y.dtype == tf.bfloat16
    np.testing.assert_array_equal(y.numpy().astype(np.float32), x.numpy())


def test_onebit_round_trip_and_payload_size():
    onebit = hc.Compression.onebit(block_size=4)
    x = tf.constant([1.0, -3.0, 2.0, 2.0, -1.0, -1.0])
    bounds = onebit.bounds(6)
    payload = onebit.encode(x, bounds)
    np.testing.assert_allclose(onebit.decode(payload, bounds).numpy(), [2, -2, 2, 2, -1, -1])
    assert onebit.payload_bytes(6, 2) == sum(int(tf.size(p)) * p.dtype.size for p in payload)


def test_topk_round_trip_and_payload_size():
    topk = hc.Compression.topk(k=2)
    x = tf.constant([0.5, -4.0, 0.0, 3.0, 1.0])
    payload = topk.encode(x, topk.num_selected(5))
    np.testing.assert_array_equal(topk.decode(payload, 5).numpy(), [0, -4, 0, 3, 0])
    assert topk.payload_bytes(2) == sum(int(tf.size(p)) * p.dtype.size for p in payload)


def test_ring_and_allgather_byte_models():
    assert exchange.allreduce_bytes(1000, 1) == 0
    assert exchange.allreduce_bytes(1000, 2) == 1000
    assert exchange.allreduce_bytes(1000, 4) == 1500
    assert exchange.allgather_bytes(100, 4) == 300


def test_keras_3_is_refused_with_instructions():
    env = dict(os.environ, TF_USE_LEGACY_KERAS="0", TF_CPP_MIN_LOG_LEVEL="3")
    code = "import hvd_compress; hvd_compress.require_legacy_keras()"
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode != 0
    assert "Keras 3" in result.stderr and "TF_USE_LEGACY_KERAS=1" in result.stderr


@pytest.mark.parametrize("legacy, expected", [(None, "keras"), ("1", "tf_keras")])
def test_importing_the_package_leaves_the_choice_of_keras_to_the_user(legacy, expected):
    """No TF_USE_LEGACY_KERAS: tf.keras stays Keras 3; TF_USE_LEGACY_KERAS=1: tf_keras."""
    env = {k: v for k, v in os.environ.items() if k != "TF_USE_LEGACY_KERAS"}
    env.update({"TF_CPP_MIN_LOG_LEVEL": "3", **({"TF_USE_LEGACY_KERAS": legacy} if legacy else {})})
    code = ("import os, hvd_compress, tensorflow as tf\n"
            "print(tf.keras.__name__.split('.')[0], os.environ.get('TF_USE_LEGACY_KERAS'))")
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [expected, str(legacy)]


def test_a_tf_keras_user_does_not_import_keras_3(tmp_path):
    """hvd_compress's type checks look only at the Keras whose optimizers are imported: wrapping a
    tf_keras optimizer, the LossScaleOptimizer of mixed precision around it, a model.fit step and
    a model file saved and loaded leave Keras 3 unimported (it costs about 1.5 s a process)."""
    env = dict(os.environ, TF_USE_LEGACY_KERAS="1", TF_CPP_MIN_LOG_LEVEL="3")
    code = """
import sys, numpy as np, tensorflow as tf, horovod.tensorflow as hvd, hvd_compress as hc
hvd.init()
keras = tf.keras
model = keras.Sequential([keras.layers.Input((4,)), keras.layers.Dense(2)])
opt = keras.mixed_precision.LossScaleOptimizer(hc.DistributedOptimizer(keras.optimizers.SGD(0.1),
                                                                       compression=hc.Compression.onebit()))
model.compile(optimizer=opt, loss="mse")
model.fit(np.ones((4, 4)), np.ones((4, 2)), verbose=0)
hc.PushSumOptimizer(keras.optimizers.SGD(0.1))
model.save("model.h5")
loaded = tf.keras.models.load_model("model.h5")
print(type(opt.inner_optimizer).__name__, isinstance(opt.inner_optimizer, keras.optimizers.SGD),
      type(loaded.optimizer.inner_optimizer).__name__, "keras.src.optimizers" in sys.modules)
"""
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                            cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["DistributedOptimizer", "True", "DistributedOptimizer", "False"], result.stdout


class HalfTopK(hc.compression.TopKCompressor):
    """A user's subclass of a compressor, with an argument of its own."""

    def __init__(self, ratio=0.5, label="mine"):
        super().__init__(ratio=ratio)
        self.label = label


@pytest.mark.parametrize("compression", [
    hc.Compression.none, hc.Compression.fp16, hc.Compression.onebit(), hc.Compression.onebit(block_size=256),
    hc.Compression.topk(k=5), hc.Compression.randomk(ratio=0.1, seed=3),
    hc.Compression.powersgd(rank=2, warm_start=False), hc.Compression.sketch(ratio=4),
    hc.Compression.sketch(k=10, cols=200, rows=3), hc.Compression.sketch(ratio=4, mode="fetchsgd"),
    hc.Compression.onebit(two_way=False), hc.Compression.quantize(bits=4, stochastic=False),
    HalfTopK(0.25, label="x")], ids=repr)
def test_a_compression_saves_as_json_and_comes_back_alike(compression):
    """What a model file records of a compression (hc.DistributedOptimizer's config)."""
    config = json.loads(json.dumps(hc.compression.to_config(compression)))
    again = hc.compression.from_config(config)
    if isinstance(compression, type):  # Compression.none and fp16, used uncalled
        assert again is compression
    else:
        assert type(again) is type(compression) and vars(again) == vars(compression)


class HalfSent(hc.compressor.StatefulCompressor):
    """A compressor of a user's own: it sends half of every error-fed value and keeps the other half."""

    update_rule = hc.compressor.ERROR_FEEDBACK

    def plan(self, bucket):
        return HalvedAllreduce(bucket)


class HalvedAllreduce(exchange.Exchange):
    def __init__(self, bucket):
        self.bucket = bucket
        self.bytes_sent = exchange.allreduce_bytes(4 * bucket.num_elements, bucket.size)

    def __call__(self, parts, state, step):
        sent = [p * 0.5 for p in parts]
        mean = hvd.allreduce(exchange.concat(sent), op=hvd.Average, process_set=self.bucket.process_set,
                             name=self.bucket.name)
        return exchange.Exchanged([p - s for p, s in zip(parts, sent)], exchange.split(mean, parts))


def train_three_steps(compression):
    keras = hc.require_legacy_keras()
    w = tf.Variable(np.zeros(2048, np.float32))
    opt = hc.DistributedOptimizer(keras.optimizers.SGD(0.1), compression=compression)
    g = tf.constant(np.linspace(-1, 1, 2048, dtype=np.float32))
    step = tf.function(lambda: opt.apply_gradients([(g, w)]))
    for _ in range(3):
        step()
    return w.numpy(), g.numpy(), opt


def test_a_compressor_of_ones_own_plans_its_exchange_and_trains():
    """The contract a user implements: update_rule and plan(bucket) -> Exchange. Error feedback sends
    g/2, then (g + g/2)/2, then (g + 3g/4)/2: the weights move by -0.1 (0.5 + 0.75 + 0.875) g."""
    w, g, opt = train_three_steps(HalfSent())
    np.testing.assert_allclose(w, -0.1 * 2.125 * g, rtol=1e-6, atol=1e-7)
    assert isinstance(opt.compression_exchange.exchanges[0], HalvedAllreduce)


def test_a_subclass_of_a_compressor_trains_as_its_base():
    """A user's subclass (HalfTopK) plans the exchange of its base class, top-k."""
    w, _, opt = train_three_steps(HalfTopK(0.25))
    assert type(opt.compression_exchange.exchanges[0]).__name__ == "SparseAllgather"
    assert 0 < np.count_nonzero(w) <= 3 * 512


def test_a_compressor_without_a_known_update_rule_is_refused():
    class Unruly(HalfSent):
        update_rule = "momentum_behind"

    with pytest.raises(TypeError, match="update_rule"):
        hc.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), compression=Unruly())
