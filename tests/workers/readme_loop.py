"""The README's custom training loop, run as written: its code block under "Custom training loop" is executed with
a model, an optimizer and a loss of the user's (the names it uses), after the broadcast the README asks for, then
trains a few steps, broadcasting the optimizer's variables after the first as the README says. Reports the losses
and a digest of the weights."""
import pathlib
import re

import numpy as np
import tensorflow as tf
from absl import app

import horovod.tensorflow as hvd
import hvd_compress as hc
from _worker import report, weights_digest

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def readme_loop():
    """The python block of the README's "Custom training loop" section."""
    text = README.read_text()
    section = text[text.index("### Custom training loop"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def main(_):
    hvd.init()
    keras = tf.keras
    keras.utils.set_random_seed(hvd.rank())  # each rank its own initial weights: the broadcast must fix them
    model = keras.Sequential([keras.layers.Input([8]), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(3)])
    opt = keras.optimizers.Adam(1e-2)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    namespace = dict(tf=tf, hc=hc, hvd=hvd, model=model, opt=opt, loss_fn=loss_fn)
    exec(readme_loop(), namespace)  # noqa: S102 - the README's own code
    text = README.read_text()
    assert "hc.broadcast_variables(model.variables, 0)" in text[text.index("### Custom training loop"):]
    hc.broadcast_variables(model.variables, 0)  # as the README says: "before training"
    rng = np.random.default_rng(100 + hvd.rank())
    x = rng.standard_normal([64, 8]).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64) + (x[:, 1] > 0).astype(np.int64)
    losses = []
    for step in range(30):
        losses.append(float(namespace["train_step"](x[step % 8 * 8:][:8], y[step % 8 * 8:][:8])))
        if step == 0:
            variables = opt.variables() if callable(opt.variables) else opt.variables  # (a method in tf_keras)
            hc.broadcast_variables(variables, 0)  # "and the optimizer's variables after the first step"
    report(hvd, losses=losses, digest=weights_digest(model))


if __name__ == "__main__":
    app.run(main)
