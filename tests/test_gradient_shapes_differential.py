"""Gradient results whose shapes vary: an ``Embedding``'s sparse gradient is as long as the
batch's sequence. Python skips the backward pass, so it once fetched such a result at every
``tape.gradient`` only to know its shape; now the shapes are learned by the iteration's
signature (``terra/tape_events.py``) and stood in for after two calls agreed. The programs
must give eager's numbers (losses, gradients, every variable) and, where the step never reads
the gradient's shape, fetch only while learning."""

import numpy as np
import pytest
import tensorflow as tf
from differential import assert_same_as_eager

from terra import python_runner

LENGTHS = (5, 7, 9)  # the sequence length of step i: LENGTHS[i % 3]
STEPS = 36
BATCH = 4


@pytest.fixture
def result_fetches(monkeypatch):
    """The gradient results the Terra run fetched (values of backward steps Python waited
    for at a ``tape.gradient``), as a one-item list."""
    count = [0]
    original = python_runner.PythonRunner._fetched

    def counted(self, e):
        count[0] += e.step.node.in_body
        return original(self, e)

    monkeypatch.setattr(python_runner.PythonRunner, "_fetched", counted)
    return count


def embedding_program(keep_gradients):
    """Token and position embeddings, a Dense head, Adam; the batch's sequence length
    cycles through ``LENGTHS``. ``keep_gradients``: the step keeps the embeddings' sparse
    gradients (their values, read after the loop)."""

    def program(tape_cls, steps):
        tf.keras.utils.set_random_seed(0)
        vocab, hidden = 20, 8
        wte = tf.keras.layers.Embedding(vocab, hidden)
        wpe = tf.keras.layers.Embedding(max(LENGTHS), hidden)
        head = tf.keras.layers.Dense(vocab)
        optimizer = tf.keras.optimizers.Adam(1e-2)
        rng = np.random.default_rng(1)
        batches = [rng.integers(0, vocab, (BATCH, n + 1)).astype(np.int32)
                   for n in LENGTHS for _ in range(2)]
        batches = [(tf.constant(b[:, :-1]), tf.constant(b[:, 1:])) for b in batches]
        losses, grads = [], []
        for step in range(steps):
            inputs, targets = batches[(step % len(LENGTHS)) * 2 + step // len(LENGTHS) % 2]
            with tape_cls() as tape:
                x = wte(inputs) + wpe(tf.range(tf.shape(inputs)[1]))
                logits = head(x)
                loss = tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(
                    targets, logits, from_logits=True))
            variables = wte.trainable_variables + wpe.trainable_variables + \
                head.trainable_variables
            g = tape.gradient(loss, variables)
            optimizer.apply_gradients(zip(g, variables))
            losses.append(loss)
            if keep_gradients:
                grads.append([g[0].values, g[0].indices, g[1].values, g[1].indices, g[2]])
        return {"losses": losses, "grads": grads,
                "variables": wte.weights + wpe.weights + head.weights + optimizer.variables}

    return program


@pytest.mark.parametrize("keep_gradients", [False, True])
def test_embedding_gradients_as_long_as_the_sequence(keep_gradients, result_fetches):
    outcome = assert_same_as_eager(embedding_program(keep_gradients), STEPS,
                                   exact=("losses", "grads", "variables"), max_traces=4)
    coexecuted = outcome.stats.coexecuted
    # four results whose shapes vary (the two embeddings' values and indices) fetched at two
    # calls per length, then stood in for: at most 4 x 2 x 3 fetches, where every co-executed
    # call used to fetch all four
    learning = 4 * 2 * len(LENGTHS)
    assert 4 * coexecuted >= 2 * learning, outcome.report()
    assert 0 < result_fetches[0] <= learning, (result_fetches[0], outcome.report())
