"""A small BERT encoder (token + position + segment embeddings, post-LN Transformer layers),
shared by ``bert_qa`` and ``bert_cls`` the way both original programs share one encoder."""

import numpy as np
import tensorflow as tf

from benchmarks.programs.base import keras

BERT_CONFIGS = {
    "quick": dict(batch=8, seq=64, vocab=2000, hidden=64, layers=2, heads=4, ffn=128),
    "large": dict(batch=16, seq=128, vocab=8000, hidden=256, layers=4, heads=4, ffn=1024),
}


class TransformerLayer(keras.layers.Layer):
    def __init__(self, hidden, heads, ffn, dropout=0.1, **kwargs):
        super().__init__(**kwargs)
        self.attention = keras.layers.MultiHeadAttention(heads, hidden // heads, dropout=dropout)
        self.attention_norm = keras.layers.LayerNormalization(epsilon=1e-12)
        self.intermediate = keras.layers.Dense(ffn, activation="gelu")
        self.output_dense = keras.layers.Dense(hidden)
        self.output_norm = keras.layers.LayerNormalization(epsilon=1e-12)
        self.dropout = keras.layers.Dropout(dropout)

    def call(self, x, attention_mask, training=False):
        attended = self.attention(x, x, attention_mask=attention_mask, training=training)
        x = self.attention_norm(x + self.dropout(attended, training=training))
        h = self.output_dense(self.intermediate(x))
        return self.output_norm(x + self.dropout(h, training=training))


class BertEncoder(keras.Model):
    def __init__(self, vocab, seq, hidden, layers, heads, ffn, **kwargs):
        super().__init__(**kwargs)
        self.token_embedding = keras.layers.Embedding(vocab, hidden)
        self.position_embedding = keras.layers.Embedding(seq, hidden)
        self.segment_embedding = keras.layers.Embedding(2, hidden)
        self.embedding_norm = keras.layers.LayerNormalization(epsilon=1e-12)
        self.embedding_dropout = keras.layers.Dropout(0.1)
        self.encoder_layers = [TransformerLayer(hidden, heads, ffn) for _ in range(layers)]

    def call(self, input_ids, segment_ids, input_mask, training=False):
        positions = tf.range(tf.shape(input_ids)[1])
        x = (self.token_embedding(input_ids) + self.position_embedding(positions)
             + self.segment_embedding(segment_ids))
        x = self.embedding_dropout(self.embedding_norm(x), training=training)
        mask = tf.cast(input_mask[:, None, :], tf.bool)  # [B, 1, L]: attend to real tokens
        for layer in self.encoder_layers:
            x = layer(x, attention_mask=mask, training=training)
        return x


def synthetic_text(rng: np.random.Generator, batch: int, seq: int, vocab: int):
    """Question/context pairs: [CLS] q [SEP] c [SEP] pad..., with per-example lengths."""
    ids = np.zeros((batch, seq), np.int32)
    segments = np.zeros((batch, seq), np.int32)
    mask = np.zeros((batch, seq), np.int32)
    q_lens = rng.integers(4, seq // 4, size=batch)
    lengths = rng.integers(seq // 2, seq + 1, size=batch)
    for i in range(batch):
        n, q = lengths[i], q_lens[i]
        ids[i, :n] = rng.integers(3, vocab, size=n)
        ids[i, 0], ids[i, q + 1], ids[i, n - 1] = 1, 2, 2  # [CLS], [SEP], [SEP]
        segments[i, q + 2:n] = 1
        mask[i, :n] = 1
    return ids, segments, mask, q_lens, lengths


def to_tensors(*arrays):
    return tuple(tf.constant(a) for a in arrays)
