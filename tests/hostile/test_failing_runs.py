"""A run where everything fails must not look normal: a step whose episodes mostly end in an
error or a budget says so on the console (the stop reason, its share, one episode's error), a
step where every episode failed stops the run with that line, and a reward function that raises
on some rows ends those episodes (reward_error, counted, not trained on) with a trace naming the
function and the row, instead of killing the run with a traceback.

The console's warning for a step whose episodes mostly failed quotes one episode's error, and
the error that stops a run whose episodes all failed quotes the first: an error that quotes
the policy's text (sqlite's ``near "...": syntax error`` for a skyrl-gym text2sql step, a
reward function's message) wrote its escape sequences to the terminal raw (rich drops BEL
only): clear the screen, set the clipboard (OSC 52 ended by ESC \\), forge a link. Both are
now `visible`, as traces are.

A run whose every episode failed stopped with a traceback of ~90 lines (jarl's frames, then
the first error's); ``jarl train`` and ``jarl eval`` print its two lines: the stop reason's
share, and what failed, where, on which row. A step whose episodes mostly ended in a reward
error showed the error's last line ("ZeroDivisionError: boom"): its headline, naming
data.reward, the function and the row, is shown now."""

from __future__ import annotations

import asyncio
import textwrap
from pathlib import Path

import pytest

from jax_agent_rl.agent.episode import Episode
from jax_agent_rl.agent.trajectory import Trajectory
from jax_agent_rl.config.sections import DataSection
from jax_agent_rl.data.sample import Sample
from jax_agent_rl.rewards import (
    make_reward,
)
from jax_agent_rl.tokenization import Tokenizer, chat_template, save_tokenizer, train_bpe
from jax_agent_rl.train.episodes import (
    RolloutFailedError,
    all_failed_error,
    episode_metrics,
    episode_totals,
    first_error,
    metrics_of_totals,
    raise_if_all_failed,
    stop_warning,
)
from jax_agent_rl.train.rollout_score import score_episodes
from tests.tokenization.test_tokenizer import CORPUS

MISNAMED = (
    "Traceback (most recent call last):\n  ...\njax_agent_rl.envs.base.EnvError: row p/s1a0/0: "
    "extra_info.interaction_kwargs.name is 'gsm8kk'; configured interactions: ['gsm8k']\n"
)


def _ended(stop: str, error: str | None = None, uid: str = "p/s1a0/0") -> Episode:
    traj = Trajectory(uid, "p", [1, 2])
    traj.end(stop, error)  # type: ignore[arg-type]
    return Episode(traj)


def test_a_step_of_failed_episodes_stops_the_run_with_its_reason() -> None:
    """Every episode env_error (a misnamed interaction): the run stops, the error naming the
    stop reason, its share and the first error."""
    trajs = [_ended("env_error", MISNAMED) for _ in range(4)]
    with pytest.raises(RuntimeError, match=r"ended env_error") as e:
        raise_if_all_failed(trajs)
    assert "'gsm8kk'; configured interactions" in str(e.value)
    mixed = [_ended("reward_error", "reward error: ...\nValueError: bad row"), _ended("tool_error")]
    with pytest.raises(RuntimeError, match=r"all 2 trajectories of the rollout failed"):
        raise_if_all_failed(mixed)
    raise_if_all_failed([*trajs, _ended("eos")])  # one episode ended well: the step goes on


def test_a_step_mostly_failing_or_cut_says_so() -> None:
    """A step with most episodes in an error (agent/harness errors) or at a budget
    (max_model_len) is named on the console line, with one error's last line; a step that
    mostly ended well is not."""
    harness = "Traceback (most recent call last):\n  ...\nKeyError: 'harness bug'\n"
    trajs = [
        *(_ended("harness_error", harness) for _ in range(5)),
        *(_ended("eos") for _ in [0] * 4),
    ]
    line = stop_warning(episode_metrics(trajs), trajs)
    assert line == "WARNING: 56% of episodes ended harness_error (e.g. KeyError: 'harness bug')"
    cut = [_ended("max_model_len") for _ in range(3)]
    assert (
        stop_warning(episode_metrics(cut), cut) == "WARNING: 100% of episodes ended max_model_len"
    )
    fine = [_ended("eos"), _ended("eos"), _ended("agent_error", harness)]
    assert stop_warning(episode_metrics(fine), fine) is None


def test_a_reward_function_that_raises_ends_only_its_episodes(tmp_path: Path) -> None:
    """data.reward raising on some rows: those episodes end reward_error (reward 0, not
    trainable) with the function, its file and the row in the error; the others are scored."""
    (tmp_path / "picky.py").write_text(
        textwrap.dedent(
            """
            def picky(data_source, solution_str, ground_truth, extra_info):
                if extra_info["index"] % 2:
                    raise ValueError("cannot read this row")
                return 1.0
            """
        )
    )
    picky = DataSection(train="t.jsonl", reward=f"{tmp_path / 'picky.py'}:picky")
    folder = save_tokenizer(tmp_path / "tok", train_bpe(CORPUS, 400), chat_template("chatml_tools"))
    tokenizer = Tokenizer.from_pretrained(folder)
    samples = [
        Sample(f"row{i}/s1a0/0", [{"role": "user", "content": "q"}], "1", extra={"index": i},
               group_id=f"row{i}")
        for i in range(4)
    ]  # fmt: skip
    groups = [[Trajectory(s.uid, s.group_id, [1])] for s in samples]
    with make_reward(picky) as score:
        scored = asyncio.run(
            score_episodes(groups, samples, score, 0.0, tokenizer, success_reward=1.0)
        )
    trajs = [g[0] for g in scored]
    assert [t.stop_reason for t in trajs] == ["eos", "reward_error", "eos", "reward_error"]
    assert [t.reward for t in trajs] == [1.0, 0.0, 1.0, 0.0]
    bad = trajs[1]
    assert not bad.trainable and bad.error is not None
    assert "ValueError: cannot read this row in picky (" in bad.error
    assert "picky.py" in bad.error and "on row 'row1'" in bad.error and "data.reward" in bad.error
    m = episode_metrics(trajs)
    assert m["stop/reward_error"] == 0.5 and m["untrainable"] == 0.5


def test_a_failed_episodes_error_reaches_the_console_visible() -> None:
    sql = 'SELECT "\x1b[2J\x1b]52;c;cm0gLXJmIH4=\x1b\\"'  # clear the screen, set the clipboard
    error = f"env error: text2sql.step raised OperationalError: near {sql}: syntax error"
    trajs = [Trajectory(uid=f"r-{i}/s1a0/0", group_id=f"r-{i}", prompt_ids=[1]) for i in range(2)]
    for traj in trajs:
        traj.end("env_error", error)
    episodes = [Episode(t) for t in trajs]
    totals = episode_totals(episodes)
    warning = stop_warning(metrics_of_totals(totals), episodes)
    stopped = all_failed_error(totals, first_error(episodes))
    assert warning is not None and stopped is not None
    for line in (warning, str(stopped)):
        assert "\x1b" not in line
        assert 'near SELECT "\u241b[2J\u241b]52;c;cm0gLXJmIH4=\u241b\\": syntax error' in line


def test_a_rollout_whose_every_episode_failed_is_two_lines_of_the_cli() -> None:
    """A run whose every episode failed (a reward raising on every row) ended in a traceback
    of ~90 lines, jarl's own frames first; `jarl train` and `jarl eval` now catch the
    `RolloutFailedError` and print its first two lines: the stop reason's share and what failed,
    where, on which row."""
    first = (
        "reward error: the reward function (data.reward) raised KeyError: 'nope' in always "
        "(/u/my.py:6) on row 'a-2'\nTraceback (most recent call last):\n  ...\nKeyError: 'nope'"
    )
    trajs = [Trajectory(f"a-2/s{i}", "a-2", [1, 2]) for i in range(4)]
    for traj in trajs:
        traj.end("reward_error", first)
    episodes = [Episode(t) for t in trajs]
    error = all_failed_error(episode_totals(episodes), first_error(episodes))
    assert isinstance(error, RolloutFailedError)
    headline, what = str(error).splitlines()[:2]
    assert headline.startswith("all 4 trajectories of the rollout failed (WARNING: 100%")
    assert what == first.splitlines()[0]


def test_a_step_of_reward_errors_names_the_setting_and_the_row() -> None:
    """A step whose episodes mostly ended in a reward error said "(e.g. ZeroDivisionError:
    boom)", the error's last line: neither data.reward, nor the function, nor the row; the
    headline the error leads with names all three."""
    error = (
        "reward error: the reward function (data.reward, or data.rewards_by_source.a) raised "
        "ZeroDivisionError: boom in score (/u/my.py:3) on row 'a-2' (episode 'a-2/s0', "
        "data_source 'a')\nTraceback (most recent call last):\n  ...\nZeroDivisionError: boom"
    )
    trajs = [Trajectory(f"a-2/s{i}", "a-2", [1, 2]) for i in range(2)]
    trajs[0].end("reward_error", error)
    trajs[1].end("reward_error", error)
    episodes = [Episode(t) for t in trajs]
    line = stop_warning(episode_metrics(episodes), episodes)
    assert line == f"WARNING: 100% of episodes ended reward_error (e.g. {error.splitlines()[0]})"
