"""The `verl` shim (jax_agent_rl.compat.verl.shim): without verl, the names verl tool,
interaction and reward modules import are ours under verl's module names, and every other
``verl.*`` is an ImportError naming the shim. That a real verl anywhere on ``sys.path`` wins is
checked where it costs no extra process: tests/train/test_verl_tool_module.py trains in a process
that appends the real verl (``.verl-ref``) to ``sys.path`` after importing jax_agent_rl.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jax_agent_rl.compat.verl import rules as verl_rules
from jax_agent_rl.compat.verl import shim
from jax_agent_rl.compat.verl import tools as tools_verl
from jax_agent_rl.compat.verl.gsm8k_interaction import CORRECT, INCORRECT, Gsm8kInteraction
from jax_agent_rl.compat.verl.gsm8k_tool import Gsm8kTool
from jax_agent_rl.compat.verl.interaction import BaseInteraction, load_interactions

ROOT = Path(__file__).resolve().parents[2]
shim.install()  # the one-liner for code importing verl's modules directly

# module -> {name verl's module has: our object}
SERVED = {
    "verl.tools.base_tool": {
        "BaseTool": tools_verl.BaseTool,
        "OpenAIFunctionToolSchema": tools_verl.OpenAIFunctionToolSchema,
        "ToolResponse": tools_verl.ToolResponse,
    },
    "verl.tools.schemas": {
        name: getattr(tools_verl, name)
        for name in (
            "OpenAIFunctionPropertySchema",
            "OpenAIFunctionParametersSchema",
            "OpenAIFunctionSchema",
            "OpenAIFunctionToolSchema",
            "OpenAIFunctionParsedSchema",
            "OpenAIFunctionCallSchema",
            "OpenAIFunctionToolCall",
            "ToolResponse",
        )
    },
    "verl.tools.function_tool": {"function_tool": tools_verl.function_tool},
    "verl.tools.gsm8k_tool": {"Gsm8kTool": Gsm8kTool},
    "verl.utils.reward_score": {"default_compute_score": verl_rules.default_compute_score},
    "verl.utils.reward_score.gsm8k": {
        "compute_score": verl_rules.gsm8k_score,
        "extract_solution": verl_rules.gsm8k_answer,
    },
    "verl.utils.reward_score.math_reward": {"compute_score": verl_rules.math_score},
    "verl.utils.reward_score.math_dapo": {"compute_score": verl_rules.dapo_score},
    "verl.utils.reward_score.search_r1_like_qa_em": {"compute_score": verl_rules.qa_em_score},
    "verl.interactions.base": {"BaseInteraction": BaseInteraction},
    "verl.interactions.gsm8k_interaction": {"Gsm8kInteraction": Gsm8kInteraction},
}


def test_the_shim_serves_our_implementations_under_verls_names() -> None:
    assert set(SERVED) | {"verl.utils.rollout_trace"} == set(shim.PROVIDED)
    for module, names in SERVED.items():
        loaded = importlib.import_module(module)
        assert shim.is_shim(sys.modules["verl"])
        for name, ours in names.items():
            assert getattr(loaded, name) is ours, f"{module}.{name}"


def test_rollout_trace_op_keeps_a_method_as_it_is() -> None:
    from verl.utils.rollout_trace import rollout_trace_op

    class Tool:
        @rollout_trace_op
        async def execute(self, x: int) -> tuple[int, float]:
            return x, 0.5

        @rollout_trace_op
        def name(self) -> str:
            return "t"

    assert inspect.iscoroutinefunction(Tool.execute)
    assert asyncio.run(Tool().execute(3)) == (3, 0.5) and Tool().name() == "t"


def test_verls_parsed_call_schema_decodes_arguments() -> None:
    from verl.tools.schemas import OpenAIFunctionCallSchema, OpenAIFunctionParsedSchema

    def decode(arguments: str) -> tuple[dict, bool]:
        parsed = OpenAIFunctionParsedSchema(name="f", arguments=arguments)
        call, failed = OpenAIFunctionCallSchema.from_openai_function_parsed_schema(parsed)
        assert call.name == "f"
        return call.arguments, failed

    assert decode('{"a": 1}') == ({"a": 1}, False)
    assert decode("[1]") == ({}, True) and decode("{") == ({}, True)


@pytest.mark.parametrize(
    ("module", "missing"),
    [
        ("verl.protocol", "verl.protocol"),
        ("verl.trainer.main_ppo", "verl.trainer"),  # the first package the shim lacks
        ("verl.workers", "verl.workers"),
        ("verl.tools.search_tool", "verl.tools.search_tool"),
    ],
)
def test_what_the_shim_lacks_is_an_import_error_naming_it(module: str, missing: str) -> None:
    importlib.import_module("verl.tools")  # the shim's verl is the one imported
    with pytest.raises(ImportError) as e:
        importlib.import_module(module)
    assert str(e.value).startswith("jax_agent_rl's verl shim provides only verl.tools.base_tool")
    assert str(e.value).endswith(f"; install verl for {missing}")


class Echo(BaseInteraction):
    """A verl interaction, as it subclasses verl's base class."""

    async def generate_response(
        self, instance_id: str, messages: list[dict], **kwargs: object
    ) -> tuple[bool, str, float, dict]:
        del instance_id, kwargs
        return True, messages[-1]["content"], 1.0, {}


def test_an_interaction_subclassing_verls_base_loads(tmp_path: Path) -> None:
    from verl.interactions.base import BaseInteraction as VerlBase

    assert VerlBase is BaseInteraction
    path = tmp_path / "interaction.yaml"
    path.write_text(
        "interaction:\n  - name: echo\n    class_name: tests.tools.test_verl_shim.Echo\n"
        "    config: {k: 1}\n"
    )
    echo = load_interactions(str(path))["echo"]
    assert echo.config == {"k": 1, "name": "echo"} and echo.name == "echo"
    assert asyncio.run(echo.start_interaction()) != asyncio.run(echo.start_interaction())
    reply = asyncio.run(echo.generate_response("i", [{"role": "assistant", "content": "hi"}]))
    assert reply == (True, "hi", 1.0, {})
    with pytest.raises(NotImplementedError, match="BaseInteraction must implement"):
        asyncio.run(BaseInteraction({}).generate_response("i", []))


def test_verls_own_gsm8k_interaction_yaml_runs_unchanged(tmp_path: Path) -> None:
    """verl's gsm8k_interaction_config.yaml, as verl ships it; the class it names answers as
    verl 0.6's ``Gsm8kInteraction`` does (the replies below were recorded from it)."""
    path = tmp_path / "gsm8k_interaction_config.yaml"
    path.write_text(
        'interaction:\n  - name: "gsm8k"\n'
        '    class_name: "verl.interactions.gsm8k_interaction.Gsm8kInteraction"\n'
        "    config: {}\n"
    )
    gsm8k = load_interactions(str(path))["gsm8k"]

    async def episode(truth: str, turns: list[str]) -> list[tuple]:
        iid = await gsm8k.start_interaction(None, ground_truth=truth)
        messages: list[dict] = [{"role": "user", "content": "#### " + truth}]  # never read
        replies = []
        for turn in turns:
            messages.append({"role": "assistant", "content": turn})
            replies.append(await gsm8k.generate_response(iid, messages))
        replies.append(await gsm8k.calculate_score(iid))
        await gsm8k.finalize_interaction(iid)
        return replies

    wrong, right = (False, INCORRECT), (True, CORRECT)
    assert asyncio.run(episode("15", ["The answer is 15", "#### 15.0", "#### 15"])) == [
        (*wrong, 0, {}),  # no `#### N`: verl's int 0
        (*wrong, 0.0, {}),
        (*right, 1.0, {}),
        1.0,
    ]
    assert asyncio.run(episode("1500", ["#### 1,500"])) == [(*right, 1.0, {}), 1.0]


def _python(code: str, pythonpath: list[Path], cwd: Path) -> str:
    """``code`` run by this environment's Python in a fresh process in ``cwd``; its stdout."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, pythonpath))}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_verl_is_not_importable_merely_in_the_environment() -> None:
    """No start-up hook and no ``import jax_agent_rl`` turns the shim on: where verl is not
    installed, ``import verl`` fails as it should; the documented one-liner turns it on."""
    out = _python(
        "import jax_agent_rl\n"
        "try:\n    import verl\nexcept ImportError:\n    print('refused')\n"
        "import jax_agent_rl.compat.verl.shim as shim; shim.install()\n"
        "import verl.tools.base_tool, verl\nprint(verl.__file__)",
        [ROOT],
        cwd=ROOT,
    )
    assert out.splitlines() == [
        "refused",
        str(ROOT / "jax_agent_rl" / "compat" / "verl" / "shim" / "verl" / "__init__.py"),
    ]


def test_a_verl_folder_in_the_working_directory_is_refused_in_one_line(tmp_path: Path) -> None:
    """A folder named verl where jarl runs comes before the shim (the working directory is
    importable, as under ``python -m``); verl's own interaction YAML then gets one line naming
    the folder and the key, not ``No module named 'verl.interactions'``."""
    (tmp_path / "verl").mkdir()
    (tmp_path / "verl" / "notes.txt").write_text("a user's folder")
    (tmp_path / "i.yaml").write_text(
        "interaction:\n  - name: gsm8k\n"
        "    class_name: verl.interactions.gsm8k_interaction.Gsm8kInteraction\n"
    )
    out = _python(
        "from jax_agent_rl.usercode.load import working_directory_importable\n"
        "from jax_agent_rl.config.errors import ConfigError\n"
        "from jax_agent_rl.compat.verl.interaction import load_interactions\n"
        "working_directory_importable()\n"
        "try:\n    load_interactions('i.yaml')\nexcept ConfigError as e:\n    print(e)",
        [ROOT],
        cwd=tmp_path,
    )
    assert len(out.splitlines()) == 1, out
    assert out.startswith("env.interaction_config='i.yaml': interaction 0 (gsm8k) class_name=")
    assert f"{str(tmp_path / 'verl')!r} in the working directory was imported as verl" in out


def test_a_verl_user_module_loaded_by_a_config_gets_the_shim(tmp_path: Path) -> None:
    """A reward file importing verl's helpers (``data.reward: file.py:fn``) runs unchanged in a
    process where nothing turned the shim on before."""
    (tmp_path / "score.py").write_text(
        "from verl.utils.reward_score import gsm8k\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return gsm8k.compute_score(solution_str, ground_truth)\n"
    )
    out = _python(
        "from jax_agent_rl.usercode.load import load_function\n"
        "fn = load_function('score.py:compute_score', 'data.reward')\n"
        "print(fn('openai/gsm8k', '#### 7', '7'))",
        [ROOT],
        cwd=tmp_path,
    )
    assert out.splitlines() == ["1.0"]
