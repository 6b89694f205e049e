"""Environments through the real trainer (`train`, the embedded engine, a tiny random-init
checkpoint): skyrl-gym's built-in and a user's skyrl-gym environment unchanged, a verl
interaction from its YAML, reasoning-gym rows scored by their task's scorer; every trajectory
token-exact (observations as chat-template deltas, mask 0); and environments that raise, answer
garbage or never end each end only their own episode, counted."""

import asyncio
import json
import textwrap
from pathlib import Path
from typing import Any

import pytest

from jax_agent_rl.cli.demo import DEMO_CONFIG, TaskFiles, prepare
from jax_agent_rl.config import ConfigError, load_config
from jax_agent_rl.data.arithmetic import ArithmeticTask
from jax_agent_rl.data.datasets import DatasetError, load_samples
from jax_agent_rl.models.sharding import one_device_sharder
from jax_agent_rl.rewards import Answer, make_reward
from jax_agent_rl.tokenization import Tokenizer
from jax_agent_rl.tokenization.turns import TurnBuilder
from jax_agent_rl.tools.registry import ToolRegistry
from jax_agent_rl.train import train
from jax_agent_rl.train.metrics import read_metrics
from tests.processes import children

AGENTS = {"tool_agent": None, "single_turn_agent": None}


@pytest.fixture(scope="module")
def task(tmp_path_factory: pytest.TempPathFactory) -> TaskFiles:
    return prepare(tmp_path_factory.mktemp("task"), ArithmeticTask(), n_train=8, n_val=4, n_sft=8)


def _rows(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _question(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"What is {i} + {i}?"}]


def _train(task: TaskFiles, run_dir: Path, *overrides: str, steps: int = 2) -> list[dict[str, Any]]:
    """``steps`` steps of 2 prompts x 2 episodes, every trajectory traced; the traces."""
    args = [
        f"model.path={task.model}", f"tools.config={task.tools}", f"trainer.run_dir={run_dir}",
        "sft.steps=0", "data.val=", "data.prompts_per_step=2", "group.n=2",
        "engine.max_model_len=512", "engine.warmup=false",
        "agent.max_turns=3", "agent.max_tokens_per_turn=8",
        "agent.max_response_tokens=320", f"trainer.steps={steps}", "trainer.save_every=10",
        "trainer.eval_every=0", "trainer.tensorboard=false", "trainer.traces_per_step=8",
        *overrides,
    ]  # fmt: skip
    train(load_config(DEMO_CONFIG, args))
    records = read_metrics(run_dir / "metrics.jsonl", "train")
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    return [json.loads(line) for line in (run_dir / "traces.jsonl").read_text().splitlines()]


def _assert_token_exact(trace: dict[str, Any], builder: TurnBuilder, prompt_len: int) -> None:
    """``prompt_ids + response_ids`` is the conversation of ``messages`` as the loop builds it:
    the prompt rendered, each model turn sampled (mask 1), each observation the turn's close
    plus the template delta of the messages that answer it (mask 0)."""
    messages = trace["messages"]
    assert trace["prompt_ids"] == builder.prompt_ids(messages[:prompt_len])
    ids, mask = trace["response_ids"], trace["loss_mask"]
    segments: list[tuple[int, list[int]]] = []  # (mask, ids) runs
    for t, m in zip(ids, mask, strict=True):
        if segments and segments[-1][0] == m:
            segments[-1][1].append(t)
        else:
            segments.append((m, [t]))
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant" and i >= prompt_len]
    model = [s for m, s in segments if m == 1]
    observations = [s for m, s in segments if m == 0]
    assert len(model) == len(turns) and len(observations) in (len(turns), len(turns) - 1)
    for k, obs in enumerate(observations):
        answer = messages[turns[k] + 1 : turns[k + 1] if k + 1 < len(turns) else None]
        want = builder.close_assistant_turn(model[k]) + builder.messages_delta(answer)
        assert obs == want, (k, trace["uid"])


def _builder(task: TaskFiles) -> TurnBuilder:
    return TurnBuilder(
        Tokenizer.from_pretrained(task.model), ToolRegistry.from_yaml(task.tools).schemas()
    )


USER_ENV = '''
    """A guessing game written as skyrl-gym's docs say a user writes one: a BaseTextEnv subclass
    registered under an id. The reward of a turn is how many of the secret's letters it holds."""
    from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput
    from skyrl_gym.envs.registration import register


    class LettersEnv(BaseTextEnv):
        def __init__(self, env_config=None, extras={}):
            super().__init__()
            self.secret = extras["reward_spec"]["ground_truth"]
            self.max_turns = extras["max_turns"]
            self.bonus = env_config.get("bonus", 0.0)

        def init(self, prompt):
            return [{"role": "system", "content": "Guess the word."}, *prompt], {}

        def step(self, action):
            self.turns += 1
            reward = sum(c in action for c in self.secret) / len(self.secret) + self.bonus
            done = self.turns >= self.max_turns
            obs = [] if done else [{"role": "user", "content": f"{reward:.2f}, guess again"}]
            return BaseTextEnvStepOutput(observations=obs, reward=reward, done=done, metadata={})


    register(id="letters", entry_point=LettersEnv)
'''


INTERACTION = '''
    """A simulated user with verl's BaseInteraction methods (no verl import needed)."""


    class Teacher:
        def __init__(self, config):
            self.config, self.name = config, config["name"]
            self.instances = {}

        async def start_interaction(self, instance_id=None, ground_truth=None, **kwargs):
            self.instances[instance_id] = {"truth": ground_truth, "turns": 0}
            return instance_id

        async def generate_response(self, instance_id, messages, **kwargs):
            state = self.instances[instance_id]
            state["turns"] += 1
            last = messages[-1]
            assert last["role"] == "assistant" and "<|im_end|>" not in last["content"]
            right = state["truth"] in last["content"]
            text = self.config["praise"] if right else f"No. Try again (turn {state['turns']})."
            return right, text, float(right) + 0.25 * state["turns"], {}

        async def calculate_score(self, instance_id, **kwargs):
            return 0.0

        async def finalize_interaction(self, instance_id, **kwargs):
            del self.instances[instance_id]


    class Grumpy(Teacher):
        """Misbehaves as its config says: raises, or answers a 2-tuple."""

        async def generate_response(self, instance_id, messages, **kwargs):
            if self.config["mode"] == "raise":
                raise ValueError("the simulated user broke")
            return True, "too short"
'''


HOSTILE = """
    from skyrl_gym.envs.base_text_env import BaseTextEnv


    class Hostile(BaseTextEnv):
        def __init__(self, env_config=None, extras={}):
            super().__init__()
            self.kind = extras["extra_info"]["kind"]

        def step(self, action):
            if self.kind == "raises":
                raise RuntimeError("the environment broke")
            if self.kind == "garbage":
                return {"observations": "not a list", "reward": "high", "done": "yes"}
            if self.kind == "nan":
                return {"observations": [], "reward": float("nan"), "done": True}
            if self.kind == "bad_role":
                return {"observations": [{"role": "assistant", "content": "x"}], "reward": 1.0,
                        "done": False}
            # "endless": never done
            return {"observations": [{"role": "user", "content": "go on"}], "reward": 0.0,
                    "done": False}


    def not_an_environment(sample):
        return object()
"""


KINDS = ("raises", "garbage", "nan", "bad_role", "endless", "not_env")
GRUMPY = ("grumpy_raise", "grumpy_short")  # interactions that raise, answer a 2-tuple
FAILING = ("raises", "garbage", "nan", "bad_role", "not_env", *GRUMPY)


COUNT_LETTER_ENV = """
    from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput


    class CountLetterEnv(BaseTextEnv):
        '''SkyRL's docs' example: how often a letter is in a word, read from the row's own
        columns (letter, word), as SkyRL's generator passes them.'''

        def __init__(self, env_config=None, extras={}):
            super().__init__()
            self.answer = str(extras["word"].count(extras["letter"]))

        def step(self, action):
            reward = float(self.answer in action)
            return BaseTextEnvStepOutput(observations=[], reward=reward, done=True, metadata={})
"""

REGISTER_COUNT_LETTER = """
    from skyrl_gym.envs import register

    from count_letter_env import CountLetterEnv  # its neighbour: the file's folder is on sys.path

    register(id="count_letter", entry_point="count_letter_env:CountLetterEnv")
"""

SQL_GOLD = "SELECT name FROM employees WHERE salary > 150;"  # one row: Jane Smith
SYSTEM = {"role": "system", "content": "Think, then act."}
# the rows of SkyRL's built-ins and of the user's registered environment, by env_class: each
# with the columns its environment reads (db_id, data; letter, word), as SkyRL's datasets have
SKYRL_ROWS: dict[str, dict[str, Any]] = {
    "text2sql": {
        "prompt": [SYSTEM, {"role": "user", "content": "Who earns more than 150?"}],
        "db_id": "mini", "data": "spider",
        "reward_spec": {"method": "rule", "ground_truth": SQL_GOLD},
    },
    "search": {
        "prompt": [SYSTEM, {"role": "user", "content": "What is the capital of Italy?"}],
        "data_source": "nq",
        "reward_spec": {"method": "rule", "ground_truth": {"target": ["Rome"]}},
    },
    "count_letter": {
        "prompt": [{"role": "user", "content": "How many r in strawberry?"}],
        "letter": "r", "word": "strawberry", "reward_spec": {"method": "rule", "ground_truth": "3"},
    },
    "count_letter_cls": {
        "prompt": [{"role": "user", "content": "How many s in mississippi?"}],
        "letter": "s", "word": "mississippi",
        "reward_spec": {"method": "rule", "ground_truth": "4"},
    },
}  # fmt: skip


class SearchStub:
    """A search server on loopback answering skyrl-gym's retrieval requests ({query, topk,
    return_scores} -> {result: [[{document: {contents}}]]}), each query kept."""

    def __init__(self) -> None:
        import http.server
        import threading

        self.queries: list[str] = []
        stub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                stub.queries.append(body["query"])
                text = f"Rome is the capital of Italy ({body['query']})."
                docs = [{"document": {"contents": text}}]
                reply = json.dumps({"result": [docs[: body["topk"]]]}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/retrieve"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _sql_database(root: Path) -> Path:
    """A tiny database laid out as skyrl-gym's text2sql reads Spider's (its tests' own)."""
    import sqlite3

    folder = root / "spider" / "database" / "mini"
    folder.mkdir(parents=True)
    with sqlite3.connect(folder / "mini.sqlite") as conn:
        conn.execute("CREATE TABLE employees (id INTEGER PRIMARY KEY, name TEXT, salary INTEGER)")
        conn.executemany(
            "INSERT INTO employees VALUES (?, ?, ?)", [(1, "John Doe", 100), (2, "Jane Smith", 200)]
        )
    return folder / "mini.sqlite"


@pytest.fixture(scope="module")
def mixed(task: TaskFiles, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One run, 2 steps, from a user's own folder (the working directory, outside the
    repository), whose every step holds rows of each environment (each row picks its own):
    skyrl-gym's built-ins ``gsm8k_multi_turn``, ``text2sql`` (rows with SkyRL's db_id and data
    columns, a tiny database) and ``search`` (a search server on loopback), with SkyRL's stop
    strings; a user's skyrl-gym environment in SkyRL's layout (env_class, reward_spec), SkyRL's
    docs' count-letter environment registered by the user's module (``env.imports``) and named
    by a class that module imports (``env.classes``); a verl interaction (interaction_kwargs);
    and a hostile environment of each misbehaviour. The traces of every episode, by row kind,
    and the search and sql environments played by hand."""
    tmp = tmp_path_factory.mktemp("mixed")
    for name, text in (
        ("letters_env", USER_ENV),
        ("teacher", INTERACTION),
        ("hostile", HOSTILE),
        ("count_letter_env", COUNT_LETTER_ENV),
        ("register_count_letter", REGISTER_COUNT_LETTER),
    ):
        (tmp / f"{name}.py").write_text(textwrap.dedent(text))
    db_file = _sql_database(tmp / "sql_data")
    stub = SearchStub()
    (tmp / "interaction.yaml").write_text(
        "interaction:\n"
        "  - name: teacher\n"
        f"    class_name: {tmp / 'teacher.py'}:Teacher\n"
        "    config:\n"
        "      praise: Well done.\n"
        + "".join(
            f"  - name: {name}\n    class_name: {tmp / 'teacher.py'}:Grumpy\n"
            f"    config: {{mode: {name.split('_')[1]}}}\n"
            for name in GRUMPY
        )
    )
    kinds = ["gsm8k", "letters", "teacher", *KINDS, *GRUMPY, *SKYRL_ROWS]
    rows = []
    for i, kind in enumerate(kinds):
        row: dict[str, Any] = {"prompt": _question(i), "extra_info": {"index": i, "kind": kind}}
        if kind in SKYRL_ROWS:
            row = {**SKYRL_ROWS[kind], "env_class": kind, "extra_info": {"index": i}}
        elif kind in ("teacher", *GRUMPY):
            row["reward_model"] = {"ground_truth": str(2 * i)}
            row["extra_info"]["interaction_kwargs"] = {"name": kind, "ground_truth": str(2 * i)}
        else:
            row["reward_spec"] = {"method": "rule", "ground_truth": str(2 * i)}
            row["env_class"] = {"gsm8k": "gsm8k_multi_turn", "letters": "letters"}.get(
                kind, "not_env" if kind == "not_env" else "hostile"
            )
        if kind == "letters":
            row["reward_spec"]["ground_truth"] = "abcde"
        rows.append(row)
    overrides = [
        f"data.train={_rows(tmp / 'train.jsonl', rows)}",
        f"data.prompts_per_step={len(rows)}",
        f"trainer.traces_per_step={2 * len(rows)}",
        "env.classes.letters=letters_env.py:LettersEnv",  # paths as a user writes them
        "env.config.letters.bonus=0.5",
        "env.classes.hostile=hostile.py:Hostile",
        "env.classes.not_env=hostile.py:not_an_environment",
        "env.interaction_config=interaction.yaml",
        "data.reward=format",  # the interaction's rows: verl scores them by the reward function
        "env.imports=[register_count_letter.py]",
        "env.classes.count_letter_cls=register_count_letter.py:CountLetterEnv",
        f"env.config.text2sql.db_path={tmp / 'sql_data'}",
        f"env.config.search.search_url={stub.url}",
        "env.config.search.topk=3",
        "env.config.search.timeout=30",
        "env.config.search.log_requests=false",
        "agent.stop=[</search>,</sql>,</answer>,</solution>]",  # SkyRL's search and sql stops
    ]
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.chdir(tmp)  # as a user runs jarl train from their folder
            traces = _train(task, tmp / "run", *overrides)
            cfg = load_config(DEMO_CONFIG, ["model.path=x", *overrides])
            direct = asyncio.run(_direct_steps(cfg, tmp / "train.jsonl"))
    finally:
        stub.close()
    assert len(traces) == 2 * 2 * len(rows)
    by_kind: dict[str, Any] = {k: [] for k in kinds}
    for t in traces:
        by_kind[kinds[int(t["group_id"].rsplit("-", 1)[1])]].append(t)
    by_kind["metrics"] = read_metrics(tmp / "run" / "metrics.jsonl", "train")
    return {**by_kind, "direct": direct, "queries": stub.queries, "db_file": db_file}


def test_a_skyrl_gym_builtin_trains_unchanged(task: TaskFiles, mixed: dict) -> None:
    """skyrl-gym's ``gsm8k_multi_turn`` (per-turn rewards, a user message after each wrong
    answer, done after its max_turns, which SkyRL sets from the generator's: agent.max_turns);
    the episode's reward is the sum of the environment's step rewards."""
    builder = _builder(task)
    for t in mixed["gsm8k"]:
        assert t["stop_reason"] == "env_done"  # the environment ends it after 3 turns
        assert t["num_turns"] == 3 and len(t["turn_rewards"]) == 3
        assert t["env_reward"] == pytest.approx(sum(t["turn_rewards"]))
        assert t["reward"] == pytest.approx(t["env_reward"])
        follow_up = t["messages"][2]
        assert follow_up["role"] == "user" and "#### ANSWER" in follow_up["content"]
        _assert_token_exact(t, builder, prompt_len=1)


def test_a_user_skyrl_env_trains_and_its_reward_is_the_environments(
    task: TaskFiles, mixed: dict
) -> None:
    """A user's module named by ``env.classes`` (its class made as SkyRL makes it, with
    ``env.config.<env_class>`` as env_config): ``init`` rewrites the prompt (a system message
    first), each step answers with a user message, the reward is the sum of its turns'."""
    builder = _builder(task)
    for t in mixed["letters"]:
        assert t["messages"][0] == {"role": "system", "content": "Guess the word."}
        assert t["stop_reason"] == "env_done" and t["num_turns"] == 3  # agent.max_turns
        text = [m["content"] for m in t["messages"] if m["role"] == "assistant"]
        eos = builder.tokenizer.decode([builder.eos_id])  # the step reads the turn without it
        actions = [x.removesuffix(eos) for x in text]
        want = [sum(c in x for c in "abcde") / 5 + 0.5 for x in actions]  # bonus: env_config
        assert t["turn_rewards"] == pytest.approx(want)
        assert t["reward"] == pytest.approx(sum(want))
        _assert_token_exact(t, builder, prompt_len=2)


def test_a_verl_interaction_trains_from_its_yaml(task: TaskFiles, mixed: dict) -> None:
    """verl's interaction config YAML and rows with extra_info.interaction_kwargs: the
    interaction answers each turn without tool calls with a user message, its scores are the
    turn rewards, and the row's reward function (verl's rule) scores the episode."""
    builder = _builder(task)
    for t in mixed["teacher"]:
        assert t["env_reward"] is None  # verl: the reward function scores the episode
        assert t["stop_reason"] in ("env_done", "max_turns", "max_response_tokens")
        users = [m for m in t["messages"][1:] if m["role"] == "user"]
        assert users and all(m["content"].startswith(("No. Try again", "Well")) for m in users)
        assert any(r >= 0.25 for r in t["turn_rewards"])  # the interaction's scores
        _assert_token_exact(t, builder, prompt_len=1)


def test_reasoning_gym_rows_are_scored_by_their_tasks_scorer(
    task: TaskFiles, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """``data.train=reasoning_gym:<task>?...`` generates the same rows for the same spec; the
    task's ``score_answer`` of the text in the last <answer> tags is the reward; a run trains
    on them."""
    import reasoning_gym

    spec = "reasoning_gym:basic_arithmetic?size=6&seed=3&max_terms=3"
    samples = load_samples(spec, agents=AGENTS, default_agent="tool_agent")
    again = load_samples(spec, agents=AGENTS, default_agent="tool_agent")
    assert [s.uid for s in samples] == [s.uid for s in again]
    other = load_samples(
        spec.replace("seed=3", "seed=4"), agents=AGENTS, default_agent="tool_agent"
    )
    assert other != samples
    data = reasoning_gym.create_dataset("basic_arithmetic", size=6, seed=3, max_terms=3)
    cfg = load_config(DEMO_CONFIG, ["model.path=x", f"data.train={spec}"])
    scorer = make_reward(cfg.data)  # data.reward unset: reasoning-gym rows by their task
    request.addfinalizer(scorer.close)  # (its worker process stops)

    def score(source: str, text: str, truth: Any, extra: dict[str, Any]) -> float:
        return asyncio.run(scorer(Answer(source, "", text, truth, extra)))

    for s, entry in zip(samples, data, strict=True):
        assert s.ground_truth == entry["answer"] and s.messages[-1]["content"] == entry["question"]
        right, wrong = f"ok <answer>{entry['answer']}</answer>", "<answer>nonsense</answer>"
        for text, want in ((right, 1.0), (wrong, data.score_answer("nonsense", entry))):
            assert score(s.data_source, text, s.ground_truth, s.extra) == want
        assert score(s.data_source, entry["answer"], s.ground_truth, s.extra) == 0.0  # no tags
    for bad in ("", "nope?size=2&seed=0", "basic_arithmetic?size=0&seed=0",
                "basic_arithmetic?size=2", "basic_arithmetic?size=2&seed=1&bogus=1"):  # fmt: skip
        with pytest.raises(DatasetError):
            load_samples("reasoning_gym:" + bad, agents=AGENTS, default_agent="tool_agent")

    before = children()
    traces = _train(task, tmp_path / "run", f"data.train={spec}")
    assert children() <= before  # the run's reward workers stopped with it
    by_uid = {s.uid: s for s in samples}
    for t in traces:
        s = by_uid[t["group_id"]]
        final = [m["content"] for m in t["messages"] if m["role"] == "assistant"][-1]
        assert t["reward"] == score(s.data_source, final, s.ground_truth, s.extra)


def test_hostile_environments_end_only_their_own_episode(mixed: dict) -> None:
    """An environment that raises, answers garbage (a non-list observation, a string reward, a
    NaN reward, an assistant-role observation) or is not an environment at all (one that hangs
    past env.step_timeout_s: tests/hostile/test_environments.py), and a verl interaction that
    raises or answers a malformed tuple, end their own episode: on the policy's action (a
    step's failure) with caused_error (counted, trained on as a wrong answer, 0), and as an
    environment that could not be made with env_error (counted, not trained); one that never
    says done runs into agent.max_turns; the other rows of the same steps are untouched (the
    tests above)."""
    for kind in FAILING:
        want = "env_error" if kind == "not_env" else "caused_error"
        assert all(t["stop_reason"] == want for t in mixed[kind]), kind
        assert all(t["reward"] == 0.0 for t in mixed[kind]), kind
    assert all("the environment broke" in t["error"] for t in mixed["raises"])
    assert all("the simulated user broke" in t["error"] for t in mixed["grumpy_raise"])
    assert all("expected (should_terminate" in t["error"] for t in mixed["grumpy_short"])
    assert all("not an Environment" in t["error"] for t in mixed["not_env"])
    assert all(t["stop_reason"] == "max_turns" for t in mixed["endless"])
    for step in mixed["metrics"]:
        share = 1 / (len(KINDS) + len(GRUMPY) + 3 + len(SKYRL_ROWS))  # (one kind each)
        assert step["stop/env_error"] == pytest.approx(share)  # not_env
        assert step["untrainable"] == pytest.approx(share)
        assert step["stop/caused_error"] == pytest.approx((len(FAILING) - 1) * share)


def test_environment_config_errors_name_the_key(tmp_path: Path) -> None:
    """An unknown env_class, a class that is not an environment, a bad interaction YAML: one
    error naming the key or the row, before anything runs."""
    from jax_agent_rl.envs import make_environments
    from jax_agent_rl.train.parts import check_environments

    cfg = load_config(DEMO_CONFIG, ["model.path=x", "data.train=y"])
    envs = make_environments(cfg.env, 2)
    rows = [{"prompt": _question(0), "env_class": "no_such_env", "ground_truth": "1"}]
    path = _rows(tmp_path / "rows.jsonl", rows)
    samples = load_samples(path, agents=AGENTS, default_agent="tool_agent")
    with pytest.raises(ConfigError, match="no_such_env"):
        check_environments(envs, samples, "data.train")
    (tmp_path / "bad.yaml").write_text("interaction: {name: x}\n")
    for override, match in (
        ("env.interaction_config=" + str(tmp_path / "bad.yaml"), "non-empty 'interaction' list"),
        ("env.interaction_config=" + str(tmp_path / "missing.yaml"), "cannot read"),
        ("env.classes.x=json:nothing_here", "env.classes.x"),
        ("env.config.not_an_env.a=1", "not_an_env"),
        (f"env.imports=[{tmp_path / 'nowhere.py'}]", r"env\.imports\[0\].*no such file"),
        ("env.imports=[no_such_package.envs]", r"env\.imports\[0\].*cannot import"),
    ):
        bad = load_config(DEMO_CONFIG, ["model.path=x", "data.train=y", override])
        with pytest.raises(ConfigError, match=match):
            make_environments(bad.env, 2)


def test_the_guessing_game_is_won_by_binary_search() -> None:
    """The built-in ``guess_number``: a binary search finds every secret of 1..16 within 4
    guesses (agent.max_turns=5 in its config leaves one slip), each wrong guess answered
    higher / lower, a turn without a number asked again, the win worth 1 and nothing else."""
    from jax_agent_rl.data.sample import Sample
    from jax_agent_rl.envs.guess import GuessNumber

    async def search(secret: int) -> tuple[int, list[float]]:
        env = GuessNumber(Sample("g", _question(0), ground_truth=str(secret)))
        lo, hi, rewards = 1, 16, []
        assert (await env.step("hmm", [])).observations[0]["content"] == "Say one number."
        for guesses in range(1, 6):
            guess = (lo + hi) // 2
            step = await env.step(f"Maybe {lo}? <answer>{guess}</answer>", [])
            rewards.append(step.reward)
            if step.done:
                return guesses, rewards
            reply = step.observations[0]["content"]
            assert reply == ("higher" if guess < secret else "lower")
            lo, hi = (guess + 1, hi) if reply == "higher" else (lo, guess - 1)
        raise AssertionError(f"secret {secret} not found")

    for secret in range(1, 17):
        guesses, rewards = asyncio.run(search(secret))
        assert guesses <= 5 and rewards == [0.0] * (guesses - 1) + [1.0]


def test_the_guessing_game_config_trains(task: TaskFiles, tmp_path: Path) -> None:
    """configs/guess_number_cpu.yaml as its comments say to run it (rows written by the
    module's command line), a few steps with a held-out evaluation: every episode is a game
    answered by the environment, won exactly when its reward is 1."""
    from jax_agent_rl.envs.guess import main as write_rows

    write_rows([str(tmp_path / "train.jsonl"), "--n", "16", "--seed", "0"])
    write_rows([str(tmp_path / "val.jsonl"), "--n", "4", "--seed", "1"])
    config = Path(__file__).resolve().parents[2] / "configs" / "guess_number_cpu.yaml"
    args = [
        f"model.path={task.model}", f"data.train={tmp_path / 'train.jsonl'}",
        f"data.val={tmp_path / 'val.jsonl'}", f"trainer.run_dir={tmp_path / 'run'}",
        "trainer.steps=2", "trainer.eval_every=2", "trainer.save_every=2",
        "data.prompts_per_step=4", "group.n=4", "trainer.tensorboard=false",
        "trainer.traces_per_step=16",
    ]  # fmt: skip
    train(load_config(config, args))
    run = tmp_path / "run"
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl", "train")] == [1, 2]
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl", "val")] == [0, 2]
    traces = [json.loads(line) for line in (run / "traces.jsonl").read_text().splitlines()]
    assert len(traces) == 32
    for t in traces:
        replies = [m["content"] for m in t["messages"][1:] if m["role"] == "user"]
        assert set(replies) <= {"higher", "lower", "Say one number."}
        assert (t["stop_reason"] == "env_done") == (t["reward"] == 1.0)
        assert t["stop_reason"] in ("env_done", "max_turns", "max_model_len", "max_response_tokens")


@pytest.mark.parametrize("agent_name", ["react_agent", "openai_agent"])
def test_loops_that_do_not_drive_environments_refuse_their_rows(
    task: TaskFiles, agent_name: str
) -> None:
    """A row that names an environment but a loop that cannot play it (a LangGraph graph, an
    OpenAI harness) ends as agent_error naming the loop, its environment never made, rather
    than running as if it had none (loading such a file refuses it before that)."""
    from jax_agent_rl.agent.context import AgentConfig, AgentContext
    from jax_agent_rl.agent.loop import run_sample
    from jax_agent_rl.data.sample import Sample
    from jax_agent_rl.engine import Engine
    from jax_agent_rl.envs import make_environments
    from jax_agent_rl.models import load_hf
    from jax_agent_rl.rollout import EmbeddedBackend
    from jax_agent_rl.tokenization.tool_calls import make_parser
    from jax_agent_rl.tools.registry import LocalTools

    cfg = load_config(DEMO_CONFIG, ["model.path=x", "data.train=y"])
    model, weights = load_hf(task.model, sharder=one_device_sharder())
    sample = Sample("g-0", _question(0), "12", agent_name=agent_name, env_class="guess_number")

    async def go() -> Any:
        backend = EmbeddedBackend(
            Engine(model, max_concurrent_decodes=1, max_len=256, sharder=one_device_sharder()),
            weights,
        )
        tools = LocalTools(ToolRegistry.from_yaml(task.tools))
        ctx = await AgentContext.create(
            backend,
            Tokenizer.from_pretrained(task.model),
            tools,
            make_parser("hermes"),
            AgentConfig(harness="json:dumps" if agent_name == "openai_agent" else ""),
            envs=make_environments(cfg.env, 2),
        )
        try:
            return await run_sample(sample, ctx)
        finally:
            await backend.close()
            await tools.close()

    traj = asyncio.run(go())
    assert traj.stop_reason == "agent_error" and not traj.response_ids
    assert f"agent_name {agent_name!r} does not drive environments" in traj.error


async def _direct_steps(cfg: Any, rows: Path) -> dict[str, list[Any]]:
    """The same environments made as the run makes them (`make_environments`), played by hand
    with the actions SkyRL's envs act on: a search, an SQL query, an answer."""
    from jax_agent_rl.envs import make_environments

    envs = make_environments(cfg.env, 3)
    loaded = load_samples(rows, agents=AGENTS, default_agent="tool_agent")
    samples = {s.env_class: s for s in loaded}
    actions = {
        "search": ["<search>capital of Italy</search>", "<answer>Rome</answer>"],
        "text2sql": [
            "<think>a</think><sql>SELECT name FROM employees WHERE id = 1;</sql>",
            f"<think>b</think>\n<solution>{SQL_GOLD}</solution>",
        ],
    }
    steps: dict[str, list[Any]] = {}
    for name, acts in actions.items():
        env = envs.make(samples[name])
        assert env is not None
        await env.reset(samples[name])
        steps[name] = [await env.step(a, []) for a in acts]
        await env.close()
    return steps


def _chat_history(trace: dict[str, Any], prompt_len: int, eos: str) -> str:
    """What SkyRL's search and sql envs score: their actions and observations, joined."""
    return "".join(m["content"].removesuffix(eos) for m in trace["messages"][prompt_len:])


def test_skyrl_text2sql_and_search_train_with_their_columns_and_stop_strings(
    task: TaskFiles, mixed: dict[str, Any]
) -> None:
    """skyrl-gym's ``text2sql`` (which asserts the row's db_id and data columns) and
    ``search`` run 2 training steps: every episode is answered by the environment itself
    (its own observations) until it says done at agent.max_turns, and the reward is its
    score of the episode, recomputed here with skyrl-gym's scorers. Played by hand, the
    same environments run the query on the database, ask the search server, and score a
    right answer 1."""
    from skyrl_gym.envs.search.utils import compute_score
    from skyrl_gym.envs.sql.utils import compute_score_single

    builder = _builder(task)
    eos = builder.tokenizer.decode([builder.eos_id])
    for name in ("text2sql", "search"):
        assert len(mixed[name]) == 4  # 2 steps x 2 episodes
        for t in mixed[name]:
            assert t["stop_reason"] == "env_done" and t["num_turns"] == 3, t["error"]
            history = _chat_history(t, 2, eos)
            if name == "text2sql":
                want = compute_score_single(history, SQL_GOLD, str(mixed["db_file"]))
                assert "turns left to complete the task" in t["messages"][3]["content"]
            else:
                want = compute_score(history, {"target": ["Rome"]})
                assert t["messages"][3]["content"].startswith("\n<information>")
            assert t["turn_rewards"] == pytest.approx([0.0, 0.0, want])
            assert t["reward"] == pytest.approx(want)
            _assert_token_exact(t, builder, prompt_len=2)
    search, sql = mixed["direct"]["search"], mixed["direct"]["text2sql"]
    assert "Rome is the capital of Italy (capital of Italy)" in search[0].observations[0]["content"]
    assert mixed["queries"] == ["capital of Italy"]
    assert search[1].done and search[1].reward == 1.0
    assert "John Doe" in sql[0].observations[0]["content"] and not sql[0].done
    assert sql[1].done and sql[1].reward == 1.0


def test_a_user_module_registers_envs_from_outside_the_repository(
    mixed: dict[str, Any],
) -> None:
    """A user's module in their own folder that registers an environment as SkyRL's docs do
    (``register(id=..., entry_point="count_letter_env:CountLetterEnv")``) is imported by
    ``env.imports`` and its id trains; the class that module imports from its neighbour can be
    named in ``env.classes`` too. The environment reads the row's own columns."""
    for name, answer in (("count_letter", "3"), ("count_letter_cls", "4")):
        assert len(mixed[name]) == 4
        for t in mixed[name]:
            assert t["stop_reason"] == "env_done" and t["num_turns"] == 1, t["error"]
            action = t["messages"][1]["content"]
            assert t["reward"] == float(answer in action)
