"""A reward function that fails on process 1 only (`test_multihost.py`): one process's own
error, as a user's reward or a broken host would raise."""

import jax


def fails_on_process_1(text: str, ground_truth: object) -> float:
    del text, ground_truth
    if jax.process_index() == 1:
        raise RuntimeError("the reward failed on purpose on process 1")
    return 0.0
