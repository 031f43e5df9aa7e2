"""Small GPT-2-style decoder trained as a language model on variable-length sequences.

Sequences have random lengths; a ``tf.data`` pipeline buckets them by length and pads each
batch to its bucket boundary (``bucket_by_sequence_length``), so the sequence length changes
from batch to batch. AutoGraph runs it but retraces once per distinct shape; XLA compiles once
per shape.
"""

import numpy as np
import tensorflow as tf

from benchmarks.programs.base import Program, keras


class Block(keras.layers.Layer):
    """Pre-LN decoder block: causal self-attention and a GELU MLP."""

    def __init__(self, hidden, heads, **kwargs):
        super().__init__(**kwargs)
        self.ln_1 = keras.layers.LayerNormalization(epsilon=1e-5)
        self.attn = keras.layers.MultiHeadAttention(heads, hidden // heads, dropout=0.1)
        self.ln_2 = keras.layers.LayerNormalization(epsilon=1e-5)
        self.mlp_fc = keras.layers.Dense(4 * hidden, activation="gelu")
        self.mlp_proj = keras.layers.Dense(hidden)
        self.dropout = keras.layers.Dropout(0.1)

    def call(self, x, padding_mask, training=False):
        h = self.ln_1(x)
        x = x + self.attn(h, h, attention_mask=padding_mask, use_causal_mask=True,
                          training=training)
        return x + self.dropout(self.mlp_proj(self.mlp_fc(self.ln_2(x))), training=training)


class Decoder(keras.Model):
    def __init__(self, vocab, max_len, hidden, layers, heads, **kwargs):
        super().__init__(**kwargs)
        self.wte = keras.layers.Embedding(vocab, hidden)
        self.wpe = keras.layers.Embedding(max_len, hidden)
        self.blocks = [Block(hidden, heads) for _ in range(layers)]
        self.ln_f = keras.layers.LayerNormalization(epsilon=1e-5)
        self.lm_head = keras.layers.Dense(vocab, use_bias=False)

    def call(self, tokens, training=False):
        positions = tf.range(tf.shape(tokens)[1])
        x = self.wte(tokens) + self.wpe(positions)
        padding_mask = tf.not_equal(tokens, 0)[:, None, :]
        for block in self.blocks:
            x = block(x, padding_mask, training=training)
        return self.lm_head(self.ln_f(x))


class GPT2(Program):
    CONFIGS = {
        "quick": dict(batch=8, buckets=(16, 32, 48, 64), vocab=1000, hidden=64, layers=2,
                      heads=4, n_sequences=256),
        "large": dict(batch=16, buckets=(64, 128, 192, 256), vocab=8000, hidden=256, layers=4,
                      heads=8, n_sequences=512),
    }
    FEATURE = "sequence length varies per batch (bucketed, padded)"

    def build(self):
        c = self.cfg
        max_len = c.buckets[-1]
        self.model = Decoder(c.vocab, max_len + 1, c.hidden, c.layers, c.heads)
        self.optimizer = keras.optimizers.Adam(3e-4)
        self.loss_fn = keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction="none")
        # Token 0 is padding. Each sequence follows a noisy affine recurrence, so it is learnable.
        sequences = []
        for _ in range(c.n_sequences):
            n = int(self.rng.integers(4, max_len + 2))
            a, b = self.rng.integers(1, 7, size=2)
            seq = [int(self.rng.integers(1, c.vocab))]
            for _ in range(n - 1):
                nxt = (seq[-1] * a + b) % (c.vocab - 1) + 1
                if self.rng.random() < 0.1:
                    nxt = self.rng.integers(1, c.vocab)
                seq.append(int(nxt))
            sequences.append(np.array(seq, np.int32))
        lengths = np.array([len(s) for s in sequences], np.int32)
        padded = np.zeros((len(sequences), lengths.max()), np.int32)
        for row, seq in zip(padded, sequences, strict=True):
            row[:len(seq)] = seq
        dataset = tf.data.Dataset.from_tensor_slices((padded, lengths)).map(lambda s, n: s[:n])
        # A bucket pads to its boundary - 1 = model-input length + 1 (inputs, targets shifted).
        self.dataset = dataset.bucket_by_sequence_length(
            lambda s: tf.shape(s)[0], bucket_boundaries=[b + 2 for b in c.buckets],
            bucket_batch_sizes=[c.batch] * (len(c.buckets) + 1), pad_to_bucket_boundary=True,
            drop_remainder=True).map(lambda s: (s[:, :-1], s[:, 1:])).repeat()
        self._iterator = iter(self.dataset)

    def batches(self, steps):
        for _ in range(steps):
            yield next(self._iterator)

    def train_step(self, inputs, targets):
        with self.tape() as tape:
            logits = self.model(inputs, training=True)
            mask = tf.cast(tf.not_equal(targets, 0), tf.float32)
            per_token = self.loss_fn(targets, logits)
            loss = tf.reduce_sum(per_token * mask) / tf.reduce_sum(mask)
        grads = tape.gradient(loss, self.model.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.model.trainable_variables, strict=True))
        return loss
