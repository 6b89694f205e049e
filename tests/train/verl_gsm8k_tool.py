"""Test data: a tool module as verl users write them, in the shape of verl's own
``verl/tools/gsm8k_tool.py`` (verl 0.6): the same imports from ``verl.*``, a `BaseTool` subclass
keeping one state per instance id (``create`` / ``execute`` / ``calc_reward`` / ``release``),
``execute`` traced by ``rollout_trace_op`` and scoring through verl's gsm8k rule.

The one difference: the submitted answer is read from ``expression``, the argument of the
calculator the tiny demo checkpoint was taught to call (the tools YAML gives this tool that
schema, so the checkpoint calls it).
"""

from typing import Any
from uuid import uuid4

from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse
from verl.utils.reward_score import gsm8k
from verl.utils.rollout_trace import rollout_trace_op

IMPROVEMENT_PENALTY = -0.05  # a submission that does not beat the previous one


class Gsm8kTool(BaseTool):
    """Scores each submitted answer against the instance's ground truth (gsm8k, flexible)."""

    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema):
        super().__init__(config, tool_schema)
        self._instance_dict: dict[str, dict[str, Any]] = {}

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema:
        return self.tool_schema

    async def create(
        self, instance_id: str | None = None, ground_truth: str | None = None, **kwargs: Any
    ) -> tuple[str, ToolResponse]:
        instance_id = instance_id or str(uuid4())
        if ground_truth is None:
            ground_truth = kwargs.get("create_kwargs", {}).get("ground_truth")
        self._instance_dict[instance_id] = {"response": "", "ground_truth": ground_truth}
        self._instance_dict[instance_id]["reward"] = 0.0
        return instance_id, ToolResponse()

    @rollout_trace_op
    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float, dict]:
        del kwargs
        answer = str(parameters.get("expression", ""))
        state = self._instance_dict[instance_id]
        state["response"] = answer if answer.startswith("#### ") else "#### " + answer
        reward = await self.calc_reward(instance_id)
        tool_reward = 0.0 if reward > state["reward"] else IMPROVEMENT_PENALTY
        state["reward"] = reward
        return ToolResponse(text=f"Current parsed {answer=} {reward=}"), tool_reward, {}

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        del kwargs
        state = self._instance_dict[instance_id]
        return gsm8k.compute_score(
            state["response"], state["ground_truth"], method="flexible", format_score=0.0, score=1.0
        )

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        del kwargs, self._instance_dict[instance_id]
