"""A reward function that fails on process 1 only (`test_multihost.py` starts that process
with `FAIL_HERE` set): one process's own error, as a broken host would raise. Not an
`Exception`: a reward function's ordinary error ends only its episode (``reward_error``), where
this one stops the process. (A reward function runs in a worker process of its own, which
inherits its process's environment but not its JAX state: there ``jax.process_index()`` is 0.)"""

import os

FAIL_HERE = "JARL_TEST_REWARD_FAILS_HERE"


class HostFailure(BaseException):
    """What a broken host raises: nothing on the way catches it as a reward's error."""


def fails_on_process_1(text: str, ground_truth: object) -> float:
    del text, ground_truth
    if os.environ.get(FAIL_HERE) == "1":
        raise HostFailure("the reward failed on purpose on process 1")
    return 0.0
