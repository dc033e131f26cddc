"""What the multi-rank benchmarks share: the MLP they time, and starting their ranks.

A benchmark script runs itself under horovodrun with --role=worker; rank 0
writes its figures to the JSON file named by --result, which the launcher
returns.
"""
import json
import os
import pathlib
import subprocess
import sys
import tempfile


def mlp(keras, layers):
    """A ReLU MLP with these layer widths (input first, logits last)."""
    return keras.Sequential([keras.layers.Input((layers[0],))] + [
        keras.layers.Dense(units, activation="relu" if i < len(layers) - 2 else None)
        for i, units in enumerate(layers[1:])])


def run_worker(script, ranks, flags, threads_per_rank=1, timeout=900):
    """Runs `script --role=worker <flags> --result=...` on `ranks` local Gloo ranks; rank 0's JSON."""
    with tempfile.TemporaryDirectory() as tmp:
        result = pathlib.Path(tmp) / "result.json"
        horovodrun = pathlib.Path(sys.executable).with_name("horovodrun")
        cmd = [str(horovodrun), "-np", str(ranks), "-H", f"localhost:{ranks}", "--gloo", sys.executable,
               str(script), "--role=worker", f"--result={result}", *flags]
        env = dict(os.environ, TF_NUM_INTRAOP_THREADS=str(threads_per_rank), TF_NUM_INTEROP_THREADS="1")
        subprocess.run(cmd, check=True, timeout=timeout, env=env, stdout=subprocess.DEVNULL,
                       stderr=subprocess.PIPE)
        return json.loads(result.read_text())


def warm_step(keras, model, optimizer, batch_size, warmup=3):
    """A compiled training step on one fixed random batch, already run `warmup` times."""
    import tensorflow as tf

    width, classes = model.input_shape[-1], model.output_shape[-1]
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    x = tf.random.normal([batch_size, width])
    y = tf.random.uniform([batch_size], 0, classes, tf.int64)

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                      model.trainable_variables))
        return loss

    for _ in range(warmup):
        step().numpy()
    return step
