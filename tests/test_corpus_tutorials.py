"""The corpus programs written with public tutorials' training code, eager vs Terra.

``vae``, ``pix2pix``, ``wgan_gp`` and ``tfkeras_gru_lm`` (docs/corpus.md) are the patterns of
TensorFlow's and Keras' tutorials: a random draw inside the step, two tapes in one ``with``, a
gradient penalty through a nested tape, a GRU's ``tf.while_loop`` run eagerly. Each test runs
one program for a few steps in fresh processes (eagerly, then with ``terra.enable()``) through
the corpus driver and asserts the same per-step losses and the same final value of every
variable. The suite's own switches reach the child processes (conftest: no cost budget, the
graph instantiated in the loop's path), so the first graph is built and co-executed within
these few steps rather than waiting for a budget a 12-step run cannot judge.
"""

import pytest
from test_corpus_quick import run_pair

STEPS = 12
TUTORIALS = ["vae", "pix2pix", "wgan_gp", "tfkeras_gru_lm"]


@pytest.mark.parametrize("program", TUTORIALS)
def test_tutorial_program_terra_equals_eager(program, tmp_path):
    terra = run_pair(program, STEPS, tmp_path)
    # a graph ran some of its steps
    assert terra["stats"]["coexecuted"] > 0, terra["explain"]
