"""Checkpoints of each family, written once per session by transformers."""

from pathlib import Path

import pytest

from jax_agent_rl.models.hf_local import TINY, write_hf_checkpoint


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {
        name: write_hf_checkpoint(root / name, cfg, seed=i)
        for i, (name, cfg) in enumerate(TINY.items())
    }
