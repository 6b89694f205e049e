"""``verl.utils.rollout_trace``: verl's decorator that traces a tool's calls to weave or MLflow.

Here the trainer records every traced trajectory itself (``traces.jsonl``, or MLflow with
``trainer.trace_backend``), tool calls and responses included, so the decorator leaves the
method as it is: an async method stays async and returns what it returns.
"""

from collections.abc import Callable
from typing import TypeVar

F = TypeVar("F", bound=Callable[..., object])


def rollout_trace_op(func: F) -> F:
    """``func`` itself (its calls are traced with the trajectory they belong to)."""
    return func


__all__ = ["rollout_trace_op"]
