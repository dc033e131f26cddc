"""Which Keras `tf.keras` is, and the refusal to run the Keras wrappers on Keras 3."""
import tensorflow as tf


def require_legacy_keras():
    """Returns the tf_keras (Keras 2) module behind `tf.keras`, or raises RuntimeError.

    hvd_compress's Keras wrappers (and Horovod's) work on tf_keras only: under
    Keras 3, hvd.DistributedOptimizer silently stops averaging gradients.
    """
    keras = tf.keras
    if not keras.__name__.startswith("tf_keras"):
        raise RuntimeError(
            f"tf.keras is Keras 3 ({keras.__name__}), which hvd_compress does not support yet. "
            "Install tf_keras==2.18.* and set TF_USE_LEGACY_KERAS=1 before TensorFlow first uses "
            "tf.keras (importing hvd_compress before touching tf.keras does this for you).")
    return keras
