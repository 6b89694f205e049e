"""verl's own GSM8K tool, ``verl.tools.gsm8k_tool.Gsm8kTool``: the class verl's GSM8K tool YAML
(``gsm8k_tool_config.yaml``) names, so that file runs here unchanged (the `verl` shim serves
this class under verl's module name). Apart from `jax_agent_rl.compat.verl.tools`, which is
verl's tool API, not one of its tools."""

from __future__ import annotations

import uuid
from typing import Any

from jax_agent_rl.compat.verl.rules import gsm8k_score
from jax_agent_rl.compat.verl.tools import BaseTool, OpenAIFunctionToolSchema, ToolResponse


class Gsm8kTool(BaseTool):
    """verl's own ``verl.tools.gsm8k_tool.Gsm8kTool``, the class verl's GSM8K tool YAML
    (``gsm8k_tool_config.yaml``) names: the model submits ``answer``, scored against the
    instance's ground truth by verl's gsm8k rule (flexible, ``#### `` prepended); the tool
    reward is 0.0 for a submission that beats the previous one and -0.05 otherwise."""

    def __init__(self, config: dict[str, Any], tool_schema: OpenAIFunctionToolSchema | None):
        super().__init__(config, tool_schema)
        self._instances: dict[str, dict[str, Any]] = {}

    async def create(
        self, instance_id: str | None = None, ground_truth: Any = None, **kwargs: Any
    ) -> tuple[str, ToolResponse]:
        instance_id = instance_id or str(uuid.uuid4())
        if ground_truth is None:
            ground_truth = kwargs.get("create_kwargs", {}).get("ground_truth")
        self._instances[instance_id] = {"response": "", "ground_truth": ground_truth, "reward": 0.0}
        return instance_id, ToolResponse()

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float, dict[str, Any]]:
        del kwargs
        answer = parameters.get("answer", "")
        answer = answer if isinstance(answer, str) else str(answer)
        state = self._instances[instance_id]
        state["response"] = answer if answer.startswith("#### ") else "#### " + answer
        reward = await self.calc_reward(instance_id)
        tool_reward = 0.0 if reward > state["reward"] else -0.05
        state["reward"] = reward
        return ToolResponse(text=f"Current parsed {answer=} {reward=}"), tool_reward, {}

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        del kwargs
        state = self._instances[instance_id]
        return gsm8k_score(state["response"], state["ground_truth"], method="flexible")

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        del kwargs
        self._instances.pop(instance_id, None)
