"""Small BERT encoder fine-tuned for extractive question answering (SQuAD-style span heads).

Start and end logits over the context tokens, cross-entropy on both; AdamW. A static model
with masks and dropout; AutoGraph handles it.
"""

import numpy as np
import tensorflow as tf

from benchmarks.programs._bert import BERT_CONFIGS, BertEncoder, synthetic_text, to_tensors
from benchmarks.programs.base import Program, keras


class BertQA(Program):
    CONFIGS = {k: dict(v, n_batches=8) for k, v in BERT_CONFIGS.items()}
    FEATURE = "Transformer encoder, two span heads"

    def build(self):
        c = self.cfg
        self.encoder = BertEncoder(c.vocab, c.seq, c.hidden, c.layers, c.heads, c.ffn)
        self.span_head = keras.layers.Dense(2)
        self.optimizer = keras.optimizers.AdamW(3e-4, weight_decay=0.01)
        self.loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        self.data = []
        for _ in range(c.n_batches):
            ids, segments, mask, q_lens, lengths = synthetic_text(self.rng, c.batch, c.seq, c.vocab)
            # The answer span is where a marker token sits in the context.
            starts = np.array([self.rng.integers(q + 2, n - 2)
                               for q, n in zip(q_lens, lengths, strict=True)])
            ends = np.minimum(starts + self.rng.integers(0, 4, size=c.batch), lengths - 2)
            ids[np.arange(c.batch), starts] = 3
            self.data.append(to_tensors(ids, segments, mask, starts.astype(np.int32),
                                        ends.astype(np.int32)))
        self.encoder(*self.data[0][:3])  # build the weights before the first step
        self.span_head.build((None, None, c.hidden))
        self.trainable_variables = (self.encoder.trainable_variables
                                    + self.span_head.trainable_variables)

    def train_step(self, input_ids, segment_ids, input_mask, start_positions, end_positions):
        with self.tape() as tape:
            sequence = self.encoder(input_ids, segment_ids, input_mask, training=True)
            logits = self.span_head(sequence)
            start_logits, end_logits = tf.unstack(logits, axis=-1)
            # Padding can never be the answer.
            pad = (1.0 - tf.cast(input_mask, tf.float32)) * -10000.0
            start_loss = self.loss_fn(start_positions, start_logits + pad)
            end_loss = self.loss_fn(end_positions, end_logits + pad)
            loss = (start_loss + end_loss) / 2.0
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables, strict=True))
        return loss
