"""hvd_compress: communication-efficient data-parallel training for Horovod + TF/Keras.

Works with the user's Keras: Keras 3 (`import keras`), or tf_keras (Keras 2; `tf.keras` under
TF_USE_LEGACY_KERAS=1, which Horovod's own Keras layer needs). The wrapped optimizer decides.
"""
from hvd_compress.compression import Compression, Compressor
from hvd_compress.keras_compat import require_legacy_keras
from hvd_compress.gradient_exchange import GradientExchange
from hvd_compress.optimizer import DistributedGradientTape, DistributedOptimizer, load_model
from hvd_compress import accordion, advise, auto, callbacks, cost, compressor, diloco, elastic, exchange, gossip, methods, state
from hvd_compress.gossip import PushSumOptimizer
from hvd_compress.diloco import DiLoCo
from hvd_compress.callbacks import broadcast_variables
from hvd_compress.uneven import stop_together

__version__ = "0.1.0"
__all__ = ["accordion", "advise", "auto", "cost", "broadcast_variables", "Compression", "Compressor", "DiLoCo", "DistributedGradientTape",
           "DistributedOptimizer", "GradientExchange", "PushSumOptimizer", "callbacks", "compressor", "diloco", "elastic", "exchange", "gossip",
           "load_model", "methods", "require_legacy_keras", "state", "stop_together"]
