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

A wrapper's core implements `_hc_agree_on_finiteness(grads)`, `_hc_step(grads_and_vars)` and
`hc_process_set`. Each entry point runs the first collective of a step inside `_hc_first_in_step`.
"""
import contextlib
import functools
import importlib
import sys
import threading

import tensorflow as tf

from hvd_compress import state, uneven


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


def adam_classes():
    """Adam and AdamW of each Keras in use (tf_keras's AdamW is not a subclass of its Adam)."""
    return tuple(cls for keras in kerases_in_use() for cls in (keras.optimizers.Adam, keras.optimizers.AdamW))


def adam_slots(optimizer, variable):
    """(m, v, v_hat or None): the slots an Adam built for `variable`, in either Keras."""
    index = (optimizer._get_variable_index(variable) if hasattr(optimizer, "_get_variable_index")
             else optimizer._index_dict[optimizer._var_key(variable)])
    v_hat = optimizer._velocity_hats[index] if optimizer.amsgrad else None
    return optimizer._momentums[index], optimizer._velocities[index], v_hat


#: (class of the user's optimizer, wrapper core) -> the wrapper class made for it once
_WRAPPER_CLASSES = {}


def wrap_in_place(optimizer, core):
    """Makes the user's optimizer instance itself the wrapper: its class becomes a subclass of its
    own class (named as the core, e.g. DistributedOptimizer) with the wrapper's `core` mixin after
    the entry point of its Keras. Nothing is rebuilt, so everything the instance holds is kept: settings outside get_config
    (AdamW's exclude_from_weight_decay, a subclass's own attributes), callables and unregistered
    schedules, an optimizer that already trained (its step count and slots). Returns it.

    Model files save it under the core's registered name "hvd_compress>{core.saved_name}", with
    a config that records the wrapped optimizer and the wrapper's settings (`WrapperCore`), so
    keras.models.load_model in either Keras gives the wrapper back."""
    keras = keras_of(optimizer)
    refuse_wrapped(optimizer)
    base = type(optimizer)
    if (base, core) not in _WRAPPER_CLASSES:
        entry = Keras3Entry if keras.__name__ == "keras" else TfKerasEntry
        # Named as the core (tf_keras's h5 and SavedModel loaders find a LossScaleOptimizer's inner
        # optimizer by class name alone); isinstance(optimizer, its own class) still holds.
        cls = type(core.saved_name, (entry, core, base), {"__module__": "hvd_compress", "_hc_base": base,
                                                          "_hc_keras": keras})
        saved_names(keras)[cls] = core.registered_name()
        _WRAPPER_CLASSES[base, core] = cls
    if keras.__name__ == "keras":
        agree_on_overflows_in_keras3()
    register_loaders()
    optimizer.__class__ = _WRAPPER_CLASSES[base, core]
    return optimizer


def refuse_wrapped(optimizer):
    """An optimizer is wrapped once: by hvd_compress or by Horovod."""
    if isinstance(optimizer, WrapperCore):
        raise ValueError(f"This {optimizer._hc_base.__name__} is already wrapped by hvd_compress."
                         f"{optimizer.saved_name}; wrap the plain optimizer once.")
    if hasattr(optimizer, "_allreduce_grads"):
        raise ValueError(f"This {type(optimizer).__name__} is already Horovod's DistributedOptimizer; give "
                         "hvd_compress the plain Keras optimizer instead (it replaces Horovod's wrapper).")


def is_distributed(optimizer):
    """Whether the optimizer (inside any LossScaleOptimizer) exchanges gradients: hvd_compress's
    wrappers and Horovod's DistributedOptimizer."""
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    return isinstance(inner, WrapperCore) or hasattr(inner, "_allreduce_grads")


def saved_names(keras):
    """Keras's (either's) map of classes to the names it saves them under (what
    register_keras_serializable fills; every wrapper class of a core shares its core's name, which
    tf_keras's decorator refuses)."""
    registration = sys.modules[f"{keras.__name__}.src.saving.object_registration"]
    return registration.GLOBAL_CUSTOM_NAMES if keras.__name__ == "keras" else registration._GLOBAL_CUSTOM_NAMES


#: the wrapper cores whose saved names every imported Keras loads (register_loaders)
_CORES = []


def register_loader(core):
    """Makes every imported Keras load the name `core` saves under with core.from_config (now, and
    again where hvd_compress meets a Keras imported after it)."""
    _CORES.append(core)
    register_loaders()


def register_loaders():
    """Each core's loader in each imported Keras (at hvd_compress's import, when an optimizer is
    wrapped and in hvd_compress.load_model: a file may be loaded before any optimizer is wrapped).
    A Keras that is not imported yet is not imported here: Keras 3 takes 1.5 s to import."""
    for module, keras in (("tf_keras", tf_keras), ("keras", keras3)):
        if module not in sys.modules or keras() is None:
            continue
        for core in _CORES:
            loader = type(core.saved_name, (core,), {"__module__": "hvd_compress", "_hc_keras": keras()})
            # tf_keras's legacy loaders look a LossScaleOptimizer's inner optimizer up by class name.
            keras().saving.get_custom_objects().update({core.registered_name(): loader, core.saved_name: loader})


def saved_process_set(process_set):
    """What a model file records of a wrapper's process set: None for the global one, else its ranks."""
    import horovod.tensorflow as hvd
    return None if process_set == hvd.global_process_set else list(process_set.ranks)


def refuse_saved_process_set(ranks, wrapper):
    """A process set other than the global one cannot be recreated from a file."""
    raise ValueError(f"This {wrapper} was saved with a process set of ranks {ranks}, which a model file cannot "
                     f"recreate: load it with hvd_compress.load_model(path, optimizer_wrapper=lambda optimizer: "
                     f"hvd_compress.{wrapper}(optimizer, ..., process_set=...)) with a process set of those ranks.")


#: Set by hvd_compress.load_model while it loads: (inner optimizer, saved factory, saved settings) -> wrapper.
_loading = threading.local()


@contextlib.contextmanager
def rewrapping(rewrap):
    """While a model file loads, wrappers found in it are made by `rewrap(inner, factory, settings)`
    instead of factory(inner, **settings) (hvd_compress.load_model's own settings)."""
    previous, _loading.rewrap = getattr(_loading, "rewrap", None), rewrap
    try:
        yield
    finally:
        _loading.rewrap = previous


#: in a wrapper's saved config, for whoever loads the file without hvd_compress
LOADING = ("this optimizer is hvd_compress's: `import hvd_compress` and hvd.init() before loading the file to train "
           "on, or load it with compile=False for inference")


class WrapperCore:
    """What an hvd_compress wrapper core shares: its config records the wrapped optimizer (as that
    optimizer's own Keras would save it, under its registered name) and the wrapper's settings;
    from_config deserializes the first and wraps it with the second.

    A core sets `saved_name` and `factory` (the public function that wraps an optimizer) and
    implements `_hc_settings()` (keyword arguments of `factory`, JSON-serializable)."""

    saved_name = None
    factory = None
    #: set when a step of the wrapper is traced (or run): a model traced before the wrap runs without it
    _hc_stepped = False
    #: the ranks hold different models between steps (SGP, DiLoCo): callbacks.Consensus averages them
    ranks_diverge = False

    def hc_plan_fit(self, end_step):
        """Before the first step of a model.fit that ends at optimizer step `end_step` (None: unknown);
        hvd_compress's callbacks call it."""
        return None

    @property
    def bytes_per_step(self):
        """Bytes one rank sends per step, by the wrapper's own accounting (local steps: averaged over a sync
        period); known once the first step planned the exchange."""
        raise NotImplementedError

    def _hc_first_in_step(self, grads, overflow_check=False):
        """The context of a step's first collective, after its gradients `grads`: its StopTogether's
        agreement (once a step). A LossScaleOptimizer's overflow check comes first where it runs; the step
        it then takes has none."""
        if overflow_check:
            object.__setattr__(self, "_hc_overflow_checked", True)
        elif self.__dict__.get("_hc_overflow_checked"):
            object.__setattr__(self, "_hc_overflow_checked", False)
            return contextlib.nullcontext()
        return uneven.for_process_set(self.hc_process_set).first_in_step(grads)

    @classmethod
    def registered_name(cls):
        return f"hvd_compress>{cls.saved_name}"

    def get_config(self):
        keras = self._hc_keras
        # The wrapped optimizer as its own Keras serializes it: a stand-in of its own class that shares
        # this instance's attributes (another object: Keras's savers key shared objects by identity).
        unwrapped = object.__new__(self._hc_base)
        unwrapped.__dict__.update(self.__dict__)
        inner = (keras.optimizers.serialize(unwrapped) if keras.__name__ == "keras" else
                 keras.optimizers.serialize(unwrapped, use_legacy_format=False))
        # tf_keras reads is_legacy_optimizer to choose its optimizer classes. Keras 3's error for a class it cannot
        # find (a file loaded where hvd_compress is not imported) quotes the config: LOADING says what to do.
        return {"optimizer": inner, **self._hc_settings(), "is_legacy_optimizer": False, "to_load": LOADING}

    @classmethod
    def from_config(cls, config, custom_objects=None):
        import horovod.tensorflow as hvd
        if not hvd.is_initialized():
            raise ValueError(f"This model's optimizer is an hvd_compress.{cls.saved_name}: call hvd.init() "
                             "before loading it to train on, or load it with compile=False for inference.")
        settings = dict(config)
        settings.pop("is_legacy_optimizer", None)
        settings.pop("to_load", None)
        inner_config = settings.pop("optimizer")
        keras = cls._hc_keras
        # Each Keras's optimizers.deserialize knows only some of its optimizers (Keras 3's not Lamb, tf_keras's
        # not Adafactor): Keras 3's general deserializer, and tf_keras's with every optimizer class it has.
        if keras.__name__ == "keras":
            inner = keras.saving.deserialize_keras_object(inner_config, custom_objects=custom_objects)
        else:  # (its legacy loaders look the class up by class_name: a registered class by its registered name)
            if isinstance(inner_config, dict) and inner_config.get("registered_name"):
                inner_config = dict(inner_config, class_name=inner_config["registered_name"])
            known = {name: klass for name, klass in vars(keras.optimizers).items()
                     if isinstance(klass, type) and issubclass(klass, keras.optimizers.Optimizer)}
            inner = keras.optimizers.deserialize(inner_config, custom_objects={**known, **(custom_objects or {})},
                                                 use_legacy_optimizer=False)
        rewrap = getattr(_loading, "rewrap", None)
        factory = cls.factory
        return rewrap(inner, factory, settings) if rewrap else factory(inner, **settings)


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
        grads = [g for g, _ in pairs]
        with self._hc_first_in_step(grads, overflow_check=True):
            grads = self._hc_agree_on_finiteness(grads)
        return list(zip(grads, [v for _, v in pairs]))

    def apply_gradients(self, grads_and_vars, name=None, skip_gradients_aggregation=False, **kwargs):
        """Exchanges whatever skip_gradients_aggregation says (it is about tf.distribute, and
        LossScaleOptimizer sets it)."""
        pairs = list(grads_and_vars)
        with self._hc_first_in_step([g for g, _ in pairs]):
            return self._hc_step(pairs)

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
        pairs = list(zip(grads, trainable_variables))
        with self._hc_first_in_step([g for g, _ in pairs]):
            return self._hc_step(pairs)

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
        restored = len(store.keys()) == len(self.variables)  # else Keras skips them, with a warning
        super().load_own_variables(store)
        state.note_model_file("A Keras file (.keras or .weights.h5)", optimizer_restored=restored)


@functools.lru_cache(maxsize=None)
def agree_on_overflows_in_keras3():
    """Makes Keras 3's LossScaleOptimizer.check_finite ask an hvd_compress inner optimizer, so
    that every rank takes the same skip-or-apply decision (once per process; other inner
    optimizers are not affected)."""
    cls = keras3().optimizers.LossScaleOptimizer
    local_check = cls.check_finite

    @functools.wraps(local_check)
    def check_finite(self, grads):
        inner = self.inner_optimizer
        if not isinstance(inner, WrapperCore):
            return local_check(self, grads)
        grads = list(grads)
        with inner._hc_first_in_step(grads, overflow_check=True):
            return local_check(self, inner._hc_agree_on_finiteness(grads))

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
