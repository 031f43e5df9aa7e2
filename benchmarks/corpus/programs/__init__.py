"""The corpus programs: one module per program, each with ``build(rng) -> Program``.

``rng`` is a seeded ``numpy.random.Generator`` for the synthetic data; the worker has already
seeded Python's ``random``, NumPy's global generator and TensorFlow's global seed, so the
library's own initializers and samplers draw the same numbers in the eager and the Terra run.
"""

from __future__ import annotations


class Program:
    """One training program: ``step()`` runs one training step of the library and returns its
    loss (a tensor is fine: the worker converts the losses after the last step, so a graph
    running behind Python is not waited for at every step). ``variables()`` lists every variable
    the run changes (model and optimizer state), in a fixed order, for the final comparison.

    ``train`` is the loop; a program whose library owns the loop (``model.fit``) overrides it
    and reports each step's loss through ``tick`` from a callback.
    """

    def step(self):
        raise NotImplementedError

    def variables(self) -> list:
        raise NotImplementedError

    def train(self, steps: int, tick) -> None:
        for _ in range(steps):
            tick(self.step())


def optimizer_variables(optimizer) -> list:
    """An optimizer's state: ``variables`` is a method on tf_keras optimizers and a property on
    Keras 3 and Sonnet ones."""
    found = optimizer.variables
    return list(found() if callable(found) else found)
