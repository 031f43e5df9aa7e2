"""TF-Agents (tf_keras): a DQN agent (``DqnAgent`` with a ``QNetwork`` of two hidden layers, a
target network synced every 5 steps through ``common.Periodically``, an epsilon-greedy collect
policy left unused) built from CartPole-shaped specs, trained with ``agent.train(experience)`` on
batches of synthetic two-step trajectories as a replay buffer would hand them out. In TF2,
``agent.train`` is not wrapped in a ``tf.function`` unless the user wraps it
(``common.function``), so the agent's own ``tf.GradientTape`` step runs eagerly."""

import numpy as np
import tensorflow as tf
import tf_keras
from tf_agents.agents.dqn import dqn_agent
from tf_agents.networks import q_network
from tf_agents.specs import tensor_spec
from tf_agents.trajectories import time_step, trajectory
from tf_agents.utils import common

from benchmarks.corpus.programs import Program, optimizer_variables

BATCH, OBSERVATION, ACTIONS, BATCHES = 64, 4, 2, 6


def experience(rng):
    """A replay-buffer sample: [BATCH, 2] transitions, a few of them episode ends."""
    last = rng.random((BATCH, 1)) < 0.1
    step_type = np.concatenate([np.ones((BATCH, 1)), np.where(last, 2, 1)], axis=1)
    next_step_type = np.concatenate([np.where(last, 2, 1), np.ones((BATCH, 1))], axis=1)
    return trajectory.Trajectory(
        step_type=tf.constant(step_type, tf.int32),
        observation=tf.constant(rng.normal(size=(BATCH, 2, OBSERVATION)), tf.float32),
        action=tf.constant(rng.integers(0, ACTIONS, (BATCH, 2)), tf.int64),
        policy_info=(),
        next_step_type=tf.constant(next_step_type, tf.int32),
        reward=tf.constant(rng.normal(size=(BATCH, 2)), tf.float32),
        discount=tf.constant(np.where(next_step_type == 2, 0.0, 1.0), tf.float32))


class DQN(Program):
    def __init__(self, rng):
        observation_spec = tensor_spec.BoundedTensorSpec(
            [OBSERVATION], tf.float32, minimum=-10.0, maximum=10.0)
        action_spec = tensor_spec.BoundedTensorSpec([], tf.int64, minimum=0, maximum=ACTIONS - 1)
        self.optimizer = tf_keras.optimizers.Adam(learning_rate=1e-3)
        self.agent = dqn_agent.DqnAgent(
            time_step.time_step_spec(observation_spec), action_spec,
            q_network=q_network.QNetwork(observation_spec, action_spec, fc_layer_params=(64, 64)),
            optimizer=self.optimizer, td_errors_loss_fn=common.element_wise_squared_loss,
            target_update_period=5, gamma=0.99,
            train_step_counter=tf.Variable(0, dtype=tf.int64))
        self.agent.initialize()
        self.data = [experience(rng) for _ in range(BATCHES)]

    def step(self):
        return self.agent.train(self.next_batch()).loss

    def variables(self):
        unique = {id(v): v for v in [*self.agent.variables, *optimizer_variables(self.optimizer)]}
        return list(unique.values())


def build(rng):
    return DQN(rng)
