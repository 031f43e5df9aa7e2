"""Small BERT sentence classifier whose step computes an F1 score with scikit-learn.

Inside the tape, the step pulls labels and predictions to the host with ``.numpy()`` and calls
``sklearn.metrics.f1_score`` on them (the original logs its target metric this way). AutoGraph
cannot convert this: a symbolic tensor has no value during tracing (third-party library call,
paper Table 3.1).
"""

import numpy as np
import tensorflow as tf
from sklearn.metrics import f1_score

from benchmarks.programs._bert import BERT_CONFIGS, BertEncoder, synthetic_text, to_tensors
from benchmarks.programs.base import Program, keras


class BertCls(Program):
    CONFIGS = {k: dict(v, classes=3, n_batches=8) for k, v in BERT_CONFIGS.items()}
    FEATURE = "scikit-learn f1_score on .numpy() values inside the tape"
    AUTOGRAPH = "fails"

    def build(self):
        c = self.cfg
        self.encoder = BertEncoder(c.vocab, c.seq, c.hidden, c.layers, c.heads, c.ffn)
        self.pooler = keras.layers.Dense(c.hidden, activation="tanh")
        self.classifier = keras.layers.Dense(c.classes)
        self.optimizer = keras.optimizers.Adam(3e-4)
        self.loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        self.f1_history = []
        self.data = []
        for _ in range(c.n_batches):
            ids, segments, mask, _, _ = synthetic_text(self.rng, c.batch, c.seq, c.vocab)
            labels = (ids[:, 1:8].sum(axis=1) % c.classes).astype(np.int32)
            self.data.append(to_tensors(ids, segments, mask, labels))
        self.encoder(*self.data[0][:3])
        self.pooler.build((None, c.hidden))
        self.classifier.build((None, c.hidden))
        self.trainable_variables = (self.encoder.trainable_variables
                                    + self.pooler.trainable_variables
                                    + self.classifier.trainable_variables)

    def train_step(self, input_ids, segment_ids, input_mask, labels):
        with self.tape() as tape:
            sequence = self.encoder(input_ids, segment_ids, input_mask, training=True)
            logits = self.classifier(self.pooler(sequence[:, 0]))
            loss = self.loss_fn(labels, logits)
            predictions = tf.argmax(logits, axis=-1)
            f1 = f1_score(labels.numpy(), predictions.numpy(), average="macro", zero_division=0)
            self.f1_history.append(f1)
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables, strict=True))
        return loss
