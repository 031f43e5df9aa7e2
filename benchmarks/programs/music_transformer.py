"""Music Transformer: decoder with relative global attention (Huang et al., "skewing"),
trained on synthetic MIDI-like event sequences, wrapped in a trainer class.

The trainer's step method stores its loss on the trainer (``self.loss_value = ...``) and
returns nothing; the loop reads ``trainer.loss_value`` afterwards (``after_step``). Under
``tf.function`` the attribute receives a symbolic tensor of the trace and is never updated
again: AutoGraph fails, or reports a stale value (Python object mutation, paper Table 3.1).
"""

import numpy as np
import tensorflow as tf

from benchmarks.programs.base import Program, keras


class RelativeGlobalAttention(keras.layers.Layer):
    def __init__(self, hidden, heads, max_len, **kwargs):
        super().__init__(**kwargs)
        self.heads, self.depth, self.max_len = heads, hidden // heads, max_len
        self.wq = keras.layers.Dense(hidden)
        self.wk = keras.layers.Dense(hidden)
        self.wv = keras.layers.Dense(hidden)
        self.out = keras.layers.Dense(hidden)

    def build(self, input_shape):
        self.E = self.add_weight(shape=(self.max_len, self.depth), name="relative_embedding",
                                 initializer="glorot_uniform")

    def split_heads(self, x):
        b, length = tf.shape(x)[0], tf.shape(x)[1]
        x = tf.reshape(x, (b, length, self.heads, self.depth))
        return tf.transpose(x, (0, 2, 1, 3))

    @staticmethod
    def skew(qe):
        """[B, H, L, L] relative logits -> absolute positions (pad, reshape, slice)."""
        length = tf.shape(qe)[-1]
        padded = tf.pad(qe, [[0, 0], [0, 0], [0, 0], [1, 0]])
        reshaped = tf.reshape(padded, (tf.shape(qe)[0], tf.shape(qe)[1], length + 1, length))
        return reshaped[:, :, 1:, :]

    def call(self, x, causal_mask):
        q, k, v = (self.split_heads(layer(x)) for layer in (self.wq, self.wk, self.wv))
        length = x.shape[1]
        e = self.E[self.max_len - length:, :]
        qe = tf.einsum("bhld,md->bhlm", q, e)
        # Zero the relative logits that refer to positions before the sequence start.
        qe = qe * tf.reverse(tf.linalg.band_part(tf.ones((length, length)), -1, 0), [1])
        logits = (tf.matmul(q, k, transpose_b=True) + self.skew(qe)) / np.sqrt(self.depth)
        logits += causal_mask * -1e9
        attention = tf.nn.softmax(logits, axis=-1)
        out = tf.transpose(tf.matmul(attention, v), (0, 2, 1, 3))
        return self.out(tf.reshape(out, (tf.shape(x)[0], length, -1)))


class DecoderLayer(keras.layers.Layer):
    def __init__(self, hidden, heads, max_len, **kwargs):
        super().__init__(**kwargs)
        self.attention = RelativeGlobalAttention(hidden, heads, max_len)
        self.ffn_1 = keras.layers.Dense(hidden * 2, activation="relu")
        self.ffn_2 = keras.layers.Dense(hidden)
        self.norm_1 = keras.layers.LayerNormalization(epsilon=1e-6)
        self.norm_2 = keras.layers.LayerNormalization(epsilon=1e-6)
        self.dropout_1 = keras.layers.Dropout(0.1)
        self.dropout_2 = keras.layers.Dropout(0.1)

    def call(self, x, causal_mask, training=False):
        x = self.norm_1(x + self.dropout_1(self.attention(x, causal_mask), training=training))
        return self.norm_2(x + self.dropout_2(self.ffn_2(self.ffn_1(x)), training=training))


class MusicDecoder(keras.Model):
    def __init__(self, vocab, hidden, layers, heads, max_len, **kwargs):
        super().__init__(**kwargs)
        self.embedding = keras.layers.Embedding(vocab, hidden)
        self.decoder_layers = [DecoderLayer(hidden, heads, max_len) for _ in range(layers)]
        self.fc = keras.layers.Dense(vocab)
        self.hidden = hidden

    def call(self, tokens, training=False):
        length = tokens.shape[1]
        causal_mask = 1.0 - tf.linalg.band_part(tf.ones((length, length)), -1, 0)
        x = self.embedding(tokens) * np.sqrt(self.hidden)
        for layer in self.decoder_layers:
            x = layer(x, causal_mask, training=training)
        return self.fc(x)


class MusicTransformer(Program):
    """The trainer: the model, its optimizer and the loss of the last step."""

    CONFIGS = {
        "quick": dict(batch=4, seq=64, vocab=390, hidden=64, layers=2, heads=4, n_batches=8),
        "large": dict(batch=8, seq=256, vocab=390, hidden=256, layers=4, heads=8, n_batches=8),
    }
    FEATURE = "trainer writes self.loss_value in its step; the loop reads it afterwards"
    AUTOGRAPH = "fails"

    def build(self):
        c = self.cfg
        self.model = MusicDecoder(c.vocab, c.hidden, c.layers, c.heads, c.seq)
        self.optimizer = keras.optimizers.Adam(1e-3, beta_2=0.98, epsilon=1e-9)
        self.loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        self.loss_value = None
        # MIDI-like events: note-on/note-off/time-shift tokens forming repeated arpeggios.
        self.data = []
        for _ in range(c.n_batches):
            seqs = np.zeros((c.batch, c.seq + 1), np.int32)
            for i in range(c.batch):
                root, step = int(self.rng.integers(40, 80)), [0, 4, 7, 12]
                for t in range(c.seq + 1):
                    pitch = root + step[(t // 3) % 4]
                    seqs[i, t] = (pitch, 128 + pitch, 256 + 10)[t % 3]
                noise = self.rng.random(c.seq + 1) < 0.05
                seqs[i, noise] = self.rng.integers(0, c.vocab, size=int(noise.sum()))
            self.data.append((tf.constant(seqs[:, :-1]), tf.constant(seqs[:, 1:])))
        self.model(self.data[0][0])

    def train_step(self, inputs, targets):
        with self.tape() as tape:
            predictions = self.model(inputs, training=True)
            self.loss_value = self.loss(targets, predictions)
        gradients = tape.gradient(self.loss_value, self.model.trainable_variables)
        self.optimizer.apply_gradients(zip(gradients, self.model.trainable_variables, strict=True))

    def after_step(self, out):
        return self.loss_value
