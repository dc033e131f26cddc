"""The worker's side of each update rule: what one rank does with its gradients before the exchange and with
the exchanged mean after it. This is the per-rank contract next to exchange.Exchange (the contract across ranks):
GradientExchange (gradient_exchange.py) lays the variables out, plans the exchanges and the state and runs the
loop; the rule, chosen once from the compressor's `update_rule` and the wrapped optimizer (`choose`), does the
arithmetic, in its own fused kernels where it has them.

A rule (WorkerRule):
- `matches(update_rule, optimizer, warmup_steps)`: whether it is the rule for this compressor under this optimizer
  (None under a tape); the rules' conditions exclude each other, so the order of RULES does not matter. A new rule
  is one class and one `@register` line;
- declares its state with scopes: `build(replicated)` creates replicated state once (optimizer variables: model
  files and broadcasts carry it), `plan(per_variable)` per-rank state for each world (in checkpoints only);
- `begin(step, learning_rate, momentum, nesterov)`, once a step: the exchange.StepInfo the exchanges read;
- `feed(slot, g, info)`: a_i, what this rank hands the exchange for one compressed variable; `feed_apart` the
  same as exchange.Unsummed(g, e) where it is g + e, for an exchange that adds them in its own kernel
  (`Exchange.adds_residual`);
- `finish(slot, update, residual, info)`: keeps this rank's new residual and returns what the optimizer gets, the
  averaged gradient or, where `applies_step`, the delta it subtracts from the variable (the wrapped optimizer's own
  apply is then not run for that variable);
- `check(...)`: refuses, at build and before any collective, settings under which it would train wrong;
- `settle(compression)`: the defaults measured best under the rule, for the compressor's arguments the
  user left out (1-bit Adam's block size and exchange).

The rules here (adam.py holds 1-bit Adam and Adam with a frozen variance):
- ErrorFeedback (Karimireddy et al. 2019): a_i = g_i + e_i, e_i = a_i - sent_i; the mean is the gradient.
- NoFeedback: a_i = g_i, nothing kept (an unbiased compressor; FetchSGD's exchange outside SGD).
- DistEFSGD (Zheng et al. 2019, dist-EF-SGD; sketched SGD): under SGD, momentum and the learning rate in front,
  m_i = mu m_i + g_i, a_i = lr p_i + s e_i (ops.momentum_error_feed), and the mean D is the delta.
- ExchangeFeedbackSGD (FetchSGD, Rothchild et al. 2020): under SGD the exchange keeps error and momentum and gets
  lr and momentum; the mean D is the delta.
Under hierarchical=True the exchange keeps the error feedback on its shard of the host's mean (the rule's residual
reads as zero, `residual_in_exchange`).
"""
import tensorflow as tf

from hvd_compress import exchange, ops
from hvd_compress.compressor import ERROR_FEEDBACK, EXCHANGE_FEEDBACK, MOMENTUM_IN_FRONT, NO_FEEDBACK
from hvd_compress.keras_compat import adam_classes, sgd_classes
from hvd_compress.state import REPLICATED, StateSpec

#: every rule class; `choose` picks the one whose `matches` holds
RULES = []


def register(rule_class):
    """Makes a WorkerRule subclass choosable."""
    RULES.append(rule_class)
    return rule_class


def is_sgd(optimizer):
    return optimizer is not None and isinstance(optimizer, sgd_classes())


def is_adam(optimizer):
    return optimizer is not None and isinstance(optimizer, adam_classes())


def choose(update_rule, optimizer, warmup_steps):
    """The one rule class for a compressor's `update_rule` under `optimizer` (None: a tape) with the warm-up the user
    asked for (`warmup_steps`, None for the default)."""
    chosen = [rule for rule in RULES if rule.matches(update_rule, optimizer, warmup_steps)]
    if len(chosen) != 1:
        raise TypeError(f"update_rule={update_rule!r} under {type(optimizer).__name__} matches {len(chosen)} worker "
                        f"rules ({[rule.__name__ for rule in chosen]}); a rule's `matches` must exclude the others'.")
    return chosen[0]


class WorkerRule:
    """The contract (see the module's docstring). The base keeps nothing and hands the gradient on."""

    #: the rule takes the step itself: `finish` returns the delta the optimizer subtracts, and the learning rate is
    #: given to `begin`
    applies_step = False
    #: (applies_step) the exchange's update is the delta as it stands, so it may stay encoded (exchange.EncodedPart,
    #: decoded straight into the variable)
    takes_encoded_update = False
    #: error feedback on what `feed` hands the exchange: a per-rank residual per compressed variable
    feeds_back = False

    def __init__(self, optimizer, variables, residual_in_exchange):
        """optimizer: the wrapped one (None under a tape); variables: the compressed variables, in slot order;
        residual_in_exchange: hierarchical=True, where the exchange keeps the error feedback."""
        self.optimizer, self.count = optimizer, len(variables)
        self.residual_in_exchange = residual_in_exchange and self.feeds_back
        self.residuals = [None] * self.count
        #: full-precision steps before compression starts (GradientExchange sets it)
        self.warmup_steps = 0

    @classmethod
    def matches(cls, update_rule, optimizer, warmup_steps):
        raise NotImplementedError

    @classmethod
    def settle(cls, compression):
        """The compression this rule trains with: the user's, with the defaults measured best under this rule for
        the arguments left out (Compressor.with_defaults)."""
        return compression

    def check(self, compression, op, warmup_steps):
        """Refuses settings under which the rule would train wrong (a ValueError naming the fix)."""
        return None  # (a body: AutoGraph cannot convert a function of a docstring alone)

    def default_warmup(self, planned_steps):
        """(steps, where they come from) where the rule chooses its warm-up under warmup_steps=None (planned_steps:
        the optimizer steps model.fit plans, None where unknown); None: no warm-up."""
        return None

    def build(self, replicated):
        """Once: creates the replicated state, replicated(StateSpec) -> variable."""
        return None  # (a body: AutoGraph cannot convert a function of a docstring alone)

    def plan(self, per_variable):
        """For each world: creates the per-rank state, per_variable(kind) -> one variable per compressed variable."""
        if self.feeds_back and not self.residual_in_exchange:
            self.residuals = per_variable("residual")

    def begin(self, step, learning_rate, momentum, nesterov):
        """Once a step, before any feed: the StepInfo of this step."""
        return exchange.StepInfo(step, nesterov=nesterov)

    def residual(self, slot, like):
        """e_i of a compressed variable: its residual, zeros where the exchange keeps the feedback, None where the
        rule keeps none."""
        if self.residual_in_exchange:
            return tf.zeros_like(like)
        return self.residuals[slot]

    def feed(self, slot, g, info):
        """a_i from the float32 gradient g: g + e_i where the rule feeds back errors, else g."""
        e = self.residual(slot, g)
        return g if e is None else g + e

    def feed_apart(self, slot, g, info):
        """feed's a_i for an exchange that `adds_residual`: a tensor, or exchange.Unsummed(x, e) for a_i = x + e
        left to the exchange's kernel. Here a_i as feed makes it."""
        return self.feed(slot, g, info)

    def finish(self, slot, update, residual, info):
        """Keeps the residual the exchange returned for this variable; returns the exchanged update."""
        kept = self.residuals[slot]
        if kept is not None:
            with tf.name_scope("hc_state_update"):
                kept.assign(tf.reshape(residual, kept.shape))
        return update

    def exchange_applied(self, slots, applied, sizes):
        """An exchange that masks momentum (sketched SGD) applied the update at the int32 positions `applied` of the
        bucket of compressed variables `slots` (sizes: their element counts)."""
        return None  # (a body: AutoGraph cannot convert a function of a docstring alone)


@register
class ErrorFeedback(WorkerRule):
    """a_i = g_i + e_i, e_i = a_i - sent_i; the wrapped optimizer applies the mean as the gradient. Also
    momentum-in-front compressors under optimizers other than SGD and Adam (the momentum stays the optimizer's)."""

    feeds_back = True

    def feed_apart(self, slot, g, info):
        """g and e_i, unsummed."""
        e = self.residual(slot, g)
        return g if e is None else exchange.Unsummed(g, e)

    @classmethod
    def matches(cls, update_rule, optimizer, warmup_steps):
        if update_rule == ERROR_FEEDBACK:
            return not (is_adam(optimizer) and warmup_steps)
        return update_rule == MOMENTUM_IN_FRONT and not is_sgd(optimizer) and not is_adam(optimizer)


@register
class NoFeedback(WorkerRule):
    """a_i = g_i, nothing kept: an unbiased compressor, or an exchange that keeps its own error and momentum
    (FetchSGD) under an optimizer other than SGD, which applies the mean."""

    @classmethod
    def matches(cls, update_rule, optimizer, warmup_steps):
        return update_rule == NO_FEEDBACK or (update_rule == EXCHANGE_FEEDBACK and not is_sgd(optimizer))


class LearningRateInside(WorkerRule):
    """Rules under SGD that put the learning rate inside the exchange: the mean is the delta to subtract, and
    residuals of learning-rate-scaled values follow the rate (`residual_scale`)."""

    applies_step = takes_encoded_update = True

    def build(self, replicated):
        #: the last step's learning rate (replicated)
        self.previous_learning_rate = replicated(StateSpec("previous_learning_rate", (), REPLICATED))

    def begin(self, step, learning_rate, momentum, nesterov):
        return exchange.StepInfo(step, learning_rate, momentum, nesterov,
                                 residual_scale=self.residual_scale(learning_rate))

    def residual_scale(self, learning_rate):
        """lr / the previous step's lr (1 at the first step), and this step's lr kept as the previous.

        The residuals hold learning-rate-scaled leftovers (a = lr p + e). dist-EF-SGD leaves them as they are when the
        rate changes, so after a drop from 0.1 to 0.001 the old-rate leftovers keep leaking into the weights for
        epochs. Here the worker residuals and the two-way server residual are multiplied by this scale, which is the
        same as keeping them in gradient units: measured on the digits CNN (docs/algorithms.md, "Residuals follow the
        learning rate"), 12-14x less movement of the compressed weights in the epoch after a drop, and final
        accuracy as good or better in 15 of 16 paired runs."""
        previous = tf.convert_to_tensor(self.previous_learning_rate)  # (a Keras 3 variable has no read_value)
        scale = tf.where(previous > 0, tf.math.divide_no_nan(learning_rate, previous), 1.0)
        with tf.control_dependencies([scale]):
            self.previous_learning_rate.assign(learning_rate)
        return scale


@register
class DistEFSGD(LearningRateInside):
    """dist-EF-SGD (Zheng, Huang, Kwok, "Communication-Efficient Distributed Blockwise Momentum SGD with
    Error-Feedback", NeurIPS 2019) and sketched SGD's worker (Ivkin et al. 2019), under SGD:
        m_i = mu m_i + g_i;  p_i = mu m_i + g_i (Nesterov) or m_i;  a_i = lr p_i + s e_i  (s = lr / last lr)
    e_i = a_i - sent_i, and the exchanged mean D is subtracted from the weights (SGD's own update is bypassed)."""

    feeds_back = True

    @classmethod
    def matches(cls, update_rule, optimizer, warmup_steps):
        return update_rule == MOMENTUM_IN_FRONT and is_sgd(optimizer)

    def plan(self, per_variable):
        super().plan(per_variable)
        self.momenta = per_variable("momentum")

    def feed(self, slot, g, info):
        m = self.momenta[slot]
        velocity, a = ops.momentum_error_feed(g, m, self.residual(slot, g), info.learning_rate, info.momentum,
                                              info.nesterov, info.residual_scale)
        with tf.name_scope("hc_state_update"):
            m.assign(velocity)
        return a

    def exchange_applied(self, slots, applied, sizes):
        """Sketched SGD: u is zeroed where the update was applied."""
        if applied is None:
            raise TypeError("The exchange masks momentum but its Exchanged says nowhere where the update was applied: "
                            "return Exchanged(..., applied=indices).")
        with tf.name_scope("hc_state_update"):
            keep = 1.0 - ops.scatter_dense(applied, tf.ones_like(applied, tf.float32), sum(sizes))
            offset = 0
            for slot, size in zip(slots, sizes):
                m = self.momenta[slot]
                m.assign(m * tf.reshape(keep[offset:offset + size], m.shape))
                offset += size


@register
class ExchangeFeedbackSGD(LearningRateInside):
    """FetchSGD (Rothchild et al., "FetchSGD: Communication-Efficient Federated Learning with Sketching", ICML
    2020) under SGD: the worker hands plain gradients; the exchange keeps error and momentum in its own state and
    gets lr and momentum; the mean D is subtracted from the weights."""

    @classmethod
    def matches(cls, update_rule, optimizer, warmup_steps):
        return update_rule == EXCHANGE_FEEDBACK and is_sgd(optimizer)

    def check(self, compression, op, warmup_steps):
        if warmup_steps:
            raise ValueError(f"{compression!r} under SGD keeps the momentum and the learning rate inside its "
                             "exchange, which a full-precision warm-up would bypass: use warmup_steps=0 with it.")
