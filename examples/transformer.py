"""The causal transformer task of examples/keras_transformer.py and benchmarks/time_to_accuracy.py: the text,
the model and AdamW as transformers are trained today (a linear warm-up into a cosine decay, decoupled weight
decay, global-norm clipping). No flags here."""
import numpy as np
import tensorflow as tf

from pydoc_text import character_codes

SEQUENCE, TRAIN_STRIDE, TEST_CHARS = 64, 32, 65_000
WIDTH, HEADS, BLOCKS, DROPOUT = 128, 4, 2, 0.1


def load_text():
    """(train inputs, train targets), (test inputs, test targets), vocabulary size: windows of SEQUENCE
    characters and the same windows one character later. The test set is the last TEST_CHARS characters
    of Python's documentation, which training never sees: each one is a sample (65,000)."""
    codes, vocab_size = character_codes()
    train, test = codes[:-TEST_CHARS], codes[-TEST_CHARS - 1:]

    def windows(part, stride):
        starts = np.arange(0, len(part) - SEQUENCE - 1, stride)
        return part[starts[:, None] + np.arange(SEQUENCE)], part[starts[:, None] + np.arange(1, SEQUENCE + 1)]

    return windows(train, TRAIN_STRIDE), windows(test, SEQUENCE), vocab_size


class PositionEmbedding(tf.keras.layers.Layer):
    """Adds a learned embedding of each position."""

    def __init__(self, length, width, **kwargs):
        super().__init__(**kwargs)
        self.length, self.width = length, width

    def build(self, input_shape):
        self.positions = self.add_weight(name="positions", shape=(self.length, self.width),
                                         initializer=tf.keras.initializers.RandomNormal(stddev=0.02))

    def call(self, x):
        return x + tf.cast(self.positions, x.dtype)

    def get_config(self):
        return {**super().get_config(), "length": self.length, "width": self.width}


def transformer(keras, vocab_size):
    """Token and position embeddings, BLOCKS pre-norm blocks of causal multi-head attention and a GELU
    feed-forward (with dropout), logits in float32 (under a mixed-precision policy too)."""
    tokens = keras.layers.Input((SEQUENCE,), dtype="int32")
    x = keras.layers.Embedding(vocab_size, WIDTH)(tokens)
    x = PositionEmbedding(SEQUENCE, WIDTH)(x)
    for _ in range(BLOCKS):
        h = keras.layers.LayerNormalization()(x)
        h = keras.layers.MultiHeadAttention(HEADS, WIDTH // HEADS, dropout=DROPOUT)(h, h, use_causal_mask=True)
        x = x + keras.layers.Dropout(DROPOUT)(h)
        h = keras.layers.LayerNormalization()(x)
        h = keras.layers.Dense(4 * WIDTH, activation="gelu")(h)
        x = x + keras.layers.Dropout(DROPOUT)(keras.layers.Dense(WIDTH)(h))
    x = keras.layers.LayerNormalization()(x)
    logits = keras.layers.Dense(vocab_size)(x)
    return keras.Model(tokens, keras.layers.Activation("linear", dtype="float32")(logits))


def adamw(keras, steps, lr=2e-3, lr_warmup=0.1, weight_decay=0.01, global_clipnorm=1.0):
    """AdamW on a linear warm-up (the first lr_warmup of the steps) into a cosine decay to 0 at `steps`."""
    warm = max(1, int(lr_warmup * steps))
    schedule = keras.optimizers.schedules.CosineDecay(0.0, steps - warm, warmup_target=lr, warmup_steps=warm)
    return keras.optimizers.AdamW(schedule, weight_decay=weight_decay, global_clipnorm=global_clipnorm)
