"""Benchmarks: the paper's programs and a harness comparing eager, AutoGraph and Terra.

``python -m benchmarks --help``; see docs/benchmarks.md.
"""
