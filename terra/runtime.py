"""Placeholder runtime (being written)."""
import dataclasses

from terra.config import config


@dataclasses.dataclass
class Stats:
    iterations: int = 0
    traces: int = 0
    fallbacks: int = 0
    graph_generations: int = 0
    phase: str = "tracing"


_stats = Stats()


def stats():
    return dataclasses.replace(_stats)


def reset():
    global _stats
    _stats = Stats()


def explain():
    return ""


def configure(**kwargs):
    for k, v in kwargs.items():
        setattr(config, k, v)
