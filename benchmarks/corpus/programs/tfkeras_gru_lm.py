"""tf_keras (``TF_USE_LEGACY_KERAS=1``): the character-level language model of TensorFlow's
"Text generation with an RNN" tutorial (Embedding -> GRU(return_sequences=True,
return_state=True) -> Dense vocabulary logits) over sequences of 100 characters, trained with
the tutorial's "advanced: customized training" ``train_step``: a tape around the model call and
the compiled loss (sparse categorical cross-entropy from logits), the compiled Adam's
``apply_gradients``.

The tutorial's code but for the sizes (vocabulary 32 in place of 66, embedding 16 in place of
256, 64 GRU units in place of 1024, batch 16 in place of 64) and the data: random character ids,
each target sequence its input shifted by one (the tutorial's ``split_input_target``). Its
``train_step`` is a ``@tf.function`` method; the eager and Terra runs call it undecorated, the
function mode wraps it (``step_function``). On CPU, tf_keras' GRU runs its time steps with
``tf.while_loop``: eagerly, a Python loop of 100 iterations."""

import tensorflow as tf
import tf_keras

from benchmarks.corpus.programs import Program, optimizer_variables

VOCAB_SIZE, EMBEDDING_DIM, RNN_UNITS = 32, 16, 64
SEQ_LENGTH, BATCH_SIZE, BATCHES = 100, 16, 8


class MyModel(tf_keras.Model):
    def __init__(self, vocab_size, embedding_dim, rnn_units):
        super().__init__()
        self.embedding = tf_keras.layers.Embedding(vocab_size, embedding_dim)
        self.gru = tf_keras.layers.GRU(rnn_units, return_sequences=True, return_state=True)
        self.dense = tf_keras.layers.Dense(vocab_size)

    def call(self, inputs, states=None, return_state=False, training=False):
        x = inputs
        x = self.embedding(x, training=training)
        if states is None:
            states = self.gru.get_initial_state(x)
        x, states = self.gru(x, initial_state=states, training=training)
        x = self.dense(x, training=training)

        if return_state:
            return x, states
        else:
            return x


class CustomTraining(MyModel):
    def train_step(self, inputs):
        inputs, labels = inputs
        with tf.GradientTape() as tape:
            predictions = self(inputs, training=True)
            loss = self.loss(labels, predictions)
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))

        return {"loss": loss}


def split_input_target(sequence):
    input_text = sequence[:, :-1]
    target_text = sequence[:, 1:]
    return input_text, target_text


class GRULanguageModel(Program):
    def __init__(self, rng):
        self.model = CustomTraining(vocab_size=VOCAB_SIZE, embedding_dim=EMBEDDING_DIM,
                                    rnn_units=RNN_UNITS)
        self.model.compile(optimizer="adam",
                           loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        self.data = [split_input_target(tf.constant(
            rng.integers(0, VOCAB_SIZE, (BATCH_SIZE, SEQ_LENGTH + 1)), tf.int64))
            for _ in range(BATCHES)]

    def step(self):
        return self.model.train_step(self.next_batch())["loss"]

    def step_function(self):
        compiled = tf.function(self.model.train_step)
        return lambda: compiled(self.next_batch())["loss"]

    def variables(self):
        return [*self.model.variables, *optimizer_variables(self.model.optimizer)]


def build(rng):
    return GRULanguageModel(rng)
