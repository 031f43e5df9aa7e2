"""Placeholder tape (being written)."""
import tensorflow as tf


class TerraGradientTape(tf.GradientTape):
    pass
