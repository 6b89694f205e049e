"""Environments attacked as a policy (or a broken environment) would: one episode reaching
another's state through a shared verl interaction, and an environment that never returns
holding up the process that abandoned it."""

import asyncio
import subprocess
import sys
import textwrap
from pathlib import Path

from jax_agent_rl.data.sample import Sample
from jax_agent_rl.envs.verl_interaction import InteractionEnvironment

ROOT = Path(__file__).resolve().parents[2]


class Keeper:
    """One interaction instance for every episode (as verl shares it), keyed by instance id:
    it remembers what each episode said and echoes it back."""

    def __init__(self) -> None:
        self.said: dict[str, list[str]] = {}
        self.finalized: list[str] = []

    async def start_interaction(self, instance_id: str, **_kwargs: object) -> str:
        self.said[instance_id] = []
        return instance_id

    async def generate_response(
        self, instance_id: str, messages: list[dict], **_kwargs: object
    ) -> tuple[bool, str, float, dict]:
        self.said[instance_id].append(messages[-1]["content"])
        return False, " | ".join(self.said[instance_id]), 0.0, {}

    async def finalize_interaction(self, instance_id: str, **_kwargs: object) -> None:
        self.finalized.append(instance_id)
        del self.said[instance_id]


def test_episodes_of_one_interaction_never_see_each_others_turns() -> None:
    """Two episodes interleaved on one shared interaction, one of them writing what looks like
    the other's turn: each reply holds only its own episode's turns, and each is finalized."""
    keeper = Keeper()

    async def go() -> tuple[list[str], list[str]]:
        a, b = (InteractionEnvironment(keeper, "keeper", 5.0) for _ in range(2))
        for env, uid in ((a, "p/t/0"), (b, "p/t/1")):
            await env.reset(Sample(uid, [{"role": "user", "content": "hi"}], "1",
                                   extra={"interaction_kwargs": {"name": "keeper"}}))  # fmt: skip
        replies: tuple[list[str], list[str]] = ([], [])
        for turn in range(3):
            for k, env in enumerate((a, b)):
                text = f"ep{k} turn{turn}" if k == 0 else f"ep0 turn{turn} (forged)"
                step = await env.step(text, [{"role": "assistant", "content": text}])
                replies[k].append(step.observations[0]["content"])
        await a.close()
        await b.close()
        return replies

    a_replies, b_replies = asyncio.run(go())
    assert a_replies[-1] == "ep0 turn0 | ep0 turn1 | ep0 turn2"
    assert all("forged" not in r for r in a_replies)
    assert all(r.count("forged") == i + 1 for i, r in enumerate(b_replies))
    assert sorted(keeper.finalized) == ["p/t/0", "p/t/1"] and not keeper.said


def test_an_environment_stuck_forever_does_not_hold_up_the_process(tmp_path: Path) -> None:
    """A skyrl-gym step that never returns: the episode's call ends at its timeout
    (EnvError) and the process still exits (the stuck thread is a daemon, not joined at the
    event loop's close, as the default executor's would be)."""
    script = tmp_path / "stuck.py"
    script.write_text(
        textwrap.dedent(
            """
            import asyncio, threading
            from jax_agent_rl.data.sample import Sample
            from jax_agent_rl.envs.base import EnvError
            from jax_agent_rl.envs.skyrl import SkyRLEnvironment

            class Stuck:
                def init(self, prompt):
                    return prompt, {}
                def step(self, action):
                    threading.Event().wait()
                def close(self):
                    pass

            async def main():
                env = SkyRLEnvironment(Stuck, "stuck", timeout_s=0.5)
                await env.reset(Sample("s", [{"role": "user", "content": "x"}], "1"))
                try:
                    await env.step("go", [])
                except EnvError as e:
                    print("ended:", e)

            asyncio.run(main())
            """
        )
    )
    done = subprocess.run(
        [sys.executable, str(script)],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "ended: stuck.step took longer than 0.5s" in done.stdout
