"""Ninth pass: attacks on what a policy or a user controls, kept as regression tests.

- skyrl-gym: the loop closes an episode whose reset passed ``env.step_timeout_s`` (its
  thread still running). A reset still starting its process then (the forkserver's first
  start imports skyrl-gym; many episodes start at once) found ``close`` a no-op, started the
  process after it and ran ``init``: the process lived, unclosed, until the trainer exited.
  Now a reset after close, or one that close finds starting, ends with an `EnvError` and
  leaves no process.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from jax_agent_rl.envs import EnvError, skyrl
from tests.hostile.test_skyrl_isolation import _pids_envs, _pids_sample


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
