"""The trainer's tool executor (`make_tools`): a token-protected `jarl serve-tools` is reached
with the token from the environment variable ``tools.token_env`` names, and refused without
it; in-process tools otherwise; and the executor closes."""

import asyncio
import dataclasses
from pathlib import Path

import pytest

from jax_agent_rl.config import ConfigError, ToolsSection
from jax_agent_rl.tools.base import ToolExecutor
from jax_agent_rl.tools.calculator import calculator
from jax_agent_rl.tools.client import HttpTools
from jax_agent_rl.tools.registry import LocalTools, ToolRegistry, ToolTransportError
from jax_agent_rl.train.build import make_tools
from tests.tools.test_server import start_server


async def _names_then_close(tools: ToolExecutor) -> list[str]:
    try:
        return [s["function"]["name"] for s in await tools.schemas()]
    finally:
        await tools.close()


def test_a_token_protected_server_is_reached_with_the_token_from_the_environment(
    tmp_path: Path,
) -> None:
    proc, url = start_server(tmp_path, "--host", "127.0.0.1", "--token", "s3cret")
    remote = ToolsSection(server_url=url, token_env="JARL_TOOLS_TOKEN")
    try:
        tools = make_tools(remote, ToolRegistry(), {"JARL_TOOLS_TOKEN": "s3cret"})
        assert isinstance(tools, HttpTools)
        assert asyncio.run(_names_then_close(tools)) == ["calculator", "count", "crash", "slow"]
        no_token = make_tools(dataclasses.replace(remote, token_env=""), ToolRegistry(), {})
        with pytest.raises(ToolTransportError, match="answered 401"):
            asyncio.run(_names_then_close(no_token))
        wrong = make_tools(remote, ToolRegistry(), {"JARL_TOOLS_TOKEN": "guess"})
        with pytest.raises(ToolTransportError, match="answered 401"):
            asyncio.run(_names_then_close(wrong))
    finally:
        proc.kill()
        proc.wait()


def test_token_env_must_name_a_set_variable_and_needs_a_server() -> None:
    remote = ToolsSection(server_url="http://127.0.0.1:1", token_env="JARL_TOOLS_TOKEN")
    for environ in ({}, {"JARL_TOOLS_TOKEN": ""}):
        with pytest.raises(ConfigError, match="'JARL_TOOLS_TOKEN': that environment variable"):
            make_tools(remote, ToolRegistry(), environ)
    with pytest.raises(ConfigError, match=r"tools\.token_env is set but tools\.server_url is not"):
        make_tools(ToolsSection(token_env="JARL_TOOLS_TOKEN"), ToolRegistry(), {})


def test_without_a_server_the_registry_runs_in_process() -> None:
    tools = make_tools(ToolsSection(timeout_s=5.0), ToolRegistry([calculator]), {})
    assert isinstance(tools, LocalTools) and tools.timeout_s == 5.0
    assert asyncio.run(_names_then_close(tools)) == ["calculator"]
