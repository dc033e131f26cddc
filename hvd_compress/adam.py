"""1-bit Adam: the momentum-in-front update rule under Adam and AdamW (Tang, Gan, Awan, Rajbhandari, Li,
Lian, Liu, Zhang, He, "1-bit Adam: Communication Efficient Large-Scale Training with Adam's Convergence
Speed", ICML 2021).

Sign-compressing gradients under Adam breaks Adam: its variance estimate v is built from the
compressed gradients. 1-bit Adam keeps v out of the compression. For `warmup_steps` steps (T_w)
every rank runs plain Adam on the full-precision mean gradient; then v is frozen and the ranks
exchange Adam's momentum, compressed with error feedback. With t = the optimizer's step + 1,
m and v Adam's replicated slots, b1, b2, eps its hyperparameters:

    t <= T_w:  g = mean_i g_i (float32, summed in rank order: exchange.OrderedMean)
               m = m + (g - m)(1 - b1);   v = v + (g^2 - v)(1 - b2)   (amsgrad: v^ = max(v^, v))
               x = x - lr sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + eps)
    t >  T_w:  d = sqrt(v) + eps (v frozen);   a_i = clip((m + (g_i - m)(1 - b1)) / d, k B) + e_i
               D = the compressor's exchange of the a_i (onebit two-way: D = C(mean_i C(a_i) + e_s),
               worker and server error feedback);   m = D d
               x = x - clip(lr sqrt(1 - b2^T_w) / (1 - b1^t) * D, lr)
    with B = (1 - b1^t) / sqrt(1 - b2^T_w), k = max(1, (1 - b1) / sqrt(1 - b2)) (momentum_bound: 3.16 at the
    default betas) and clip(y, c) = min(max(y, -c), c) elementwise.

The bounds. Adam's own step is bounded: no coordinate moves much more than lr in a step (Kingma & Ba, "Adam: A Method
for Stochastic Optimization", ICLR 2015, section 2.1), because v grows with any gradient that grows. A frozen v
does not: a coordinate whose gradients grow after the warm-up (or that had none during it, v = 0, d = eps) gets
m / d without limit. On the digits CNN under AdamW with a 20-step warm-up, the dense layer's median |m| / d rose from
2 to 610 (largest 7,400) within two epochs, the residuals to norms of 2e6, and training diverged, with or without
compression. So the momentum over d that travels is clipped at k B, and the step at lr: B is where Adam's
bias-corrected ratio m_hat / sqrt(v_hat) is 1, and k B where Adam's own step reaches its largest (section 2.1's
(1 - b1) / sqrt(1 - b2) lr, for a gradient that appears after a long calm). A clip at B itself cut every coordinate
whose gradient grew after the warm-up: on the text model under AdamW (2 ranks, seed 1) 1-bit Adam ended at 0.3116
against AdamW's 0.3302, at k B (3.16 B) at 0.3198, unbounded at 0.3236 (momentum_bound). The residuals stay in the
units of m / d, of the order of k B.

What travels is the momentum divided by the frozen d, the step Adam would take: the same linear
map on every rank, so mean_i(m_i / d) = mean_i(m_i) / d, and m = D d is the paper's averaged
momentum. Compressing m itself (the paper) gives every coordinate of a block one magnitude, the
block's mean |m|, which the division by a small sqrt(v) then blows up (on the digits CNN the
largest step jumped from 0.0025 to 1.3 at the switch and training diverged); m / d has about the
same magnitude everywhere, which a sign and one scale describe well.

The variance's bias correction stays with v at the steps it averaged (T_w; `variance_steps`, replicated,
so a resume keeps it; where compression starts on an Adam that trained before without this warm-up, the
optimizer's step count then), so the step is continuous at the switch;
AdamW's decoupled weight decay, x = x - lr wd x, comes first, as Keras applies it; `lr` is the
schedule's rate of this step. The warm-up branch is Keras's Adam update written out (tf_keras's
adaptive_epsilon too); both work on the slots Keras created, so model files, broadcasts and other
world sizes carry m, v and the step; the residuals e_i (per rank) and e_s (sharded) are checkpoints'.

Adam with a frozen variance: the compressors that feed back errors on gradients (top-k, random-k, PowerSGD,
quantize) under Adam and AdamW with warmup_steps > 0 keep the first half of that rule. After the warm-up v is
frozen and m follows the exchanged mean gradient D (error feedback on gradients, a_i = g_i + e_i):

    t >  T_w:  m = m + (D - m)(1 - b1);   x = x - clip(lr sqrt(1 - b2^T_w) / (1 - b1^t) * m / d, lr)

A sparse or low-rank D is a mean whose coordinates arrive in bursts (what top-k holds back for k steps comes
at once): Adam's v would grow with the burst's square and shrink the steps of exactly those coordinates.
With v frozen at the full-precision warm-up's estimate, the bursts move m alone (measured on the transformer in
docs/algorithms.md, "Which compression under which optimizer").
"""
import math

import tensorflow as tf

import horovod.tensorflow as hvd
from hvd_compress import exchange, ops
from hvd_compress.compressor import ERROR_FEEDBACK, MOMENTUM_IN_FRONT
from hvd_compress.keras_compat import adam_slots
from hvd_compress.rules import WorkerRule, is_adam, register
from hvd_compress.state import REPLICATED, StateSpec


#: 1-bit Adam's warm-up as a fraction of a run of known length. On the transformer under AdamW (585 steps,
#: 2 ranks, 3 seeds; docs/algorithms.md, "How long to warm up"): 10% of the steps at full precision ended 0.21
#: point below AdamW with 7.2x fewer bytes over the run; 15% -0.29 (5.4x), 6% -0.37 (9.9x).
WARMUP_FRACTION = 0.1


def default_warmup_steps(optimizer, planned_steps=None):
    """1-bit Adam's warm-up under warmup_steps=None, and where it comes from: the learning-rate schedule's own
    warm-up where it has one (its `warmup_steps`, as Keras's CosineDecay has); else WARMUP_FRACTION of the run
    where its length is known (`planned_steps`: the optimizer steps model.fit plans, which hvd_compress's
    callbacks give the exchange before the first step); else 1 / (1 - beta_2), the steps Adam's variance
    averages over (1000 at beta_2 = 0.999)."""
    schedule = getattr(optimizer, "_learning_rate", None)
    if callable(schedule) and not hasattr(schedule, "assign") and getattr(schedule, "warmup_steps", None):
        return int(schedule.warmup_steps), "the learning rate's warm-up"
    if planned_steps:
        return (max(1, int(round(WARMUP_FRACTION * planned_steps))),
                f"{WARMUP_FRACTION:.0%} of the {planned_steps} steps model.fit planned")
    return int(round(1.0 / (1.0 - float(optimizer.beta_2)))), "1 / (1 - beta_2)"


def momentum_bound(beta_1, beta_2):
    """k: the largest |m / d| a 1-bit Adam worker sends, in units of B (where Adam's bias-corrected m_hat /
    sqrt(v_hat) is 1): Adam's own largest step in units of lr, (1 - b1) / sqrt(1 - b2) where that is above 1, else 1
    (Kingma & Ba 2015, section 2.1; 3.16 at b1 = 0.9, b2 = 0.999). So the frozen variance's momentum moves no
    coordinate further than Adam itself could, and no further bound cuts it."""
    return max(1.0, (1.0 - float(beta_1)) / math.sqrt(1.0 - float(beta_2)))


@register
class FrozenVarianceAdam(WorkerRule):
    """The worker's side of Adam (or AdamW) with its variance frozen after the warm-up, for the compressed
    variables of one optimizer whose compressor feeds back errors on gradients (warmup_steps > 0): it hands the
    exchange a_i = g_i + e_i and takes the step from the exchanged mean (`finish`)."""

    applies_step = feeds_back = True
    #: what travels after the warm-up is Adam's momentum over d (1-bit Adam), not the gradient
    exchanges_momentum = False

    @classmethod
    def matches(cls, update_rule, optimizer, warmup_steps):
        return update_rule == ERROR_FEEDBACK and is_adam(optimizer) and bool(warmup_steps)

    def __init__(self, optimizer, variables, residual_in_exchange):
        super().__init__(optimizer, variables, residual_in_exchange)
        self.slots = [adam_slots(optimizer, v) for v in variables]
        self.beta_1, self.beta_2 = float(optimizer.beta_1), float(optimizer.beta_2)
        self.epsilon = float(optimizer.epsilon)
        self.momentum_bound = momentum_bound(self.beta_1, self.beta_2)
        self.adaptive_epsilon = bool(getattr(optimizer, "adaptive_epsilon", False))  # tf_keras's option

    def check(self, compression, op, warmup_steps):
        if op != hvd.Average:
            raise ValueError(f"{compression!r} under Adam with warmup_steps={warmup_steps} moves Adam's momentum by "
                             "the averaged gradient and freezes its variance after the warm-up, which needs an "
                             "average: use op=hvd.Average (or warmup_steps=0).")

    def build(self, replicated):
        #: the number of steps v has averaged (0: none yet), replicated
        self.variance_steps = replicated(StateSpec("adam_variance_steps", (), REPLICATED))

    def begin(self, step, learning_rate, momentum, nesterov):
        variance_steps = self.count_variance_steps(step)
        t = tf.cast(step + 1, tf.float32)
        adam_bound = (1.0 - tf.pow(self.beta_1, t)) / tf.sqrt(1.0 - tf.pow(self.beta_2, variance_steps))  # B
        bound = self.momentum_bound * adam_bound
        return exchange.StepInfo(step, nesterov=nesterov,
                                 rule=(tf.cast(learning_rate, tf.float32), variance_steps, bound))

    def warm(self, step):
        """Whether the optimizer's step `step` (0-based) is a full-precision warm-up step."""
        return tf.cast(step, tf.int64) < self.warmup_steps

    def epsilon_now(self):
        """Adam's epsilon as it stands (tf_keras's adaptive epsilon scaled with the frozen correction)."""
        if self.adaptive_epsilon:
            return self.epsilon * tf.sqrt(1.0 - tf.pow(self.beta_2, tf.convert_to_tensor(self.variance_steps)))
        return tf.constant(self.epsilon, tf.float32)

    def velocity(self, slot):
        """v as float32 (v_hat under amsgrad): d = sqrt(v) + eps, frozen after the warm-up."""
        _, v, v_hat = self.slots[slot]
        return tf.cast(tf.convert_to_tensor(v if v_hat is None else v_hat), tf.float32)

    def count_variance_steps(self, step):
        """Once a step: the steps v has averaged, for its bias correction: t during the warm-up, then frozen
        (where compression starts with none counted, on an Adam that trained before: the steps so far)."""
        t = tf.cast(step + 1, tf.float32)
        counted = tf.convert_to_tensor(self.variance_steps)
        steps = tf.where(self.warm(step), t, tf.where(counted > 0, counted, t - 1.0))
        self.variance_steps.assign(steps)
        return steps

    def finish(self, slot, update, residual, info):
        """Keeps the residual; returns what the variable loses this step, from the exchanged mean, and updates m
        (and v during warm-up)."""
        super().finish(slot, update, residual, info)
        learning_rate, variance_steps, _ = info.rule
        m, v, v_hat = self.slots[slot]
        mean = tf.reshape(tf.cast(update, m.dtype), m.shape)
        t = tf.cast(info.number + 1, tf.float32)
        variance_correction = tf.sqrt(1.0 - tf.pow(self.beta_2, variance_steps))
        alpha = tf.cast(learning_rate * variance_correction / (1.0 - tf.pow(self.beta_1, t)), m.dtype)

        def adam():  # the warm-up: v follows the mean gradient, then the step as below, from this v
            v.assign_add((tf.square(mean) - v) * (1.0 - self.beta_2))
            if v_hat is not None:
                v_hat.assign(tf.maximum(v_hat, v))
            return self.step(slot, mean, alpha, momentum_exchanged=False, max_step=float("inf"))

        return tf.cond(self.warm(info.number), adam,
                       lambda: self.step(slot, mean, alpha, self.exchanges_momentum, max_step=learning_rate))

    def step(self, slot, mean, alpha, momentum_exchanged, max_step):
        """Adam's step with v as it stands, in one pass (ops.adam_frozen_step): where the mean is a gradient, m follows
        it and the step is alpha m / d; where it is the momentum over d (1-bit Adam), m = mean d and the step is
        alpha mean; no coordinate's step larger than max_step (inf during the warm-up, exact Adam; then lr)."""
        m = self.slots[slot][0]
        m_new, delta = ops.adam_frozen_step(tf.cast(mean, tf.float32), tf.cast(tf.convert_to_tensor(m), tf.float32),
                                            self.velocity(slot), alpha, self.beta_1, self.epsilon_now(),
                                            momentum_exchanged, max_step)
        m.assign(tf.cast(m_new, m.dtype))
        return tf.cast(delta, m.dtype)


@register
class OneBitAdam(FrozenVarianceAdam):
    """The worker's side of 1-bit Adam: Adam's momentum over d is what travels after the warm-up, and the
    warm-up follows the run (default_warmup_steps)."""

    exchanges_momentum = True

    @classmethod
    def matches(cls, update_rule, optimizer, warmup_steps):
        return update_rule == MOMENTUM_IN_FRONT and is_adam(optimizer)

    def check(self, compression, op, warmup_steps):
        if op != hvd.Average:
            raise ValueError(f"{compression!r} under Adam exchanges Adam's momentum (1-bit Adam), which needs an "
                             "average: use op=hvd.Average.")
        if not warmup_steps:
            raise ValueError(f"{compression!r} under Adam trains 1-bit Adam, which freezes Adam's variance after a "
                             "full-precision warm-up; with warmup_steps=0 it stays zero and nothing trains. Give "
                             "warmup_steps >= 1, or None for the default (the learning rate's warm-up, or 10% of the "
                             "fit).")

    @classmethod
    def settle(cls, compression):
        """A scale per 256 elements and the one-way exchange, for the arguments left out: on the transformer under
        AdamW (2 ranks, 3 seeds; docs/algorithms.md, "Which compression under which optimizer")
        onebit(block_size=256, two_way=False) ended 0.29 point below AdamW, onebit's SGD defaults (a scale per
        tensor, two-way) 0.61, and either change alone did not close the gap. On 2 ranks one-way moves the bytes
        two-way does; on more its bytes grow with the ranks (two_way=True keeps them flat). The same at every world
        size, so a checkpoint resumes at another one."""
        return compression.with_defaults(block_size=256, two_way=False)

    def default_warmup(self, planned_steps):
        return default_warmup_steps(self.optimizer, planned_steps)

    def feed(self, slot, g, info):
        """a_i: the gradient during warm-up, then this rank's momentum over d, clipped at k B, plus its residual, in one
        pass (ops.adam_momentum_feed)."""
        m, e = self.slots[slot][0], self.residual(slot, g)

        def momentum():
            return ops.adam_momentum_feed(g, tf.cast(tf.convert_to_tensor(m), tf.float32), self.velocity(slot), e,
                                          self.beta_1, self.epsilon_now(), bound=info.rule[2])

        return tf.cond(self.warm(info.number), lambda: tf.identity(g), momentum)
