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


def _run_for_json(script, ranks, flags, json_flag, env, timeout):
    """Runs `script <flags> --<json_flag>=<file>` on `ranks` local Gloo ranks; the JSON rank 0 wrote."""
    with tempfile.TemporaryDirectory() as tmp:
        output = pathlib.Path(tmp) / "output.json"
        horovodrun = pathlib.Path(sys.executable).with_name("horovodrun")
        cmd = [str(horovodrun), "-np", str(ranks), "-H", f"localhost:{ranks}", "--gloo", sys.executable,
               str(script), *flags, f"--{json_flag}={output}"]
        subprocess.run(cmd, check=True, timeout=timeout, env=dict(os.environ, **env), stdout=subprocess.DEVNULL,
                       stderr=subprocess.PIPE)
        return json.loads(output.read_text())


def run_worker(script, ranks, flags, threads_per_rank=1, timeout=900):
    """Runs `script --role=worker <flags> --result=...` on `ranks` local Gloo ranks; rank 0's JSON."""
    return _run_for_json(script, ranks, ["--role=worker", *flags], "result",
                         dict(TF_NUM_INTRAOP_THREADS=str(threads_per_rank), TF_NUM_INTEROP_THREADS="1"), timeout)


def warm_step(keras, model, optimizer, batch_size, warmup=3):
    """A compiled training step on one fixed random batch, already run `warmup` times.

    The step calls `optimizer.minimize(loss, variables, tape=tape)`, as Keras's
    Model.train_step does: Horovod's own DistributedOptimizer allreduces in
    compute_gradients, hvd_compress's optimizers in apply_gradients.
    """
    import tensorflow as tf

    classes = model.output_shape[-1]
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    x = tf.random.normal([batch_size, *model.input_shape[1:]])
    y = tf.random.uniform([batch_size], 0, classes, tf.int64)

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        optimizer.minimize(loss, model.trainable_variables, tape=tape)
        return loss

    for _ in range(warmup):
        step().numpy()
    return step


def run_example(script, ranks, flags, timeout=1200):
    """Runs examples/<script> on `ranks` local Gloo ranks with --history; rank 0's history."""
    examples = pathlib.Path(__file__).resolve().parent.parent / "examples"
    return _run_for_json(examples / script, ranks, flags, "history",
                         dict(PYTHONPATH=str(examples), TF_CPP_MIN_LOG_LEVEL="2"), timeout)
