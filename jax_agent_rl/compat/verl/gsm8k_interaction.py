"""verl's own GSM8K interaction, ``verl.interactions.gsm8k_interaction.Gsm8kInteraction``: the
class verl's GSM8K interaction YAML (``gsm8k_interaction_config.yaml``) names, so that file
runs here unchanged (the `verl` shim serves this class under verl's module name)."""

from __future__ import annotations

import uuid
from typing import Any

from jax_agent_rl.compat.verl.interaction import BaseInteraction
from jax_agent_rl.compat.verl.rules import gsm8k_score

CORRECT = "Your response is correct!"
INCORRECT = "Your response is incorrect! You need to reflect on your answer and try again."


class Gsm8kInteraction(BaseInteraction):
    """After each model turn, scores the last assistant message by verl's gsm8k rule (strict
    ``#### N``): right ends the episode with reward 1.0, wrong asks the model to try again."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(config)
        self._instances: dict[str, dict[str, Any]] = {}

    async def start_interaction(
        self, instance_id: str | None = None, ground_truth: Any = None, **kwargs: Any
    ) -> str:
        del kwargs
        instance_id = instance_id or str(uuid.uuid4())
        self._instances[instance_id] = {"response": "", "ground_truth": ground_truth}
        return instance_id

    async def generate_response(
        self, instance_id: str, messages: list[dict[str, Any]], **kwargs: Any
    ) -> tuple[bool, str, float, dict[str, Any]]:
        del kwargs
        said = [m.get("content") for m in messages if m.get("role") == "assistant"]
        self._instances[instance_id]["response"] = said[-1] if said else ""
        reward = await self.calculate_score(instance_id)
        right = reward == 1.0
        return right, CORRECT if right else INCORRECT, reward, {}

    async def calculate_score(self, instance_id: str | None = None, **kwargs: Any) -> float:
        del kwargs
        state = self._instances[str(instance_id)]
        return gsm8k_score(state["response"], state["ground_truth"])

    async def finalize_interaction(self, instance_id: str | None = None, **kwargs: Any) -> None:
        del kwargs
        self._instances.pop(str(instance_id), None)
