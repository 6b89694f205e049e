"""A reward function that fails on process 1 only (`test_multihost.py`): one process's own
error, as a broken host would raise. Not an `Exception`: a reward function's ordinary error
ends only its episode (``reward_error``), where this one stops the process."""

import jax


class HostFailure(BaseException):
    """What a broken host raises: nothing on the way catches it as a reward's error."""


def fails_on_process_1(text: str, ground_truth: object) -> float:
    del text, ground_truth
    if jax.process_index() == 1:
        raise HostFailure("the reward failed on purpose on process 1")
    return 0.0
