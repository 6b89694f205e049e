"""A reward function that makes process 1 fail with its own error (`test_multihost.py` starts
that process with `FAIL_HERE` set), as a broken host would raise: not an `Exception`, raised
in the trainer's process, so that nothing on the way catches it as a reward's error.

A reward function runs in a worker process of its own (which inherits its process's
environment but not its JAX state: there ``jax.process_index()`` is 0), and whatever it raises
there is its own error, which ends only its episode (``reward_error``): func_timeout's
``FunctionTimedOut``, a `BaseException`, is an answer it gave up on, not a broken host. So the
error it raises on process 1 is one whose reading in the trainer's process (its unpickling
there) raises `HostFailure` in that process."""

import os

FAIL_HERE = "JARL_TEST_REWARD_FAILS_HERE"


class HostFailure(BaseException):
    """What a broken host raises: nothing on the way catches it as a reward's error."""


def _read_in(trainer: int) -> Exception:
    """The reward's error as read in process ``trainer`` (`HostFailure`), or elsewhere (in
    the worker, which reads it back before sending it) a stand-in."""
    if os.getpid() == trainer:
        raise HostFailure("the reward failed on purpose on process 1")
    return RuntimeError("read in the worker")


class TrainerReadError(Exception):
    """An error whose reading in the worker's parent process, the trainer, fails there."""

    def __reduce__(self) -> tuple[object, tuple[int]]:
        return _read_in, (os.getppid(),)


def fails_on_process_1(text: str, ground_truth: object) -> float:
    del text, ground_truth
    if os.environ.get(FAIL_HERE) == "1":
        raise TrainerReadError
    return 0.0
