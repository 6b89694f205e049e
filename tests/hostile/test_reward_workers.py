"""A user's reward function runs in a worker process: what the function starts goes with its
worker, and the worker's memory is bounded.

- A reward that runs the policy's code in a subprocess (as code rewards do) and waits on it
  past ``data.reward_timeout_s``: its worker was killed, the subprocess was not (it ran on,
  adopted by init, for as long as the policy's code did; so did one left by a worker that
  died mid-call). A worker now leads a process group, killed whole.
- The same with the code leaving the worker's process group (``os.setsid()``, as a daemon
  does): killed with its worker's group past the timeout and at close, it was not in the
  group, and ran on, adopted by init. A worker is now its descendants' subreaper, and killing
  it kills every descendant first.
- A call bounded in memory (``data.reward_memory_limit_mib``) raises MemoryError past its
  bound, and leaves its worker unbounded for the next call.
- What comes back from a worker is checked as before (a NaN, 1e308 or a string is refused
  naming the setting), and a worker that exits mid-call fails that call only."""

from __future__ import annotations

import asyncio
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from jax_agent_rl.config import load_config
from jax_agent_rl.rewards import RewardError, make_reward
from jax_agent_rl.rewards.registry import Answer
from jax_agent_rl.usercode.processes import CallProcesses
from tests.hostile.test_skyrl_isolation import _alive, _gone

HERE = "tests.hostile.test_reward_workers"


def running_code(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any) -> float:
    """A reward that runs the policy's code (here a process that never ends) in a subprocess,
    writes its pid to the file ``ground_truth`` names, and waits on it ("wait") or ends its
    own process at once ("die")."""
    del data_source, extra_info
    code = subprocess.Popen(["sleep", "100000"])
    Path(ground_truth).write_text(str(code.pid))
    if solution_str == "die":
        os._exit(3)
    return float(code.wait() == 0)


def test_what_a_reward_started_goes_with_its_worker(tmp_path: Path) -> None:
    """Past the timeout, and when the worker dies mid-call, the subprocess goes too."""
    spec = f"data.reward={HERE}:running_code"
    cfg = load_config(None, ["model.path=m", "data.train=t.jsonl", spec, "data.reward_timeout_s=2"])
    with make_reward(cfg.data) as score:
        for answer, why in (("wait", "reward_timeout_s=2s"), ("die", "died during the call")):
            pid_file = tmp_path / answer
            with pytest.raises((RewardError, RuntimeError), match=why):
                asyncio.run(score(Answer("x", "", answer, str(pid_file), {})))
            pid = int(pid_file.read_text())
            assert _gone(pid), f"the reward's subprocess {pid} ({answer}) outlived its worker"
            assert not _alive(pid)


def allocating(mib: int) -> int:
    """The length of a buffer of ``mib`` MiB, made."""
    return len(bytearray(mib << 20))


def load_allocating() -> Any:
    """`allocating`, as a worker loads it."""
    return allocating


def test_a_bounded_call_raises_memory_error_and_leaves_its_worker_unbounded() -> None:
    pool = CallProcesses(1, "worker")
    try:
        with pytest.raises(MemoryError):
            asyncio.run(pool.run(load_allocating, (256,), 60.0, memory_mib=64))
        assert asyncio.run(pool.run(load_allocating, (256,), 60.0)) == 256 << 20
    finally:
        pool.close()


def hoarding(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any) -> float:
    """A user's reward that holds ``solution_str`` MiB while it scores (a policy's answer that
    makes a parser build a huge structure)."""
    del data_source, ground_truth, extra_info
    held = bytearray(int(solution_str) << 20)
    return float(len(held) > 0)


@pytest.mark.parametrize(("limit", "bounded"), [("64", True), ("0", False)])
def test_a_user_reward_is_bounded_by_data_reward_memory_limit_mib(
    limit: str, bounded: bool
) -> None:
    """data.reward_memory_limit_mib bounds what one call of a user's function may grow its
    worker by (before, only reasoning-gym's scorers had a bound): past it the call raises (its
    episode's reward error) and the next call of the same worker is scored; 0 is unbounded."""
    spec = f"data.reward={HERE}:hoarding"
    overrides = ["model.path=m", "data.train=t.jsonl", spec, "data.reward_workers=1"]
    cfg = load_config(None, [*overrides, f"data.reward_memory_limit_mib={limit}"])
    with make_reward(cfg.data) as score:
        if bounded:
            with pytest.raises(MemoryError):
                asyncio.run(score(Answer("x", "", "256", None, {})))
        else:
            assert asyncio.run(score(Answer("x", "", "256", None, {}))) == 1.0
        assert asyncio.run(score(Answer("x", "", "8", None, {}))) == 1.0


def leaving_code(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any) -> float:
    """A reward that runs the policy's code in a subprocess that starts a session of its own
    (out of the worker's group), writes its pid to the file ``ground_truth`` names, and waits
    on it ("wait") or returns at once ("return")."""
    del data_source, extra_info
    code = subprocess.Popen(["sleep", "100000"], start_new_session=True)
    Path(ground_truth).write_text(str(code.pid))
    return 1.0 if solution_str == "return" else float(code.wait() == 0)


def test_what_a_reward_started_in_a_session_of_its_own_goes_with_its_worker(
    tmp_path: Path,
) -> None:
    spec = f"data.reward={HERE}:leaving_code"
    cfg = load_config(None, ["model.path=m", "data.train=t.jsonl", spec, "data.reward_timeout_s=2"])
    with make_reward(cfg.data) as score:
        with pytest.raises(RewardError, match="reward_timeout_s=2s"):  # (its worker killed)
            asyncio.run(score(Answer("x", "", "wait", str(tmp_path / "wait"), {})))
        assert asyncio.run(score(Answer("x", "", "return", str(tmp_path / "return"), {}))) == 1.0
    for answer in ("wait", "return"):  # (the second, at the pool's close)
        pid = int((tmp_path / answer).read_text())
        assert _gone(pid), f"the reward's subprocess {pid} ({answer}) outlived its worker"


def test_a_user_reward_run_in_a_worker_is_still_checked(tmp_path: Path) -> None:
    """User reward functions now run in worker processes: what comes back is checked as before
    (a NaN, 1e308 or a string is refused naming the setting), and a worker that exits mid-call
    fails that call only (the next is scored by a new worker)."""
    import asyncio

    from jax_agent_rl.config import load_config
    from jax_agent_rl.rewards import AnswerFaultError, make_reward
    from jax_agent_rl.rewards.registry import Answer

    (tmp_path / "rw.py").write_text(
        "import os\n"
        "def nan(*a): return float('nan')\n"
        "def huge(*a): return 1e308\n"
        "def text(*a): return '1.0'\n"
        "def once(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    if solution_str == 'die': os._exit(3)\n"
        "    return 1.0\n"
    )
    refused = {"nan": "not a finite number", "huge": "outside", "text": "expected a number"}
    for fn, why in refused.items():
        spec = f"data.reward={tmp_path / 'rw.py'}:{fn}"
        cfg = load_config(None, ["model.path=m", "data.train=t.jsonl", spec])
        with make_reward(cfg.data) as score, pytest.raises(Exception, match=why):
            asyncio.run(score(Answer("x", "", "5", "5", {})))
    spec = f"data.reward={tmp_path / 'rw.py'}:once"
    cfg = load_config(None, ["model.path=m", "data.train=t.jsonl", spec])
    with make_reward(cfg.data) as score:
        # (it dies on this answer alone: the answer's fault, `test_answer_faults.py`)
        with pytest.raises(AnswerFaultError, match="died during the call"):
            asyncio.run(score(Answer("x", "", "die", "5", {})))
        assert asyncio.run(score(Answer("x", "", "5", "5", {}))) == 1.0
