"""1-bit Adam: the momentum-in-front update rule under Adam and AdamW (Tang, Gan, Awan, Rajbhandari, Li,
Lian, Liu, Zhang, He, "1-bit Adam: Communication Efficient Large-Scale Training with Adam's Convergence
Speed", ICML 2021).

Sign-compressing gradients under Adam breaks Adam: its variance estimate v is built from the
compressed gradients. 1-bit Adam keeps v out of the compression. For `warmup_steps` steps (T_w)
every rank runs plain Adam on the full-precision mean gradient; then v is frozen and the ranks
exchange Adam's momentum, compressed with error feedback. With t = the optimizer's step + 1,
m and v Adam's replicated slots, b1, b2, eps its hyperparameters:

    t <= T_w:  g = mean_i g_i (float32 allreduce)
               m = m + (g - m)(1 - b1);   v = v + (g^2 - v)(1 - b2)   (amsgrad: v^ = max(v^, v))
               x = x - lr sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + eps)
    t >  T_w:  a_i = m + ((g_i - m)(1 - b1) + e_i);   D = the compressor's exchange of
               the a_i (onebit two-way: D = C(mean_i C(a_i) + e_s), worker and server error feedback)
               m = D;   v frozen
               x = x - lr sqrt(1 - b2^T_w) / (1 - b1^t) * m / (sqrt(v) + eps)

The variance's bias correction stays at T_w with v, so the step is continuous at the switch;
AdamW's decoupled weight decay, x = x - lr wd x, comes first, as Keras applies it; `lr` is the
schedule's rate of this step. Both branches are Keras's Adam update written out (tf_keras's
adaptive_epsilon too), on the slots Keras created, so model files, broadcasts and other world
sizes carry m, v and the step; the residuals e_i (per rank) and e_s (sharded) are checkpoints'.
"""
import tensorflow as tf

from hvd_compress.keras_compat import adam_slots


def default_warmup_steps(optimizer):
    """1 / (1 - beta_2): the number of steps Adam's variance averages over (1000 at beta_2 = 0.999)."""
    return int(round(1.0 / (1.0 - float(optimizer.beta_2))))


class AdamMomentumInFront:
    """The worker's side of 1-bit Adam for the compressed variables of one Adam (or AdamW): what it
    hands the exchange (`error_fed`) and the step it takes from the exchanged mean (`delta`)."""

    def __init__(self, optimizer, variables, warmup_steps):
        self.slots = [adam_slots(optimizer, v) for v in variables]
        self.beta_1, self.beta_2 = float(optimizer.beta_1), float(optimizer.beta_2)
        self.epsilon = float(optimizer.epsilon)
        self.adaptive_epsilon = bool(getattr(optimizer, "adaptive_epsilon", False))  # tf_keras's option
        self.warmup_steps = warmup_steps

    def warm(self, step):
        """Whether the optimizer's step `step` (0-based) is a full-precision warm-up step."""
        return tf.cast(step, tf.int64) < self.warmup_steps

    def error_fed(self, slot, g, e, step):
        """a_i: the gradient during warm-up, then this rank's momentum plus its residual."""
        m = self.slots[slot][0]

        def momentum():
            m_ = tf.cast(m, tf.float32)
            return m_ + ((g - m_) * (1.0 - self.beta_1) + e)  # (the order TensorFlow's graph optimizer keeps)

        return tf.cond(self.warm(step), lambda: tf.identity(g), momentum)

    def delta(self, slot, mean, step, learning_rate):
        """What the variable loses this step, from the exchanged mean (the gradient during warm-up, then
        the momentum); updates m (and v during warm-up)."""
        m, v, v_hat = self.slots[slot]
        mean = tf.reshape(tf.cast(mean, m.dtype), m.shape)

        def adam_moments():
            m.assign_add((mean - m) * (1.0 - self.beta_1))
            v.assign_add((tf.square(mean) - v) * (1.0 - self.beta_2))
            if v_hat is not None:
                v_hat.assign(tf.maximum(v_hat, v))
            return tf.cast(step + 1, tf.float32)

        def frozen_variance():
            m.assign(mean)
            return tf.constant(float(self.warmup_steps))

        variance_step = tf.cond(self.warm(step), adam_moments, frozen_variance)
        t = tf.cast(step + 1, tf.float32)
        with tf.control_dependencies([variance_step]):
            variance_correction = tf.sqrt(1.0 - tf.pow(self.beta_2, variance_step))
            alpha = tf.cast(learning_rate, tf.float32) * variance_correction / (1.0 - tf.pow(self.beta_1, t))
            epsilon = self.epsilon * variance_correction if self.adaptive_epsilon else self.epsilon
            velocity = tf.convert_to_tensor(v if v_hat is None else v_hat)
            return (tf.convert_to_tensor(m) * tf.cast(alpha, m.dtype)) / (tf.sqrt(velocity) + epsilon)
