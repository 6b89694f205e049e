"""skyrl-gym environments attacked as a policy would: SQL that makes skyrl-gym's text2sql render
gigabytes, a step that never returns, a process that starts its own; and rows that name
skyrl-gym's built-ins that run the model's code outside any sandbox. Each episode's environment
lives in a process of its own (`jax_agent_rl.envs.skyrl`): what it does ends that episode.

The loop closes an episode whose reset passed ``env.step_timeout_s`` (its thread still
running). A reset still starting its process then (the forkserver's first start imports
skyrl-gym; many episodes start at once) found ``close`` a no-op, started the process after it
and ran ``init``: the process lived, unclosed, until the trainer exited. Now a reset after
close, or one that close finds starting, ends with an `EnvError` and leaves no process."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from jax_agent_rl.cli.demo import DEMO_CONFIG
from jax_agent_rl.config import ConfigError, load_config
from jax_agent_rl.config.sections import EnvSection
from jax_agent_rl.data.sample import Sample
from jax_agent_rl.envs import EnvError, Environments, make_environments, skyrl
from jax_agent_rl.envs.skyrl import REPLY_MAX_BYTES

ROOT = Path(__file__).resolve().parents[2]

GOLD = "SELECT name FROM employees WHERE salary > 150;"
# 100 MB of zeros in one cell: text2sql renders it as an 800M-character observation (2.5 GB)
ZEROBLOB = "SELECT zeroblob(100000000)"
# a recursive CTE of 1 MB blobs, 5 GB in all
BLOBS = (
    "WITH RECURSIVE r(i, b) AS (SELECT 1, zeroblob(1000000) UNION ALL "
    "SELECT i + 1, zeroblob(1000000) FROM r WHERE i < 5000) SELECT * FROM r"
)

PIDS_ENV = """
    import multiprocessing, os, subprocess, threading
    from pathlib import Path


    def _ids(queue):
        queue.put([os.getppid(), os.getsid(0)])


    class Pids:
        '''Writes its process id at init; its step starts a process of its own (its id written
        too) and, for kind "stuck", then never returns; for kind "multiprocessing" it starts
        a multiprocessing.Process instead and says its parent and session ids, and its own.'''

        def __init__(self, env_config=None, extras={}):
            self.out = Path(extras["extra_info"]["out"])
            self.kind = extras["extra_info"]["kind"]

        def init(self, prompt):
            self.out.with_suffix(".env").write_text(str(os.getpid()))
            return prompt, {}

        def step(self, action):
            if self.kind == "multiprocessing":  # as lcb runs the model's code
                queue = multiprocessing.Queue()
                worker = multiprocessing.Process(target=_ids, args=(queue,))
                worker.start()
                ids = queue.get()
                worker.join()
                said = f"{ids} {os.getpid()}"
                return {"observations": [{"role": "user", "content": said}], "reward": 0.0,
                        "done": True}
            sleeper = subprocess.Popen(["sleep", "1000"])
            self.out.with_suffix(".sleep").write_text(str(sleeper.pid))
            if self.kind == "stuck":
                threading.Event().wait()
            sleeper.kill()
            sleeper.wait()
            return {"observations": [], "reward": 1.0, "done": True}

        def close(self):
            pass
"""


def _database(root: Path) -> None:
    """A tiny database laid out as skyrl-gym's text2sql reads Spider's."""
    folder = root / "spider" / "database" / "mini"
    folder.mkdir(parents=True)
    with sqlite3.connect(folder / "mini.sqlite") as conn:
        conn.execute("CREATE TABLE employees (id INTEGER PRIMARY KEY, name TEXT, salary INTEGER)")
        conn.executemany(
            "INSERT INTO employees VALUES (?, ?, ?)", [(1, "John Doe", 100), (2, "Jane Smith", 200)]
        )


def _sql_sample() -> Sample:
    columns = {"db_id": "mini", "data": "spider", "reward_spec": {"ground_truth": GOLD}}
    prompt = [{"role": "user", "content": "Who earns more than 150?"}]
    return Sample("q/0", prompt, GOLD, env_class="text2sql", columns=columns)


def _sql_envs(root: Path, memory_limit_mib: int) -> Environments:
    section = EnvSection(
        config={"text2sql": {"db_path": str(root)}}, memory_limit_mib=memory_limit_mib
    )
    return make_environments(section, 3)


async def _sql_step(envs: Environments, sql: str) -> Any:
    """One text2sql episode's first step on ``sql``: its answer, or the EnvError that ended
    it (the episode closed either way)."""
    sample = _sql_sample()
    env = envs.make(sample)
    assert env is not None
    await env.reset(sample)
    try:
        return await env.step(f"<think>t</think><sql>{sql}</sql>", [])
    except EnvError as e:
        return e
    finally:
        await env.close()


TRAINER = """
    import asyncio, json, resource, sys
    from pathlib import Path

    from tests.hostile.test_skyrl_isolation import BLOBS, ZEROBLOB, _sql_envs, _sql_step


    def peak_mib():
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # (Linux: KiB)


    if __name__ == "__main__":  # (each environment's process imports this module)
        envs = _sql_envs(Path(sys.argv[1]), 512)
        warm = asyncio.run(_sql_step(envs, "SELECT 1"))  # the forkserver started, all imported
        before = peak_mib()
        ended = [str(asyncio.run(_sql_step(envs, bomb))) for bomb in (ZEROBLOB, BLOBS)]
        after = peak_mib()
        answered = asyncio.run(_sql_step(envs, "SELECT name FROM employees WHERE id = 1"))
        print(json.dumps({"ended": ended, "grew_mib": after - before,
                          "answered": answered.observations[0]["content"]}))
"""


def test_sql_bombs_end_their_episode_not_the_trainer(tmp_path: Path) -> None:
    """A zeroblob and a recursive CTE of blobs, as the model's SQL, each end their episode with
    an env error naming the memory bound; the peak memory of the process that plays them (a
    fresh one, so that its peak is its own) does not grow by anything near the 800 MB
    observation the zeroblob renders (2.5 GB peak when text2sql ran in the trainer); the next
    episode answers normally."""
    _database(tmp_path)
    script = tmp_path / "trainer.py"
    script.write_text(textwrap.dedent(TRAINER))
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path)],
        check=False,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},  # this checkout, not an installed one
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.splitlines()[-1])
    zeroblob, blobs = out["ended"]
    assert zeroblob.startswith("text2sql.step ") and "env.memory_limit_mib=512" in zeroblob
    # the CTE's rows are fetched under skyrl's own SQL timeout (5 s, fixed in skyrl_gym): on a
    # loaded machine it may come before the 512 MiB do, and the episode goes on with that
    # timeout as its observation; either way the bound held and the trainer did not grow
    bounded = blobs.startswith("text2sql.step ") and "env.memory_limit_mib=512" in blobs
    assert bounded or "<observation>SQL Timeout:" in blobs, blobs
    assert out["grew_mib"] < 400  # half of what the observation alone needs
    assert "John Doe" in out["answered"]


def test_the_memory_bound_is_the_setting(tmp_path: Path) -> None:
    """env.memory_limit_mib is what bounds the environment: a 4 MB blob (a 32M-character
    render) is answered within 1024 MiB and ends its episode within 32 MiB; a 10 MB one,
    rendered within 2048 MiB, is more than an answer may carry back; the key loads."""
    _database(tmp_path)
    blob = "SELECT zeroblob(4000000)"
    answered = asyncio.run(_sql_step(_sql_envs(tmp_path, 1024), blob))
    assert len(answered.observations[0]["content"]) > 32_000_000
    ended = asyncio.run(_sql_step(_sql_envs(tmp_path, 32), blob))
    assert isinstance(ended, EnvError) and "env.memory_limit_mib=32" in str(ended)
    larger = asyncio.run(_sql_step(_sql_envs(tmp_path, 2048), "SELECT zeroblob(10000000)"))
    assert isinstance(larger, EnvError)  # an 80M-character answer: the trainer never reads it
    assert f"text2sql.step answered more than {REPLY_MAX_BYTES} bytes" in str(larger)
    cfg = load_config(DEMO_CONFIG, ["model.path=x", "data.train=y", "env.memory_limit_mib=64"])
    assert cfg.env.memory_limit_mib == 64
    with pytest.raises(ConfigError, match=r"env\.memory_limit_mib"):
        load_config(DEMO_CONFIG, ["model.path=x", "data.train=y", "env.memory_limit_mib=0"])


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, killed and not yet reaped by whoever adopted it, does
    not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _gone(pid: int, wait_s: float = 30.0) -> bool:
    """``pid`` has stopped running: a killed process takes a moment to be, longer on a loaded
    machine; this waits for that state (up to ``wait_s``), it does not time anything."""
    deadline = time.monotonic() + wait_s
    while _alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _pids_envs(tmp_path: Path, timeout_s: float) -> Environments:
    (tmp_path / "pids_env.py").write_text(textwrap.dedent(PIDS_ENV))
    section = EnvSection(
        classes={"pids": f"{tmp_path / 'pids_env.py'}:Pids"}, step_timeout_s=timeout_s
    )
    return make_environments(section, 3)


def _pids_sample(out: Path, kind: str) -> Sample:
    extra = {"out": str(out), "kind": kind}
    return Sample(out.name, [{"role": "user", "content": "go"}], "1", extra=extra, env_class="pids")


def test_a_step_that_never_returns_is_killed_with_what_it_started(tmp_path: Path) -> None:
    """A skyrl-gym step that starts a process and never returns ends at env.step_timeout_s
    (env error); the environment's process and the one it started are killed, not
    abandoned (a thread could only be); the episode still closes."""
    envs = _pids_envs(tmp_path, 10.0)
    sample = _pids_sample(tmp_path / "stuck", "stuck")

    async def go() -> str:
        env = envs.make(sample)
        assert env is not None
        await env.reset(sample)
        try:
            await env.step("move", [])
        except EnvError as e:
            return str(e)
        finally:
            await env.close()
        return "returned"

    error = asyncio.run(go())
    assert "pids.step took longer than env.step_timeout_s=10.0s" in error
    env_pid = int((tmp_path / "stuck.env").read_text())
    sleep_pid = int((tmp_path / "stuck.sleep").read_text())
    assert env_pid != os.getpid()
    assert _gone(env_pid) and _gone(sleep_pid)


STUCK_TRAINER = """
    import asyncio, sys
    from pathlib import Path

    from tests.hostile.test_skyrl_isolation import _pids_envs, _pids_sample


    if __name__ == "__main__":  # (each environment's process imports this module)
        out = Path(sys.argv[1])
        envs = _pids_envs(out, 600.0)
        sample = _pids_sample(out / "stuck", "stuck")
        env = envs.make(sample)
        asyncio.run(env.reset(sample))
        asyncio.run(env.step("move", []))  # never returns: the test kills this process
"""


def test_a_trainer_killed_outright_takes_its_environments_with_it(tmp_path: Path) -> None:
    """A trainer killed (SIGKILL) while an environment's step is stuck: the environment's
    process, and the process its step started, end with it (not orphaned)."""
    script = tmp_path / "trainer.py"
    script.write_text(textwrap.dedent(STUCK_TRAINER))
    trainer = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    sleeper = tmp_path / "stuck.sleep"
    try:
        deadline = time.monotonic() + 120  # until the step is under way (a state, not a time)
        while not sleeper.exists() or not sleeper.read_text():
            assert trainer.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        env_pid = int((tmp_path / "stuck.env").read_text())
        assert _alive(env_pid)
        trainer.kill()
        trainer.wait()
        assert _gone(env_pid) and _gone(int(sleeper.read_text()))
    finally:
        trainer.kill()
        trainer.wait()
        if sleeper.exists() and sleeper.read_text():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(sleeper.read_text()), signal.SIGKILL)


def test_no_process_outlives_its_episode(tmp_path: Path) -> None:
    """Four episodes at once, each in its own process: each answers, and after close none of
    their processes runs."""
    envs = _pids_envs(tmp_path, 60.0)
    samples = [_pids_sample(tmp_path / f"ep{i}", "plain") for i in range(4)]

    async def episode(sample: Sample) -> float:
        env = envs.make(sample)
        assert env is not None
        await env.reset(sample)
        try:
            return (await env.step("move", [])).reward
        finally:
            await env.close()

    async def go() -> list[float]:
        return list(await asyncio.gather(*(episode(s) for s in samples)))

    assert asyncio.run(go()) == [1.0] * 4
    pids = {int((tmp_path / f"ep{i}.env").read_text()) for i in range(4)}
    assert len(pids) == 4 and os.getpid() not in pids
    assert all(not _alive(pid) for pid in pids)  # reaped before close returned


def test_an_environment_may_start_processes_of_its_own(tmp_path: Path) -> None:
    """A step that starts a multiprocessing.Process (as lcb does) gets one forked from the
    environment's process, in its session (so killed with it, and within its memory bound)."""
    envs = _pids_envs(tmp_path, 60.0)
    sample = _pids_sample(tmp_path / "mp", "multiprocessing")

    async def go() -> str:
        env = envs.make(sample)
        assert env is not None
        await env.reset(sample)
        try:
            return (await env.step("move", [])).observations[0]["content"]
        finally:
            await env.close()

    ids, env_pid = asyncio.run(go()).rsplit(" ", 1)
    assert ids == f"[{env_pid}, {env_pid}]"


@pytest.mark.parametrize("env_class", ["searchcode", "lcb"])
def test_builtins_that_run_model_code_unsandboxed_are_refused(env_class: str) -> None:
    """A row whose env_class is skyrl-gym's searchcode or lcb is refused with one line naming
    it and why; the same class named in env.classes (the user's own risk) is taken."""
    from jax_agent_rl.train.parts import check_environments

    envs = make_environments(EnvSection(), 2)
    sample = Sample("r/0", [{"role": "user", "content": "x"}], "1", env_class=env_class)
    with pytest.raises(ConfigError) as refused:
        check_environments(envs, [sample], "data.train")
    message = str(refused.value)
    assert "\n" not in message and f"env_class {env_class!r} refused" in message
    assert "sandbox" in message and "env.classes" in message
    entry = {"searchcode": "searchcode.env:SearchCodeEnv", "lcb": "lcb.env:LCBEnv"}[env_class]
    named = EnvSection(classes={"mine": f"skyrl_gym.envs.{entry}"})
    mine = Sample("r/0", [{"role": "user", "content": "x"}], "1", env_class="mine")
    check_environments(make_environments(named, 2), [mine], "data.train")


def test_episodes_reset_at_once_share_one_lifeline() -> None:
    """Episodes reset in threads (the loop's pool), many at once when a step starts. The
    forkserver and the lifeline were made on first use by a cached function, with no lock: two
    threads making them at once got two lifelines, and the one not cached closed as its caller
    returned, killing the processes started with it mid-episode (in a fresh-clone run beside a
    CPU hog: `gsm8k_multi_turn.step: its process died (killed by signal 9)`). Eight threads at a
    barrier, twenty times: made once each time (the cache alone gave 2-5 lifelines in half the
    tries)."""
    import threading

    from jax_agent_rl.envs import skyrl

    for _ in range(20):
        skyrl._made_context.cache_clear()
        barrier, lifelines = threading.Barrier(8), []

        def reset(barrier: threading.Barrier, lifelines: list[Any]) -> None:
            barrier.wait()
            lifelines.append(skyrl._context()[1])

        threads = [threading.Thread(target=reset, args=(barrier, lifelines)) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len({id(x) for x in lifelines}) == 1


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
