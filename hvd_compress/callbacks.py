"""Keras callbacks: compression metrics in the logs (and so in TensorBoard)."""
import tensorflow as tf

from hvd_compress.keras_compat import require_legacy_keras

keras = require_legacy_keras()


class CompressionMetrics(keras.callbacks.Callback):
    """Adds, at every epoch end, to the Keras logs:

    - bytes_per_step: bytes one worker sends per step through hvd_compress
      (it receives as many);
    - compression_ratio: Horovod's fp32 ring allreduce bytes / bytes_per_step;
    - residual_norm: global norm of this rank's error-feedback residuals.

    Put it before keras.callbacks.TensorBoard in the callbacks list so
    TensorBoard sees the values.
    """

    def on_epoch_end(self, epoch, logs=None):
        exchange = getattr(self.model.optimizer, "compression_exchange", None)
        if exchange is None or not exchange.built or logs is None:
            return
        logs["bytes_per_step"] = float(exchange.bytes_sent)
        logs["compression_ratio"] = float(exchange.uncompressed_bytes / max(exchange.bytes_sent, 1e-12))
        logs["residual_norm"] = float(tf.convert_to_tensor(exchange.residual_norm()))
