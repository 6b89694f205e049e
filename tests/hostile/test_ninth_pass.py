"""Ninth pass: attacks on what a policy or a user controls, kept as regression tests.

- skyrl-gym: the loop closes an episode whose reset passed ``env.step_timeout_s`` (its
  thread still running). A reset still starting its process then (the forkserver's first
  start imports skyrl-gym; many episodes start at once) found ``close`` a no-op, started the
  process after it and ran ``init``: the process lived, unclosed, until the trainer exited.
  Now a reset after close, or one that close finds starting, ends with an `EnvError` and
  leaves no process.
- A user's reward that runs the policy's code in a subprocess (as code rewards do) and waits
  on it past ``data.reward_timeout_s``: its worker was killed, the subprocess was not (it ran
  on, adopted by init, for as long as the policy's code did; so did one left by a worker that
  died mid-call). A worker now leads a process group, killed whole.
- A timeout set to mean "never" (``env.step_timeout_s=1e300``) was taken, and every skyrl-gym
  episode then ended with an OverflowError (a pipe's poll takes at most 2**31 ms, 24.8 days),
  naming no setting; ``env.memory_limit_mib=10000000000000`` was taken, and every episode's process
  died at its start (setrlimit overflowed) with an error blaming memory. Each timeout is now
  at most 1e6 s and the memory bound at most 1e9 MiB, refused past that naming the key.
- A lone surrogate in a trajectory's messages (a data file's ``"\\ud83d"``, half an emoji; an
  environment's observation, which ends the episode unrendered when it says done): writing
  the step's traces raised UnicodeEncodeError and ended the run. It is now written as its JSON
  escape (read back the same), and `visible` shows it as one (a console cannot print it).
  At their sources it is now refused: a data file's prompt holding one is a DatasetError naming
  the row (each of its episodes failed in the tokenizer, "TextInputSequence must be str"), an
  environment's observation or prompt an EnvError naming the environment.
- An answer `answer_code.harmless` lets through to simple_integration's scorer,
  ``(a+b+c+d+e+f+g+h+X)**100``, has sympy's simplify grow its worker's memory without end (35
  MiB a second here) until ``data.reward_timeout_s``, in every worker at once: no bound but the
  host's memory. A scorer's call may now grow its worker by at most
  `reasoning_gym.SCORER_MEMORY_MIB`; past it, the MemoryError scores 0.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest

from jax_agent_rl.agent.episode import Episode
from jax_agent_rl.agent.trajectory import Trajectory
from jax_agent_rl.call_processes import CallProcesses
from jax_agent_rl.config import ConfigError, load_config
from jax_agent_rl.data import reasoning_gym
from jax_agent_rl.data.datasets import DatasetError, load_samples
from jax_agent_rl.envs import EnvError, skyrl
from jax_agent_rl.envs.base import checked_messages
from jax_agent_rl.rewards import RewardError, make_reward
from jax_agent_rl.rewards.registry import Answer
from jax_agent_rl.tokenization import (
    CHATML_SPECIAL_TOKENS,
    Tokenizer,
    chat_template,
    save_tokenizer,
    train_bpe,
)
from jax_agent_rl.train.traces import append_traces, read_traces, trace_record
from jax_agent_rl.visible import visible
from tests.hostile.test_skyrl_isolation import _alive, _gone, _pids_envs, _pids_sample

HERE = "tests.hostile.test_ninth_pass"


def test_a_skyrl_episode_closed_before_its_reset_starts_no_process(tmp_path: Path) -> None:
    """close, then reset (the order the loop's threads can take): reset is refused, and no
    process is started (the environment's init never ran: it writes its pid)."""
    envs = _pids_envs(tmp_path, 60.0)
    sample = _pids_sample(tmp_path / "early", "plain")
    env = envs.factory("pids")(sample)
    env.close()
    with pytest.raises(EnvError, match="closed before it started"):
        env.reset(sample)
    assert not (tmp_path / "early.env").exists()


class _Gate:
    """A lock that says when a thread has come to it (`entered`), then holds it until
    `opened`: the forkserver's lock, for a reset held where it starts its process."""

    def __init__(self) -> None:
        self.entered, self._open = threading.Event(), threading.Event()

    def __enter__(self) -> None:
        self.entered.set()
        self._open.wait()

    def __exit__(self, *_: object) -> None:
        pass

    def opened(self) -> None:
        self._open.set()


def test_a_skyrl_episode_closed_while_its_reset_starts_leaves_no_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """close while reset is starting the process (held at the forkserver's lock): the process
    reset then starts is killed before its init, and reset ends with an EnvError."""
    envs = _pids_envs(tmp_path, 60.0)
    sample = _pids_sample(tmp_path / "racing", "plain")
    env = envs.factory("pids")(sample)
    assert isinstance(env, skyrl.SkyRLEnvironment)
    gate = _Gate()
    monkeypatch.setattr(skyrl, "_CONTEXT_LOCK", gate)
    outcome: list[object] = []

    def reset() -> None:
        try:
            outcome.append(env.reset(sample))
        except EnvError as e:
            outcome.append(e)

    thread = threading.Thread(target=reset)
    thread.start()
    gate.entered.wait()
    env.close()
    gate.opened()
    thread.join()
    assert isinstance(outcome[0], EnvError) and "process is gone" in str(outcome[0])
    assert env._process is not None and env._process.exitcode is not None
    assert not (tmp_path / "racing.env").exists()


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


@pytest.mark.parametrize(
    "setting",
    [
        "env.step_timeout_s=1e300",
        "env.step_timeout_s=3e6",
        "data.reward_timeout_s=1e300",
        "tools.timeout_s=1e300",
        "data.judge.timeout_s=1e300",
        "env.memory_limit_mib=10000000000000",
    ],
)
def test_a_bound_past_what_its_wait_or_limit_takes_is_refused(setting: str) -> None:
    key = setting.partition("=")[0]
    with pytest.raises(ConfigError, match=rf"^{key}=.*: expected in .*1e\+0[69]\]$"):
        load_config(None, ["model.path=m", "data.train=t.jsonl", setting])


def test_the_largest_bounds_taken_work(tmp_path: Path) -> None:
    """The largest timeout and memory bound taken still let an episode run (before, past 24.8
    days a poll raised OverflowError; past 2**43 MiB the process died at its start)."""
    cfg = load_config(
        None,
        [
            "model.path=m",
            "data.train=t.jsonl",
            "env.step_timeout_s=1e6",
            "env.memory_limit_mib=1000000000",
        ],
    )
    envs = _pids_envs(tmp_path, cfg.env.step_timeout_s)
    sample = _pids_sample(tmp_path / "long", "plain")
    env = envs.factory("pids")(sample)
    assert isinstance(env, skyrl.SkyRLEnvironment)
    env.memory_limit_mib = cfg.env.memory_limit_mib
    try:
        env.reset(sample)
        assert env.step("move", []).reward == 1.0
    finally:
        env.close()


def test_a_lone_surrogate_in_a_trajectory_is_traced_and_shown(tmp_path: Path) -> None:
    backend = train_bpe(["plain text"] * 8, 300, CHATML_SPECIAL_TOKENS)
    folder = save_tokenizer(tmp_path / "tok", backend, chat_template("chatml_tools"))
    tokenizer = Tokenizer.from_pretrained(Path(folder))
    traj = Trajectory(uid="r/0", group_id="r", prompt_ids=tokenizer.encode("plain"))
    traj.messages = [
        {"role": "user", "content": "What is 2+2? \ud83d"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "\\\udc80 (an observation)"},
    ]
    traj.end("env_done")
    path = tmp_path / "traces.jsonl"
    append_traces(path, [trace_record(Episode(traj), tokenizer, 1)])
    assert read_traces(path)[0]["messages"] == traj.messages
    shown = visible(traj.messages[0]["content"])
    assert shown == "What is 2+2? \\ud83d"
    shown.encode("utf-8")  # (a console writing the old text raised here)


def test_a_lone_surrogate_is_refused_where_it_comes_in(tmp_path: Path) -> None:
    data = tmp_path / "rows.jsonl"
    data.write_text(
        '{"prompt": [{"role": "user", "content": "ok"}], "reward_model": {"ground_truth": "4"}}\n'
        '{"prompt": [{"role": "user", "content": "2+2? \\ud83d"}], '
        '"reward_model": {"ground_truth": "4"}}\n'
    )
    with pytest.raises(DatasetError, match=r"row 1 .*prompt message 0 \(user\) holds a lone"):
        load_samples(data, agents=["tool_agent"], default_agent="tool_agent")
    for prompt in (True, False):
        with pytest.raises(EnvError, match=r"^mine: .* message 1 holds a lone surrogate"):
            checked_messages(
                [{"role": "user", "content": "a"}, {"role": "user", "content": "b\udc80"}],
                "mine",
                prompt,
            )


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


def test_an_answer_that_grows_sympy_without_end_scores_zero(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """(The bound lowered to 64 MiB, for the test to reach it in seconds; the timeout is a
    minute: before, the answer took all of it and ended as a RewardError.)"""
    monkeypatch.setattr(reasoning_gym, "SCORER_MEMORY_MIB", 64)
    row = reasoning_gym.samples("reasoning_gym:simple_integration?size=1&seed=0", "x")[0]
    cfg = load_config(None, ["model.path=m", "data.train=t.jsonl", "data.reward_workers=1"])
    growing = "<answer>(a+b+c+d+e+f+g+h+X)**100</answer>"
    with make_reward(cfg.data) as score:
        answer = Answer(row.data_source, "", growing, row.ground_truth, row.extra)
        assert asyncio.run(score(answer)) == 0.0
        right = f"<answer>{row.ground_truth}</answer>"
        assert (
            asyncio.run(score(Answer(row.data_source, "", right, row.ground_truth, row.extra)))
            == 1.0
        )


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
