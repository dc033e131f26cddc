"""Both Kerases: tf_keras (Keras 2, `tf.keras` under TF_USE_LEGACY_KERAS=1) and Keras 3.

hvd_compress wraps an optimizer of either; which one an optimizer is decides everything else
(the user's choice of Keras, not an environment variable set behind their back). The two differ
in how model.fit and a LossScaleOptimizer call the optimizer, and each wrapper class mixes in one
of the two entry points below:

- tf_keras calls `apply_gradients(grads_and_vars)`, and its LossScaleOptimizer calls the inner
  optimizer's `aggregate_gradients` before it checks for an overflow;
- Keras 3 calls `apply(grads, trainable_variables)` (apply_gradients calls it too), and its
  LossScaleOptimizer checks for an overflow with its own `check_finite`, which has no hook for the
  inner optimizer: `agree_on_overflows_in_keras3` adds one, so every rank skips an overflowed step
  together (otherwise the ranks that skip leave the others waiting in a collective).

A wrapper's core implements `_hc_agree_on_finiteness(grads)` and `_hc_step(grads_and_vars)`.
"""
import functools
import importlib
import sys

import tensorflow as tf

from hvd_compress import state


def _module(name):
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


@functools.lru_cache(maxsize=None)
def tf_keras():
    """The tf_keras package, or None."""
    return _module("tf_keras")


@functools.lru_cache(maxsize=None)
def keras3():
    """The Keras 3 package, or None."""
    keras = _module("keras")
    return keras if keras is not None and int(keras.__version__.split(".")[0]) >= 3 else None


def kerases_in_use():
    """tf_keras and Keras 3, those whose optimizers module is imported: no optimizer of a Keras
    exists before, so the type checks below need not import the other Keras (Keras 3 takes about
    1.5 s to import)."""
    return [keras() for module, keras in (("tf_keras.src.optimizers", tf_keras), ("keras.src.optimizers", keras3))
            if module in sys.modules and keras() is not None]


def keras_of(optimizer):
    """The Keras package `optimizer` belongs to (tf_keras or Keras 3), or raises TypeError."""
    for keras in kerases_in_use():
        if isinstance(optimizer, keras.optimizers.Optimizer):
            return keras
    raise TypeError(f"optimizer must be a Keras optimizer (keras.optimizers.* of Keras 3, or "
                    f"tf_keras.optimizers.* / tf.keras.optimizers.* under TF_USE_LEGACY_KERAS=1), got "
                    f"{type(optimizer).__module__}.{type(optimizer).__name__}. Legacy optimizers "
                    "(tf.keras.optimizers.legacy) are not supported.")


def is_keras3(optimizer):
    """Whether `optimizer` is a Keras 3 optimizer (TypeError, as keras_of, if it is no Keras optimizer)."""
    return keras_of(optimizer).__name__ == "keras"


def loss_scale_optimizer_classes():
    """LossScaleOptimizer of each Keras in use."""
    return tuple(keras.optimizers.LossScaleOptimizer if keras.__name__ == "keras" else
                 keras.mixed_precision.LossScaleOptimizer for keras in kerases_in_use())


def sgd_classes():
    """SGD of each Keras in use."""
    return tuple(keras.optimizers.SGD for keras in kerases_in_use())


def wrapper_class(optimizer, core):
    """A subclass of `optimizer`'s class (named alike) with the wrapper's `core` mixin after the
    entry point of the optimizer's Keras."""
    keras_of(optimizer)
    entry = TfKerasEntry
    if is_keras3(optimizer):
        agree_on_overflows_in_keras3()
        entry = Keras3Entry
    base = type(optimizer)
    return type(base.__name__, (entry, core, base), {"__module__": base.__module__})


def fused_sgd_update(optimizer, own_update, gradient, variable, learning_rate, momentum_slot):
    """SGD's update of a float32 variable by a dense float32 gradient in TensorFlow's fused kernels;
    returns False, having done nothing, where `own_update` (the wrapped class's bound update_step)
    is not Keras SGD's own (another optimizer, or a subclass of SGD that overrides it), and for
    other dtypes and sparse gradients.

    Keras's SGD.update_step, in either Keras (lr: the learning rate, mu: the momentum, m: its slot):
        m = mu m - lr g;   x = x + (mu m - lr g) (Nesterov) or x + m;   without momentum x = x - lr g
    runs every product, sum and assignment as its own TensorFlow op, a pass over the variable each
    (about 90 ms a step for the 25M MLP on one core). ResourceApplyKerasMomentum and
    ResourceApplyGradientDescent compute the same float32 products and sums, each rounded alike,
    in two passes and one: the same bits (tests/test_keras_features.py compares them with the
    unwrapped optimizer). momentum_slot() gives m, or None where the optimizer keeps none.
    """
    dense_float32 = (isinstance(gradient, tf.Tensor) and gradient.dtype == tf.float32
                     and tf.as_dtype(variable.dtype) == tf.float32)
    keras_sgd_update = getattr(own_update, "__func__", None) in {sgd.update_step for sgd in sgd_classes()}
    if not (dense_float32 and keras_sgd_update):
        return False
    learning_rate = tf.cast(learning_rate, tf.float32)
    m = momentum_slot()
    if m is None:
        tf.raw_ops.ResourceApplyGradientDescent(var=variable.handle, alpha=learning_rate, delta=gradient)
    else:
        tf.raw_ops.ResourceApplyKerasMomentum(var=variable.handle, accum=m.handle, lr=learning_rate, grad=gradient,
                                              momentum=tf.cast(optimizer.momentum, tf.float32),
                                              use_nesterov=bool(optimizer.nesterov))
    return True


class TfKerasEntry:
    """How tf_keras's model.fit and LossScaleOptimizer reach a wrapper."""

    def aggregate_gradients(self, grads_and_vars):
        """What LossScaleOptimizer calls before it checks for an overflow: every rank agrees."""
        pairs = list(grads_and_vars)
        grads = self._hc_agree_on_finiteness([g for g, _ in pairs])
        return list(zip(grads, [v for _, v in pairs]))

    def apply_gradients(self, grads_and_vars, name=None, skip_gradients_aggregation=False, **kwargs):
        """Exchanges whatever skip_gradients_aggregation says (it is about tf.distribute, and
        LossScaleOptimizer sets it)."""
        return self._hc_step(list(grads_and_vars))

    def _hc_wrapped_apply(self, grads_and_vars):
        """The wrapped optimizer's own update of these variables (it counts the step)."""
        return super().apply_gradients(grads_and_vars, skip_gradients_aggregation=True)

    def _hc_learning_rate(self):
        self._compute_current_learning_rate()
        return self.learning_rate

    def update_step(self, gradient, variable):
        """The wrapped optimizer's update of one variable: SGD's in one fused kernel where it can."""
        if not fused_sgd_update(self, super().update_step, gradient, variable, self.learning_rate,
                                lambda: self.momentums[self._index_dict[self._var_key(variable)]]):
            super().update_step(gradient, variable)


class Keras3Entry:
    """How Keras 3's model.fit (through apply_gradients) and LossScaleOptimizer reach a wrapper."""

    def apply(self, grads, trainable_variables=None):
        if trainable_variables is None:
            trainable_variables = self._trainable_variables
        return self._hc_step(list(zip(grads, trainable_variables)))

    def _hc_wrapped_apply(self, grads_and_vars):
        """The wrapped optimizer's own update of these variables (it counts the step)."""
        super().apply([g for g, _ in grads_and_vars], [v for _, v in grads_and_vars])
        return self.iterations

    def _hc_learning_rate(self):
        return self.learning_rate

    def update_step(self, gradient, variable, learning_rate):
        """The wrapped optimizer's update of one variable: SGD's in one fused kernel where it can."""
        if not fused_sgd_update(self, super().update_step, gradient, variable, learning_rate,
                                lambda: self.momentums[self._get_variable_index(variable)] if self.momentum else None):
            super().update_step(gradient, variable, learning_rate)

    def load_own_variables(self, store):
        """Loading a .keras or .weights.h5 file: the replicated state is in it, the per-rank state
        is not (rank 0 says so)."""
        super().load_own_variables(store)
        state.note_model_file("A Keras file (.keras or .weights.h5)")


@functools.lru_cache(maxsize=None)
def agree_on_overflows_in_keras3():
    """Makes Keras 3's LossScaleOptimizer.check_finite ask an hvd_compress inner optimizer, so
    that every rank takes the same skip-or-apply decision (once per process; other inner
    optimizers are not affected)."""
    cls = keras3().optimizers.LossScaleOptimizer
    local_check = cls.check_finite

    @functools.wraps(local_check)
    def check_finite(self, grads):
        agree = getattr(self.inner_optimizer, "_hc_agree_on_finiteness", None)
        return local_check(self, grads if agree is None else agree(list(grads)))

    cls.check_finite = check_finite


def require_legacy_keras():
    """Returns the tf_keras (Keras 2) module behind `tf.keras`, or raises RuntimeError.

    For programs written against tf.keras = tf_keras, as Horovod's Keras layer
    (horovod.tensorflow.keras) needs: set TF_USE_LEGACY_KERAS=1 before TensorFlow
    first uses tf.keras. hvd_compress itself takes either Keras.
    """
    keras = tf.keras
    if not keras.__name__.startswith("tf_keras"):
        raise RuntimeError(
            f"tf.keras is Keras 3 ({keras.__name__}), and this program uses tf_keras through tf.keras. "
            "Set TF_USE_LEGACY_KERAS=1 before TensorFlow first uses tf.keras (with tf_keras installed), "
            "or write the program against Keras 3 (`import keras`), which hvd_compress also supports.")
    return keras
