"""Cut a Keras model whose layers form a chain into pipeline stages of similar forward time.

A pipeline runs as fast as its slowest stage, so the cut points minimise the largest stage's
measured forward time rather than balancing layer counts.
"""

from __future__ import annotations

import time

import tensorflow as tf


class Stage:
    """A run of consecutive layers, called as one; its variables are those of its layers."""

    def __init__(self, layers):
        self.layers = list(layers)

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        return x

    @property
    def trainable_variables(self):
        return [v for layer in self.layers for v in layer.trainable_variables]

    def __repr__(self):
        return f"Stage({', '.join(layer.name for layer in self.layers)})"


def chain_layers(model) -> list:
    """The model's layers in call order, refusing models whose layers do not form a chain."""
    layers = [layer for layer in model.layers if not isinstance(layer, tf.keras.layers.InputLayer)]
    for previous, layer in zip(layers, layers[1:]):
        inbound = {id(history.operation) for history in _parents(layer)}
        if inbound and inbound != {id(previous)}:
            raise ValueError(f"layer {layer.name} does not take its input from {previous.name} "
                             "alone; only a chain of layers can be cut into stages")
    return layers


def _parents(layer):
    """The layers feeding ``layer`` in a functional model (none for a Sequential's)."""
    nodes = getattr(layer, "_inbound_nodes", [])
    return [history for node in nodes for history in
            (getattr(t, "_keras_history", None) for t in node.input_tensors) if history]


def measure(layers, sample, repeats=5) -> list[float]:
    """Median eager forward time of each layer on the activation it receives from ``sample``."""
    times, x = [], sample
    for layer in layers:
        runs = []
        for _ in range(repeats):
            start = time.perf_counter()
            y = layer(x)
            _ = y.numpy()
            runs.append(time.perf_counter() - start)
        times.append(sorted(runs)[repeats // 2])
        x = y
    return times


def balanced_cuts(costs, stages) -> list[int]:
    """Sizes of ``stages`` contiguous groups minimising the largest group's summed cost."""
    n = len(costs)
    if not 1 <= stages <= n:
        raise ValueError(f"cannot cut {n} layers into {stages} non-empty stages")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: the smallest largest-group cost of the first i layers in k groups
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    sizes, i = [], n
    for k in range(stages, 0, -1):
        sizes.append(i - cut[k][i])
        i = cut[k][i]
    return sizes[::-1]


def split_model(model, stages: int, sample) -> list[Stage]:
    """Cut a built Sequential or chain-shaped functional model into ``stages`` stages."""
    layers = chain_layers(model)
    sizes = balanced_cuts(measure(layers, sample), stages)
    result, start = [], 0
    for size in sizes:
        result.append(Stage(layers[start:start + size]))
        start += size
    return result
