"""The conformance suite's weight-update tests with a LoRA policy, on every backend in
conftest.BACKENDS (each declares `Capabilities.lora` when it serves one): each backend is
started once serving `conftest.lora_policy` (the dense model only), every push is the adapters
alone, and the learner recomputes logprobs with the base and the adapters pushed."""

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import jax
import pytest

from jax_agent_rl.models.adapters import adapters_of
from jax_agent_rl.models.hf_local import TINY_QWEN2, write_hf_checkpoint
from jax_agent_rl.rollout import RolloutBackend
from tests.conformance.conftest import BACKENDS, LORA, Learner, Pushes, lora_policy, run
from tests.conformance.test_conformance import (
    test_request_arriving_during_weight_swap,
    test_update_weights_changes_outputs_and_stamps_versions,
)

__all__ = [  # collected here too, with this module's fixtures
    "test_request_arriving_during_weight_swap",
    "test_update_weights_changes_outputs_and_stamps_versions",
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_hf_checkpoint(tmp_path_factory.mktemp("conformance-lora") / "qwen2", TINY_QWEN2)


@pytest.fixture(scope="module", params=sorted(BACKENDS))
def backend(request: pytest.FixtureRequest, checkpoint: Path) -> Iterator[RolloutBackend]:
    be = BACKENDS[request.param](checkpoint, True)
    yield be
    run(be.close())


@pytest.fixture(scope="module")
def learner(checkpoint: Path) -> Learner:
    """The learner's forward of the LoRA policy: its config carries `LORA`, its weights are
    the base (`Pushes.weights` puts the pushed adapters on it)."""
    learner = Learner(checkpoint)
    learner.cfg = dataclasses.replace(learner.cfg, lora=LORA)
    return learner


@pytest.fixture(scope="module")
def pushes(learner: Learner, checkpoint: Path) -> Pushes:
    """Pushes of adapters alone, starting from those every backend here was started with."""
    return Pushes(learner, adapters_of(lora_policy(checkpoint)[1]))


def test_a_backend_serving_a_lora_policy_declares_it(backend: RolloutBackend) -> None:
    assert backend.capabilities.lora


def test_a_lora_push_moves_the_adapters_alone(backend: RolloutBackend, pushes: Pushes) -> None:
    """Each backend's last push counts the bytes it moved: the adapters' (fp32), not the
    model's."""
    run(backend.update_weights(pushes.start, version=3001))
    adapter_bytes = sum(x.nbytes for x in jax.tree.leaves(pushes.start))
    assert backend.last_push.bytes == adapter_bytes  # type: ignore[attr-defined]
