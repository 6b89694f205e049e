"""A checkpoint's shard index cannot make a load read files outside the checkpoint folder."""

import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest

from jax_agent_rl.models import CheckpointError, ModelConfig, init_params, load_hf, save_hf

INDEX = "model.safetensors.index.json"
CFG = ModelConfig(
    family="qwen2",
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    head_dim=16,
    qkv_bias=True,
    max_position_embeddings=64,
)


@pytest.fixture(scope="module")
def export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A sharded checkpoint written by `save_hf`."""
    folder = tmp_path_factory.mktemp("export") / "ckpt"
    save_hf(folder, CFG, init_params(jax.random.key(0), CFG), max_shard_bytes=20_000)
    assert len(set(json.loads((folder / INDEX).read_text())["weight_map"].values())) > 1
    return folder


@pytest.fixture
def exported(export: Path, tmp_path: Path) -> Path:
    """A copy of `export` of this test's own, a folder inside ``tmp_path``."""
    return Path(shutil.copytree(export, tmp_path / "ckpt"))


def _rename_shard(folder: Path, old: str, new: str) -> None:
    index = json.loads((folder / INDEX).read_text())
    index["weight_map"] = {k: new if v == old else v for k, v in index["weight_map"].items()}
    (folder / INDEX).write_text(json.dumps(index))


def _first_shard(folder: Path) -> str:
    return sorted(set(json.loads((folder / INDEX).read_text())["weight_map"].values()))[0]


@pytest.mark.parametrize("escape", ["relative", "absolute", "nested-relative"])
def test_shards_outside_the_folder_are_refused(exported: Path, escape: str) -> None:
    shard = _first_shard(exported)
    outside = exported.parent / "elsewhere.safetensors"
    shutil.move(exported / shard, outside)  # the tensors exist, only outside the folder
    name = {
        "relative": "../elsewhere.safetensors",
        "absolute": str(outside),
        "nested-relative": "sub/../../elsewhere.safetensors",
    }[escape]
    _rename_shard(exported, shard, name)
    with pytest.raises(CheckpointError) as e:
        load_hf(exported)
    assert repr(name) in str(e.value) and str(exported.resolve()) in str(e.value)


def test_linked_files_load_as_in_the_hf_cache(exported: Path, tmp_path: Path) -> None:
    """The Hugging Face cache keeps a snapshot's files as links to ``../../blobs``: the names
    in the index are plain, and the links they resolve through may point out of the folder."""
    _, before = load_hf(exported)
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    for shard in sorted(set(json.loads((exported / INDEX).read_text())["weight_map"].values())):
        shutil.move(exported / shard, blobs / shard)
        (exported / shard).symlink_to(Path("..") / "blobs" / shard)
    _, after = load_hf(exported)
    leaves, leaves_after = jax.tree.leaves(before), jax.tree.leaves(after)
    assert all(np.array_equal(a, b) for a, b in zip(leaves, leaves_after, strict=True))
