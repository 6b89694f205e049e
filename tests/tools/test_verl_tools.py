"""Tools written for verl run here: verl's tools YAML as is, `BaseTool` classes and
`@function_tool` functions written exactly as verl documents them (verl is not installed;
only the import line differs), a dataset row's ``extra_info.tools_kwargs`` reaching ``create``
in process and over HTTP, verl-tool's ``/get_observation`` protocol on ``jarl serve-tools``,
and executors that close what they hold."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, ClassVar
from uuid import uuid4

import httpx
import pytest
import yaml

from jax_agent_rl.agent.context import AgentContext
from jax_agent_rl.agent.loop import run_sample
from jax_agent_rl.agent.trajectory import Trajectory
from jax_agent_rl.compat.verl.tools import (
    BaseTool,
    OpenAIFunctionToolSchema,
    ToolResponse,
    function_tool,
)
from jax_agent_rl.data.sample import Sample
from jax_agent_rl.rollout import EmbeddedBackend
from jax_agent_rl.tokenization.tool_calls import make_parser
from jax_agent_rl.tools.app import create_app
from jax_agent_rl.tools.base import Tool, ToolExecutor, ToolResult, tool
from jax_agent_rl.tools.calculator import calculator, evaluate, format_number
from jax_agent_rl.tools.client import HttpTools
from jax_agent_rl.tools.registry import LocalTools, ToolRegistry
from jax_agent_rl.tools.row_kwargs import create_kwargs_by_tool
from jax_agent_rl.tools.sandbox import Limits, PythonSandbox, PythonTool
from tests.agent import test_loop
from tests.tools.test_server import loaded_tokenizer, serving, start_server
from tests.tools.test_tools import Counter

# ----------------------------------------------------------------------------- verl tools


class AnswerTool(BaseTool):
    """verl's gsm8k tool, shrunk: the ground truth arrives in ``create_kwargs``, every answer
    is scored with ``calc_reward``, and the instance keeps the attempts of its trajectory."""

    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema):
        super().__init__(config, tool_schema)
        self._instance_dict: dict[str, dict[str, Any]] = {}

    async def create(
        self, instance_id: str | None = None, **kwargs: Any
    ) -> tuple[str, ToolResponse]:
        if instance_id is None:
            instance_id = str(uuid4())
        ground_truth = kwargs.get("create_kwargs", {}).get("ground_truth", None)
        self._instance_dict[instance_id] = {"ground_truth": ground_truth, "answers": []}
        return instance_id, ToolResponse(text="submit your answer")

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float, dict]:
        del kwargs
        self._instance_dict[instance_id]["answers"].append(str(parameters.get("answer", "")))
        reward = await self.calc_reward(instance_id)
        attempts = len(self._instance_dict[instance_id]["answers"])
        verdict = self.config["correct_text"] if reward else "wrong"
        return ToolResponse(text=f"attempt {attempts}: {verdict}"), reward, {"attempts": attempts}

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        del kwargs
        state = self._instance_dict[instance_id]
        return 1.0 if state["answers"][-1] == state["ground_truth"] else 0.0

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        del kwargs
        del self._instance_dict[instance_id]


class EchoTool(BaseTool):
    """A tool of verl before 0.5: ``create`` returns the instance id alone and ``execute`` a
    string; its schema comes from the class (the YAML entry has none); ``calc_reward`` and
    ``release`` are the base class's."""

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema:
        return OpenAIFunctionToolSchema.model_validate(
            {
                "type": "function",
                "function": {
                    "name": "echo",
                    "description": "Echo a text.",
                    "parameters": {
                        "type": "object",
                        "properties": {"text": {"type": "string", "description": "The text."}},
                        "required": ["text"],
                    },
                },
            }
        )

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> str:
        del kwargs
        return instance_id or "echo-1"

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[str, float, dict]:
        del kwargs
        return f"{instance_id}: {parameters['text']}", await self.calc_reward(instance_id), {}


class CheckedCalculator(BaseTool):
    """The calculator as a verl tool that also scores its value against the sample's ground
    truth (``create_kwargs``), the way verl's gsm8k tool scores answers."""

    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema):
        super().__init__(config, tool_schema)
        self._instance_dict: dict[str, Any] = {}

    async def create(
        self, instance_id: str | None = None, **kwargs: Any
    ) -> tuple[str, ToolResponse]:
        instance_id = instance_id or str(uuid4())
        self._instance_dict[instance_id] = kwargs.get("create_kwargs", {}).get("ground_truth")
        return instance_id, ToolResponse()

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float, dict]:
        del kwargs
        value = format_number(evaluate(parameters["expression"]))
        reward = 1.0 if value == self._instance_dict[instance_id] else 0.0
        return ToolResponse(text=value), reward, {}

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        del kwargs
        del self._instance_dict[instance_id]


@function_tool
def get_weather(city: str) -> dict:
    """Get the current weather for a city.

    Args:
        city: The city to look up, e.g. "Tokyo" or "San Francisco".
    """
    return {"city": city, "temperature_c": 17.3, "condition": "drizzle"}


@function_tool("grade")
async def grade_answer(answer: int) -> tuple[str, float]:
    """Grade an answer to the question.

    Args:
        answer: The answer.
    """
    return ("right", 1.0) if answer == 42 else ("wrong", 0.0)


@function_tool(
    schema={
        "type": "function",
        "function": {
            "name": "draw",
            "description": "Draw a picture.",
            "parameters": {"type": "object", "properties": {}},
        },
    }
)
def draw():  # type: ignore[no-untyped-def]  # no hints: the given schema replaces inference
    return ToolResponse(text="a cat", image=["<image bytes>"])


SUBMIT_SCHEMA = {
    "type": "function",
    "function": {
        "name": "submit",
        "description": "Submit an answer.",
        "parameters": {
            "type": "object",
            "properties": {"answer": {"type": "string", "description": "The answer."}},
            "required": ["answer"],
        },
    },
}
VERL_YAML = yaml.safe_dump(
    {
        "tools": [
            {
                "class_name": "tests.tools.test_verl_tools.AnswerTool",
                "config": {"type": "native", "correct_text": "correct"},
                "tool_schema": SUBMIT_SCHEMA,
            },
            {"class_name": "tests.tools.test_verl_tools.EchoTool", "config": {"type": "native"}},
        ]
    }
)


def verl_registry(tmp_path: Path, text: str = VERL_YAML) -> ToolRegistry:
    path = tmp_path / "verl_tools.yaml"
    path.write_text(text)
    return ToolRegistry.from_yaml(path)


# ----------------------------------------------------------------------------- 1, 2: YAML, adapters


def test_verl_tools_yaml_runs_basetool_classes(tmp_path: Path) -> None:
    registry = verl_registry(tmp_path)
    assert registry.names == ["echo", "submit"]
    assert registry.get("submit").schema == SUBMIT_SCHEMA  # as the chat template gets it
    answers: AnswerTool = registry.get("submit").tool  # type: ignore[attr-defined]
    tools = LocalTools(registry)
    truth = {"ground_truth": "42"}

    async def scenario() -> list[ToolResult]:
        out = [
            await tools.call("a", "submit", {"answer": "41"}, truth),
            await tools.call("a", "submit", {"answer": "42"}, truth),
            await tools.call("b", "submit", {"answer": "42"}, {"ground_truth": "7"}),
            await tools.call("a", "echo", {"text": "hi"}),
        ]
        assert len(answers._instance_dict) == 2  # one instance per trajectory
        await tools.release("a")
        await tools.release("b")
        return out

    wrong, right, other, echo = asyncio.run(scenario())
    assert (wrong.text, wrong.reward) == ("attempt 1: wrong", 0.0)
    assert (right.text, right.reward) == ("attempt 2: correct", 1.0)  # state and config
    assert (other.text, other.reward) == ("attempt 1: wrong", 0.0)  # its own ground truth
    assert (echo.text, echo.reward, echo.error) == ("echo-1: hi", 0.0, False)
    assert answers._instance_dict == {}  # released through the tool's own release


# verl's examples/sglang_multiturn/config/tool_config/gsm8k_tool_config.yaml, as verl ships it
VERL_GSM8K_YAML = """\
tools:
  - class_name: "verl.tools.gsm8k_tool.Gsm8kTool"
    config:
      type: native
    tool_schema:
      type: "function"
      function:
        name: "calc_gsm8k_reward"
        description: "A tool for calculating the reward of gsm8k. (1.0 if parsed answer is correct,\
 0.0 if parsed answer is incorrect or not correctly parsed)"
        parameters:
          type: "object"
          properties:
            answer:
              type: "string"
              description: "The model's answer to the GSM8K math problem, must be a digits"
          required: ["answer"]
"""


def test_verls_own_gsm8k_tool_yaml_runs_unchanged(tmp_path: Path) -> None:
    """The class verl's GSM8K tool YAML names answers as verl 0.6's ``Gsm8kTool`` does (the
    expected texts and tool rewards were recorded from it on these calls)."""
    tools = LocalTools(verl_registry(tmp_path, VERL_GSM8K_YAML))
    calls = [("15", "14"), ("15", "15"), ("15", "#### 15"), ("15", "abc")]
    calls += [("1500", "1,500"), ("1500", "$1500"), ("1500", "1500.0")]

    async def scenario() -> list[tuple[str, float]]:
        out = []
        for truth, answer in calls:
            kwargs = {"ground_truth": truth}
            result = await tools.call(truth, "calc_gsm8k_reward", {"answer": answer}, kwargs)
            out.append((result.text, result.reward))
        await tools.release("15")
        await tools.release("1500")
        return out

    assert asyncio.run(scenario()) == [
        ("Current parsed answer='14' reward=0.0", -0.05),
        ("Current parsed answer='15' reward=1.0", 0.0),
        ("Current parsed answer='#### 15' reward=1.0", -0.05),  # not an improvement
        ("Current parsed answer='abc' reward=0", -0.05),  # no number: verl's int 0
        ("Current parsed answer='1,500' reward=0.0", -0.05),
        ("Current parsed answer='$1500' reward=1.0", 0.0),
        ("Current parsed answer='1500.0' reward=0.0", -0.05),
    ]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "tools:\n- class_name: tests.tools.test_verl_tools.AnswerTool\n  tool_schemas: {}\n",
            r"tools\[0\]: keys must be class_name \(required\), config, tool_schema; "
            r"got unknown \['tool_schemas'\]",
        ),
        (
            "tools:\n- class_name: nope.Missing\n  config: {type: native}\n",
            r"tools\[0\] \(nope.Missing\): class_name: cannot import 'Missing' from 'nope'",
        ),
        (
            "tools:\n- class_name: tests.tools.test_verl_tools.AnswerTool\n  config: {type: mcp}\n",
            r"tools\[0\] \(tests.tools.test_verl_tools.AnswerTool\): config.type must be "
            r"'native' \(verl's MCP tools are not supported\), got 'mcp'",
        ),
        (
            "tools:\n- class_name: tests.tools.test_verl_tools.AnswerTool\n"
            "  config: {type: native}\n  tool_schema: {type: function, function: {name: x}}\n",
            r"tools\[0\] \(tests.tools.test_verl_tools.AnswerTool\): tool_schema: "
            r"function.description: Field required$",
        ),
        (
            "tools:\n- class_name: tests.tools.test_verl_tools.AnswerTool\n"
            "  config: {type: native}\n",
            r"AnswerTool: no tool_schema in the YAML entry, and get_openai_tool_schema\(\) "
            r"gives none",
        ),
        ("tool: []\n", r"expected a list of tool entries .* got a mapping with keys \['tool'\]"),
        ("tools:\n", r"expected a list .* got 'tools' holding NoneType, not a list$"),
        ("- class: jax_agent_rl.tools.calculator\n", r"entry 0: class must be 'module:attr'"),
        (
            "- class: jax_agent_rl.tools.calculator:calculator\n- class: tests.tools:nothing\n",
            r"entry 1: class: cannot import 'nothing' from 'tests.tools'",
        ),
        (
            "- class: jax_agent_rl.tools.calculator:calculator\n  schema: {type: function}\n",
            r"entry 0: schema: function: Field required$",
        ),
        (
            "- class: jax_agent_rl.tools.calculator:calculator\n  config: {x: 1}\n",
            r"entry 0: config: jax_agent_rl.tools.calculator:calculator is a tool",
        ),
    ],
)
def test_malformed_tools_files_name_the_entry_and_key(
    tmp_path: Path, text: str, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        verl_registry(tmp_path, text)


def test_function_tools(tmp_path: Path) -> None:
    path = tmp_path / "tools.yaml"
    path.write_text(
        "- class: tests.tools.test_verl_tools:get_weather\n"
        "- class: tests.tools.test_verl_tools:grade_answer\n"
        "- class: tests.tools.test_verl_tools:draw\n"
    )
    registry = ToolRegistry.from_yaml(path)
    assert registry.names == ["draw", "get_weather", "grade"]
    weather = registry.get("get_weather").schema["function"]
    assert weather["description"] == "Get the current weather for a city."
    assert weather["parameters"]["properties"]["city"]["type"] == "string"
    assert get_weather("Oslo")["city"] == "Oslo"  # still callable as the function
    tools = LocalTools(registry)

    async def scenario() -> list[ToolResult]:
        return [
            await tools.call("t", "get_weather", {"city": "Tokyo"}),
            await tools.call("t", "grade", {"answer": 42}),
            await tools.call("t", "grade", {"answer": 7}),
            await tools.call("t", "draw", {}),
        ]

    weather_result, right, wrong, picture = asyncio.run(scenario())
    assert json.loads(weather_result.text) == get_weather("Tokyo")  # a dict is sent as JSON
    assert (right.text, right.reward, wrong.text, wrong.reward) == ("right", 1.0, "wrong", 0.0)
    assert picture.error and "images or videos; the agent loop is text-only" in picture.text
    with pytest.raises(ValueError, match="function_tool 'paint': the schema names it 'draw'"):
        function_tool("paint", schema=registry.get("draw").schema)(lambda: "x")


# ----------------------------------------------------------------------------- 3: tools_kwargs


def test_create_kwargs_by_tool_reads_verls_layout() -> None:
    row = {
        "index": 3,
        "tools_kwargs": {
            "submit": {"create_kwargs": {"ground_truth": "42"}, "execute_kwargs": {}},
            "echo": {},
        },
    }
    assert create_kwargs_by_tool(row) == {"submit": {"ground_truth": "42"}, "echo": {}}
    assert create_kwargs_by_tool({"index": 3}) == {}
    bad = [
        ({"tools_kwargs": ["submit"]}, "must map tool names to dicts, got list"),
        ({"tools_kwargs": {"submit": 1}}, r"\['submit'\] must be a dict, got int"),
        ({"tools_kwargs": {"submit": {"create": {}}}}, r"unknown key\(s\) \['create'\]"),
        (
            {"tools_kwargs": {"submit": {"release_kwargs": {"x": 1}}}},
            r"\['release_kwargs'\] are not read",
        ),
        (
            {"tools_kwargs": {"submit": {"create_kwargs": [1]}}},
            r"\['create_kwargs'\] must be a dict, got list",
        ),
    ]
    for extra, message in bad:
        with pytest.raises(ValueError, match=message):
            create_kwargs_by_tool(extra)


CHATML = pytest.mark.parametrize("setup", ["chatml"], indirect=True)
QUESTION = "What is 17 + 25?"  # the memorised model calls the calculator (42), then answers


def _loop_yaml() -> str:
    """A verl tools YAML serving the memorised model's two tools: the calculator (as
    `CheckedCalculator`, same schema, so the prompt and the observations are unchanged) and
    echo (as `LoopEcho`)."""
    return yaml.safe_dump(
        {
            "tools": [
                {
                    "class_name": "tests.tools.test_verl_tools.CheckedCalculator",
                    "config": {"type": "native"},
                    "tool_schema": calculator.schema,
                },
                {
                    "class_name": "tests.tools.test_verl_tools.LoopEcho",
                    "config": {"type": "native"},
                    "tool_schema": test_loop.echo.schema,
                },
            ]
        }
    )


class LoopEcho(BaseTool):
    """test_loop's echo as a verl tool."""

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float, dict]:
        del instance_id, kwargs
        return ToolResponse(text=test_loop.echo.fn(parameters["text"])), 0.0, {}


def _loop_rollout(setup: dict[str, Any], tools: ToolExecutor, extras: list[dict]) -> list[Any]:
    """One gather of `QUESTION` episodes, one per sample ``extra`` (its extra_info), on the
    memorised model; the executor is closed afterwards."""
    backend = EmbeddedBackend(setup["engine"], setup["weights"])

    async def go() -> list[Trajectory]:
        ctx = await AgentContext.create(
            backend, setup["tokenizer"], tools, make_parser(setup["parser"]), test_loop.CONFIG
        )
        samples = [
            Sample(f"s{i}", [{"role": "user", "content": QUESTION}], extra=extra)
            for i, extra in enumerate(extras)
        ]
        trajs = await asyncio.gather(*(run_sample(s, ctx) for s in samples))
        await backend.close()
        await tools.close()
        return list(trajs)

    return asyncio.run(go())


@CHATML
@pytest.mark.parametrize("over_http", [False, True], ids=["in_process", "http"])
def test_a_samples_tools_kwargs_reach_create(
    setup: dict[str, Any], tmp_path: Path, over_http: bool
) -> None:
    """Sample.extra (the row's extra_info) -> the agent loop -> the executor (in process, or
    HTTP to `jarl serve-tools`) -> the verl tool's ``create(create_kwargs=...)``: the same
    calculator call is rewarded by each sample's own ground truth."""
    extras = [
        {"index": 0, "tools_kwargs": {"calculator": {"create_kwargs": {"ground_truth": "42"}}}},
        {"index": 1, "tools_kwargs": {"calculator": {"create_kwargs": {"ground_truth": "41"}}}},
        {"index": 2},
        {"index": 3, "tools_kwargs": {"calculator": {"execute_kwargs": {"x": 1}}}},
    ]
    proc = None
    if over_http:
        proc, url = start_server(tmp_path, tools_yaml=_loop_yaml())
        tools: ToolExecutor = HttpTools(url)
    else:
        tools = LocalTools(verl_registry(tmp_path, _loop_yaml()))
    try:
        right, wrong, none, bad = _loop_rollout(setup, tools, extras)
        if over_http:
            assert httpx.get(url + "/metrics").json()["open_trajectories"] == 0
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
    for traj in (right, wrong, none):  # the tool's text is the calculator's: same tokens
        assert traj.prompt_ids + traj.response_ids == setup["expected"][QUESTION][0]
        assert traj.stop_reason == "eos"
    assert [t.turn_rewards for t in (right, wrong, none)] == [[1.0], [0.0], [0.0]]
    assert bad.stop_reason == "agent_error" and bad.error is not None
    assert "extra_info.tools_kwargs['calculator']: ['execute_kwargs'] are not read" in bad.error


# ----------------------------------------------------------------------------- 4: verl-tool


def test_a_verl_tool_client_against_serve_tools(tmp_path: Path) -> None:
    """The requests verl-tool's agent loop sends (``verl_tool/agent_loop/verltool_agent_loop.py``:
    one action per step with the row's extra_info as extra_fields, then a finish), answered
    as its client reads them."""
    proc, url = start_server(tmp_path, tools_yaml=VERL_YAML)
    extra_info = {"index": 0, "tools_kwargs": {"submit": {"create_kwargs": {"ground_truth": "42"}}}}

    def step(traj_id: str, action: str, extra: dict[str, Any] | None = extra_info) -> Any:
        body: dict[str, Any] = {
            "trajectory_ids": [traj_id],
            "actions": [action],
            "finish": [False],
            "is_last_step": [False],
        }
        if extra is not None:
            body["extra_fields"] = [extra]
        return httpx.post(url + "/get_observation", json=body).json()

    def submit(answer: str) -> str:
        call = {"name": "submit", "arguments": {"answer": answer}}
        return f"Let me submit.\n<tool_call>\n{json.dumps(call)}\n</tool_call>"

    def open_trajectories() -> int:
        return int(httpx.get(url + "/metrics").json()["open_trajectories"])

    try:
        assert step("t1", submit("41")) == {
            "observations": [
                {"obs": "<tool_response>\nattempt 1: wrong\n</tool_response>", "reward": 0.0}
            ],
            "dones": [False],
            "valids": [True],
        }
        assert step("t1", submit("42"))["observations"][0] == {
            "obs": "<tool_response>\nattempt 2: correct\n</tool_response>",
            "reward": 1.0,
        }
        echo = '<tool_call>\n{"name": "echo", "arguments": {"text": "hi"}}\n</tool_call>'
        both = step("t2", echo + "\n" + submit("42"), extra=None)  # no tools_kwargs: no truth
        assert both["observations"][0]["obs"] == (
            "<tool_response>\necho-1: hi\n</tool_response>\n"
            "<tool_response>\nattempt 1: wrong\n</tool_response>"
        )
        none, broken = step("t3", "The answer is 42."), step("t3", "<tool_call>{oops</tool_call>")
        assert (none["valids"], none["dones"]) == ([False], [False])
        assert (
            none["observations"][0]["invalid_reason"] == "no tool call found by the hermes parser"
        )
        assert broken["valids"] == [False]
        assert broken["observations"][0]["obs"].startswith(
            "<tool_response>\nerror: the tool call is not valid JSON"
        )
        assert open_trajectories() == 2  # t1, t2 (t3 never reached a tool)
        finish = {
            "trajectory_ids": ["t1"],
            "actions": [""],
            "finish": [True],
            "is_last_step": [True],
        }
        assert httpx.post(url + "/get_observation", json=finish).json() == {
            "observations": [{"obs": "", "reward": None}],
            "dones": [True],
            "valids": [True],
        }
        assert open_trajectories() == 1
        last = {**finish, "trajectory_ids": ["t2"], "actions": [submit("42")], "finish": [False]}
        assert httpx.post(url + "/get_observation", json=last).json()["valids"] == [True]
        assert open_trajectories() == 0  # is_last_step released t2 after its action ran
        mismatched = httpx.post(url + "/get_observation", json={**finish, "finish": [True, True]})
        assert mismatched.status_code == 422
        assert "finish has 2 items for 1 trajectory_ids" in mismatched.text
        unread = {"tools_kwargs": {"submit": {"release_kwargs": {"x": 1}}}}
        refused = httpx.post(
            url + "/get_observation",
            json={"trajectory_ids": ["t4"], "actions": [submit("1")], "extra_fields": [unread]},
        )
        assert refused.status_code == 422 and "['release_kwargs'] are not read" in refused.text
    finally:
        proc.kill()
        proc.wait()


@tool(name="python")
def fake_python(code: str) -> ToolResult:
    """Pretend to run Python code; ``exit()`` ends the trajectory.

    Args:
        code: Python source.
    """
    return ToolResult(f"ran {len(code)} chars", done=code.strip() == "exit()")


class HelperProcess(Tool):
    """A tool that holds a helper process for its lifetime (as the python tool holds its
    sandbox pool) and stops it in ``close``."""

    name = "helper"
    schema: ClassVar[dict[str, Any]] = {
        "type": "function",
        "function": {"name": "helper", "description": "Ask the helper.", "parameters": {}},
    }

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
        )

    async def execute(self, state: Any, arguments: dict[str, Any]) -> ToolResult:
        del state, arguments
        return ToolResult(f"helper {self.proc.pid} is up")

    async def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()  # the helper reads end of file and exits
        await asyncio.to_thread(self.proc.wait)


def test_serve_tools_reads_actions_with_the_parser_it_is_given(tmp_path: Path) -> None:
    """``jarl serve-tools --action-parser llama3_json``: a Llama 3 model's actions are read as
    its tool calls; an unknown parser is refused before the server starts."""
    proc, url = start_server(tmp_path, "--action-parser", "llama3_json", tools_yaml=VERL_YAML)
    action = '{"name": "submit", "parameters": {"answer": "42"}}'
    extra = {"tools_kwargs": {"submit": {"create_kwargs": {"ground_truth": "42"}}}}
    body = {"trajectory_ids": ["t"], "actions": [action], "extra_fields": [extra]}
    try:
        out = httpx.post(url + "/get_observation", json=body).json()
    finally:
        proc.kill()
        proc.wait()
    assert out["valids"] == [True]
    assert out["observations"][0]["reward"] == 1.0
    assert "attempt 1: correct" in out["observations"][0]["obs"]
    cmd = [sys.executable, "-m", "jax_agent_rl.cli", "serve-tools", "--action-parser", "json"]
    refused = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert refused.returncode == 2
    assert refused.stderr.startswith("jarl: --action-parser='json' is not a parser: use one of")


def test_the_action_parser_reads_verl_tool_actions(tmp_path: Path) -> None:
    """``action_parser`` picks how actions are read and observations written; hermes by
    default. A tool that ends the trajectory makes it done."""
    registry = ToolRegistry([fake_python])
    tokenizer = loaded_tokenizer(tmp_path)
    body = {
        "trajectory_ids": ["a", "b"],
        "actions": ["<python>print(1)</python>", "<python>exit()</python>"],
    }

    async def scenario() -> tuple[Any, Any]:
        async with serving(
            create_app(registry, action_parser="python_tag", tokenizer=tokenizer)
        ) as url:
            tagged = (
                await httpx.AsyncClient(timeout=None).post(url + "/get_observation", json=body)
            ).json()
        async with serving(create_app(registry, tokenizer=tokenizer)) as url:
            hermes = (
                await httpx.AsyncClient(timeout=None).post(url + "/get_observation", json=body)
            ).json()
        return tagged, hermes

    tagged, hermes = asyncio.run(scenario())
    assert tagged["observations"] == [
        {"obs": "\n<output>\nran 8 chars\n</output>\n", "reward": 0.0},
        {"obs": "\n<output>\nran 6 chars\n</output>\n", "reward": 0.0},
    ]
    assert (tagged["dones"], tagged["valids"]) == ([False, True], [True, True])
    assert hermes["valids"] == [False, False]  # no <tool_call> in either action


# ----------------------------------------------------------------------------- 6: closing


def test_closing_local_tools_releases_state_and_closes_tools() -> None:
    counter, helper = Counter(), HelperProcess()
    tools = LocalTools(ToolRegistry([counter, helper]))

    async def scenario() -> None:
        assert (await tools.call("open", "count", {})).text == "1"
        assert (await tools.call("open", "helper", {})).text.endswith("is up")
        await tools.close()

    asyncio.run(scenario())
    assert [s["id"] for s in counter.released] == ["open"] and tools.open_trajectories == 0
    assert helper.proc.returncode == 0  # the helper process has exited and was reaped


def test_the_server_closes_its_tools_when_it_stops() -> None:
    helper = HelperProcess()

    async def scenario() -> None:
        async with serving(create_app(ToolRegistry([helper]))) as url:
            assert (await HttpTools(url).call("t", "helper", {})).text.endswith("is up")
            assert helper.proc.poll() is None

    asyncio.run(scenario())
    assert helper.proc.returncode == 0


def _established(port: int) -> int:
    """Established TCP connections whose far end is loopback ``port`` (clients' ends)."""
    rows = [r.split() for r in Path("/proc/net/tcp").read_text().splitlines()[1:]]
    return sum(r[3] == "01" and int(r[2].split(":")[1], 16) == port for r in rows)


def test_http_tools_close_closes_its_connections(tmp_path: Path) -> None:
    proc, url = start_server(tmp_path)
    port = int(url.rsplit(":", 1)[1])
    tools = HttpTools(url)

    async def scenario() -> tuple[int, int]:
        await tools.call("t", "count", {})  # a keep-alive connection stays open
        before = _established(port)
        await tools.close()
        return before, _established(port)

    try:
        assert asyncio.run(scenario()) == (1, 0)
    finally:
        proc.kill()
        proc.wait()


def sandbox_processes() -> list[int]:
    """This process's bubblewrap children (the sandbox pool's workers)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            pid, rest = stat.read_text().split(" (", 1)
            comm, fields = rest.rsplit(") ", 1)
            if comm == "bwrap" and int(fields.split()[1]) == os.getpid():
                out.append(int(pid))
    return out


def test_closing_the_executor_stops_the_sandbox_pool() -> None:
    """The pool's own bubblewrap processes: the process may hold others' (a pool another test
    module keeps open), which this pool neither starts nor stops."""
    others = set(sandbox_processes())
    sandbox = PythonSandbox(size=2, limits=Limits(cpu_s=1, memory_mb=128), timeout_s=5.0)
    tools = LocalTools(ToolRegistry([PythonTool(sandbox)]))

    async def scenario() -> None:
        assert (await tools.call("t", "python", {"code": "print(6 * 7)"})).text == "42"
        assert len(set(sandbox_processes()) - others) == 2
        await tools.close()

    try:
        asyncio.run(scenario())
        assert set(sandbox_processes()) - others == set()
    finally:
        sandbox.close()
