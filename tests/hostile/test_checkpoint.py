"""What comes with a checkpoint folder cannot hang a run, exhaust its memory or make a load
read outside the folder: a shard index naming files elsewhere, a FIFO, device or folder in place
of a file, a config.json with absurd sizes, and a safetensors header that disagrees with its
file each fail at once, with an error naming the file and the problem, before any tensor data is
read or allocated.

A hostile PEFT adapter folder (`load_peft`): ``r: 4.9`` loaded as rank 4 and ``r: true`` as 1,
NaN or infinite adapters loaded silently (every logit of their layers NaN), integer tensors
were cast; a malformed config (not JSON, a list, ``r: "abc"``, a missing key, a nested list
of targets) and a file that is no safetensors file raised JSONDecodeError, AttributeError,
ValueError, KeyError, TypeError or SafetensorError without naming the file. Each is a
`CheckpointError` naming the file, the header checked before any tensor is read (as for a
base checkpoint: `checkpoint.stored_tensors`)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jax_agent_rl.models import (
    CheckpointError,
    ModelConfig,
    UnsupportedConfigError,
    init_params,
    load_hf,
    save_hf,
)
from jax_agent_rl.models import checkpoint as checkpoint_module
from jax_agent_rl.models.adapters import add_lora, load_peft, save_peft
from jax_agent_rl.models.lora import Lora
from jax_agent_rl.models.sharding import one_device_sharder
from jax_agent_rl.tokenization import Tokenizer, chat_template, save_tokenizer, train_bpe
from tests.tokenization.test_tokenizer import CORPUS

pytestmark = pytest.mark.timeout(120)  # a second guard: a hang fails the test

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
    save_hf(
        folder,
        CFG,
        init_params(jax.random.key(0), CFG, sharder=one_device_sharder()),
        max_shard_bytes=20_000,
    )
    assert len(set(json.loads((folder / INDEX).read_text())["weight_map"].values())) > 1
    return folder


@pytest.fixture
def exported(export: Path, tmp_path: Path) -> Path:
    """A copy of `export` of this test's own, a folder inside ``tmp_path``."""
    return Path(shutil.copytree(export, tmp_path / "ckpt"))


@pytest.fixture(scope="module")
def export_single(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-file checkpoint (``model.safetensors``) written by `save_hf`."""
    folder = tmp_path_factory.mktemp("export") / "ckpt"
    save_hf(folder, CFG, init_params(jax.random.key(0), CFG, sharder=one_device_sharder()))
    return folder


@pytest.fixture
def single(export_single: Path, tmp_path: Path) -> Path:
    """A copy of `export_single` of this test's own."""
    return Path(shutil.copytree(export_single, tmp_path / "single"))


@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tokenizer(
        tmp_path_factory.mktemp("tok"), train_bpe(CORPUS, 300), chat_template("chatml_tools")
    )


def _rename_shard(folder: Path, old: str, new: str) -> None:
    index = json.loads((folder / INDEX).read_text())
    index["weight_map"] = {k: new if v == old else v for k, v in index["weight_map"].items()}
    (folder / INDEX).write_text(json.dumps(index))


def _first_shard(folder: Path) -> str:
    return sorted(set(json.loads((folder / INDEX).read_text())["weight_map"].values()))[0]


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("[" * 100_000, "is not JSON: maximum recursion depth"),  # a RecursionError traceback
        ("{'weight_map': {}}", "is not JSON: Expecting property name"),  # named no file
        (b"\xff\xfe", "is not JSON"),
    ],
    ids=["deep", "not JSON", "not UTF-8"],
)
def test_a_shard_index_that_is_no_json_names_its_file(
    exported: Path, text: str | bytes, named: str
) -> None:
    index = exported / INDEX
    index.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(CheckpointError) as e:
        load_hf(exported, sharder=one_device_sharder())
    assert e.type is CheckpointError and str(index) in str(e.value) and named in str(e.value)


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
        load_hf(exported, sharder=one_device_sharder())
    assert repr(name) in str(e.value) and str(exported.resolve()) in str(e.value)


def test_linked_files_load_as_in_the_hf_cache(exported: Path, tmp_path: Path) -> None:
    """The Hugging Face cache keeps a snapshot's files as links to ``../../blobs``: the names
    in the index are plain, and the links they resolve through may point out of the folder."""
    _, before = load_hf(exported, sharder=one_device_sharder())
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    for shard in sorted(set(json.loads((exported / INDEX).read_text())["weight_map"].values())):
        shutil.move(exported / shard, blobs / shard)
        (exported / shard).symlink_to(Path("..") / "blobs" / shard)
    _, after = load_hf(exported, sharder=one_device_sharder())
    leaves, leaves_after = jax.tree.leaves(before), jax.tree.leaves(after)
    assert all(np.array_equal(a, b) for a, b in zip(leaves, leaves_after, strict=True))


# -- files that are no regular file ------------------------------------------------------------


# Run in a process of its own: code blocked opening a FIFO from C or Rust (safetensors) holds
# the GIL and retries the interrupted call, so no thread or alarm of the test's could free it.
_RELEASE = """
import os, sys, time
while True:
    try:  # succeeds only while a reader waits on the FIFO; closing it gives that reader EOF
        os.close(os.open(sys.argv[1], os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass
    time.sleep(0.05)
"""


@contextlib.contextmanager
def _unblocked(fifo: Path) -> Iterator[None]:
    """While the block runs, a reader that opens ``fifo`` soon gets end of file, so code that
    opens it fails instead of hanging (then the test fails, on the error it did not expect)."""
    if not fifo.is_fifo():
        yield
        return
    release = subprocess.Popen([sys.executable, "-I", "-c", _RELEASE, str(fifo)])
    try:
        yield
    finally:
        release.kill()
        release.wait()


def _replace_with(path: Path, kind: str) -> None:
    """Puts a FIFO, a folder or a device (through a link, as the HF cache links its files)
    where ``path`` was."""
    if path.exists():
        path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "folder":
        path.mkdir()
    else:
        path.symlink_to("/dev/zero")


KINDS = ["fifo", "folder", "device"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    ("layout", "file", "error"),
    [
        ("sharded", "config.json", ValueError),
        ("sharded", INDEX, CheckpointError),
        ("sharded", "shard", CheckpointError),
        ("single", "model.safetensors", CheckpointError),
    ],
)
def test_checkpoint_files_must_be_regular_files(
    exported: Path, single: Path, layout: str, file: str, error: type, kind: str
) -> None:
    folder = exported if layout == "sharded" else single
    target = folder / (_first_shard(folder) if file == "shard" else file)
    _replace_with(target, kind)
    with _unblocked(target), pytest.raises(ValueError) as e:
        load_hf(folder, sharder=one_device_sharder())
    assert e.type is error
    assert f"{target} is not a regular file" in str(e.value)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("file", ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"])
def test_tokenizer_files_must_be_regular_files(
    tokenizer_folder: Path, tmp_path: Path, file: str, kind: str
) -> None:
    folder = Path(shutil.copytree(tokenizer_folder, tmp_path / "tok"))
    _replace_with(folder / file, kind)
    with _unblocked(folder / file), pytest.raises(ValueError) as e:
        Tokenizer.from_pretrained(folder)
    assert e.type is ValueError
    assert f"{folder / file} is not a regular file" in str(e.value)


# -- config.json with absurd sizes -------------------------------------------------------------


def _no_read(*_: Any, **__: Any) -> None:
    raise AssertionError("tensor data was read before the checkpoint was checked")


@pytest.mark.parametrize(
    ("patch", "named"),
    [
        ({"vocab_size": 10**12}, "vocab_size=1000000000000 is not a size"),
        ({"hidden_size": -32}, "hidden_size=-32 is not a size"),
        ({"num_hidden_layers": 10**6}, "num_hidden_layers (num_layers)=1000000 is not a size"),
        ({"num_attention_heads": 10**9}, "num_attention_heads=1000000000 is not a size"),
        ({"num_attention_heads": 3, "head_dim": None}, "is not a multiple of num_attention_heads"),
        ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads=3"),
        ({"head_dim": 10**9}, "head_dim=1000000000 is not a size"),
        ({"intermediate_size": "64"}, "intermediate_size='64' is not a size"),
        ({"max_position_embeddings": 10**12}, "max_position_embeddings=1000000000000"),
        ({"rms_norm_eps": 0}, "rms_norm_eps=0: expected a finite number above 1.17549e-38"),
        ({"rope_parameters": {"rope_theta": float("inf")}}, "rope_theta=inf: expected a finite"),
        ({"tie_word_embeddings": "yes"}, "tie_word_embeddings='yes': expected true or false"),
        (
            {
                "rope_parameters": {
                    "rope_theta": 5e5,
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 4.0,
                    "high_freq_factor": 1.0,
                    "original_max_position_embeddings": 8192,
                }
            },
            "high_freq_factor=1.0 must exceed low_freq_factor=4.0",
        ),
    ],
)
def test_absurd_config_sizes_fail_before_anything_is_read(
    single: Path, monkeypatch: pytest.MonkeyPatch, patch: dict[str, Any], named: str
) -> None:
    config = single / "config.json"
    hf = json.loads(config.read_text())
    hf.update(patch)
    config.write_text(json.dumps({k: v for k, v in hf.items() if v is not None}))
    monkeypatch.setattr(checkpoint_module, "safe_open", _no_read)
    with pytest.raises(UnsupportedConfigError) as e:
        load_hf(single, sharder=one_device_sharder())
    assert e.type is UnsupportedConfigError
    assert str(e.value).startswith(f"{config}: ") and named in str(e.value)


# -- safetensors headers that disagree with their file -----------------------------------------

Header = dict[str, Any]


def _layer_q(i: int) -> str:
    return f"model.layers.{i}.self_attn.q_proj.weight"


def _past_the_end(header: Header, data: bytes) -> tuple[Header, bytes, int | None]:
    last = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"])
    begin, end = header[last]["data_offsets"]
    header[last]["data_offsets"] = [begin + 4096, end + 4096]
    return header, data, None


def _shape_not_span(header: Header, data: bytes) -> tuple[Header, bytes, int | None]:
    header["model.embed_tokens.weight"]["shape"] = [10**6, 10**6]  # 4 TB claimed
    return header, data, None


def _overlapping(header: Header, data: bytes) -> tuple[Header, bytes, int | None]:
    header[_layer_q(1)]["data_offsets"] = header[_layer_q(0)]["data_offsets"]  # same shape
    return header, data, None


def _trailing(header: Header, data: bytes) -> tuple[Header, bytes, int | None]:
    return header, data + bytes(64), None


def _length(n: int) -> Callable[[Header, bytes], tuple[Header, bytes, int | None]]:
    return lambda header, data: (header, data, n)


def _dtype(header: Header, data: bytes) -> tuple[Header, bytes, int | None]:
    header["model.norm.weight"]["dtype"] = "I64"
    return header, data, None


def _many_dims(header: Header, data: bytes) -> tuple[Header, bytes, int | None]:
    header["model.norm.weight"]["shape"] = [2**62] * 10_000  # a slow product to compute
    return header, data, None


def _metadata_list(header: Header, data: bytes) -> tuple[Header, bytes, int | None]:
    header["__metadata__"] = [1]  # the safetensors library's traceback when it read the data
    return header, data, None


def _negative_dim(header: Header, data: bytes) -> tuple[Header, bytes, int | None]:
    header["model.norm.weight"]["shape"] = [-32]
    return header, data, None


@pytest.mark.parametrize(
    ("attack", "named"),
    [
        (_past_the_end, "claims bytes"),
        (_shape_not_span, "'model.embed_tokens.weight' (F32, shape (1000000, 1000000)) claims"),
        (_overlapping, f"tensor {_layer_q(1)!r} starts at byte"),
        (_trailing, "the tensors end at byte"),
        (_length(10**6), "its header length 1000000 does not fit its"),
        (_length(2**63), f"its header length {2**63} does not fit its"),
        (_dtype, "tensor 'model.norm.weight' is stored as 'I64'"),
        (_many_dims, "tensor 'model.norm.weight' has a malformed header entry"),
        (_negative_dim, "tensor 'model.norm.weight' has a malformed header entry"),
        (_metadata_list, "the safetensors header's __metadata__ is [1]: expected an object"),
    ],
    ids=lambda x: getattr(x, "__name__", None),
)
def test_safetensors_headers_are_checked_before_any_data_is_read(
    single: Path,
    monkeypatch: pytest.MonkeyPatch,
    attack: Callable[[Header, bytes], tuple[Header, bytes, int | None]],
    named: str,
) -> None:
    file = single / "model.safetensors"
    raw = file.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header, data, length = attack(json.loads(raw[8 : 8 + n]), raw[8 + n :])
    text = json.dumps(header).encode()
    file.write_bytes((len(text) if length is None else length).to_bytes(8, "little") + text + data)
    monkeypatch.setattr(checkpoint_module, "safe_open", _no_read)
    with pytest.raises(CheckpointError) as e:
        load_hf(single, sharder=one_device_sharder())
    assert e.type is CheckpointError
    assert str(file) in str(e.value) and named in str(e.value)


def test_a_header_over_the_size_limit_is_not_read(
    single: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 200 MB file (sparse: it takes no room) whose header claims 150 MB of JSON."""
    file = single / "model.safetensors"
    with file.open("wb") as f:
        f.write((150 * 2**20).to_bytes(8, "little"))
        f.truncate(200 * 2**20)
    monkeypatch.setattr(checkpoint_module, "safe_open", _no_read)
    with pytest.raises(CheckpointError) as e:
        load_hf(single, sharder=one_device_sharder())
    assert e.type is CheckpointError
    assert f"{file} is not a safetensors file" in str(e.value) and "over 104857600" in str(e.value)


def test_header_shapes_are_checked_against_the_config_before_any_data_is_read(
    single: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = single / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "vocab_size": 65}))
    monkeypatch.setattr(checkpoint_module, "safe_open", _no_read)
    with pytest.raises(CheckpointError) as e:
        load_hf(single, sharder=one_device_sharder())
    assert e.type is CheckpointError
    assert "'model.embed_tokens.weight' has shape (64, 32), config implies (65, 32)" in str(e.value)


# --- a run's orbax checkpoints ---------------------------------------------------------------


def _cut(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@pytest.mark.parametrize(
    ("damage", "part"),
    [
        (_cut, "meta/metadata"),  # orbax raised a bare JSONDecodeError
        (_cut, "policy/_METADATA"),
        (lambda p: p.unlink(), "policy/manifest.ocdbt"),  # a ValueError quoting TensorStore
        (_cut, "policy/ocdbt.process_0/d/*"),  # a plain Exception: eval's check missed it
    ],
)
def test_a_damaged_run_checkpoint_is_an_error_naming_its_folder(
    tmp_path: Path, damage: Callable[[Path], None], part: str
) -> None:
    """A complete checkpoint whose file was later cut short or removed (a copy interrupted, a
    disk filled): restoring it raised orbax's own error, which names neither the checkpoint
    nor its step (a bare ``Expecting value: line 1 column 1``), and one of them is no
    ValueError, so ``jarl eval`` and ``jarl export`` printed a traceback. Now it is a
    `CheckpointError` naming the step's folder, for the whole state and for the policy's
    parameters alone."""
    from jax_agent_rl.train.checkpoints import RunCheckpoints

    state = {"w": np.arange(4096, dtype=np.float32), "b": np.ones(8, np.float32)}
    checkpoints = RunCheckpoints(tmp_path, keep=2)
    checkpoints.save(3, {"policy": state}, {"step": 3})
    checkpoints.close()
    for path in (tmp_path / "3").glob(part):  # the data files: every one of them
        damage(path)
    checkpoints = RunCheckpoints(tmp_path, keep=2)
    target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in state.items()}
    folder = f"checkpoint of step 3 ({tmp_path / '3'}) cannot be restored"
    try:
        with pytest.raises(CheckpointError, match=re.escape(folder)):
            checkpoints.restore(3, {"policy": target})
        if part != "meta/metadata":  # (the policy alone does not read the metadata)
            with pytest.raises(CheckpointError, match=re.escape(folder)):
                checkpoints.restore_part(3, "policy", target)
    finally:
        checkpoints.close()


TINY = ModelConfig(
    family="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
    num_heads=2, num_kv_heads=1, head_dim=16, max_position_embeddings=128,
)  # fmt: skip


@pytest.fixture(scope="module")
def peft_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A PEFT adapter folder of rank 4 on q and v of `TINY`, as `save_peft` writes it."""
    cfg, w = add_lora(
        jax.random.key(1),
        TINY,
        init_params(jax.random.key(0), TINY, sharder=one_device_sharder()),
        Lora(4, 8.0, ("q", "v")),
    )
    return save_peft(tmp_path_factory.mktemp("peft") / "adapter", cfg, w)


HOSTILE_PEFT: dict[str, tuple[Any, str]] = {
    # name: (a change to the folder, what the error says after the file's name)
    "r-not-a-number": ({"r": "abc"}, r"adapter_config.json: r='abc': expected a whole number"),
    "r-a-fraction": ({"r": 4.9}, r"adapter_config.json: r=4.9: expected a whole number"),
    "r-a-bool": ({"r": True}, r"adapter_config.json: r=True: expected a whole number"),
    "r-missing": ({"r": None}, r"adapter_config.json: r=None: expected a whole number"),
    "r-huge": ({"r": 10**12}, r"adapter_config.json: LoRA rank=1000000000000 exceeds the v "),
    "alpha-a-list": ({"lora_alpha": [8]}, r"adapter_config.json: lora_alpha=\[8\]: expected a "),
    "task-type-classifier": (
        {"task_type": "SEQ_CLS"},
        r"adapter_config.json: task_type='SEQ_CLS' is not supported \('CAUSAL_LM'\)",
    ),
    # an int past a float's range: OverflowError, a traceback in jarl train and eval
    "alpha-400-digits": (
        {"lora_alpha": 10**400},
        r"adapter_config.json: lora_alpha=10{79}: not a finite number",
    ),
    "targets-nested": ({"target_modules": [["q_proj"]]}, r"adapter_config.json: target_modules="),
    "config-a-list": (b"[1, 2]", r"adapter_config.json is not a JSON object"),
    "config-not-json": (b"{r: 4", r"adapter_config.json is not JSON: "),
    "weights-nan": (np.nan, r"adapter_model.safetensors: tensor '.*' holds values not finite"),
    "weights-inf": (-np.inf, r"adapter_model.safetensors: tensor '.*' holds values not finite"),
    "weights-1e30": (1e30, r"adapter_model.safetensors: tensor '.*' holds values past 10000 "),
    "weights-int": (np.int64, r"adapter_model.safetensors: tensor '.*' is stored as 'I64'"),
    # read as if absent: adapters applied where PEFT applies none, biases and targets dropped
    "exclude-modules": ({"exclude_modules": ["q_proj"]}, r"adapter_config.json: exclude_modules"),
    "lora-bias": ({"lora_bias": True}, r"adapter_config.json: lora_bias=True is not supported"),
    "target-parameters": (
        {"target_parameters": ["mlp.experts.gate_up_proj"]},
        r"adapter_config.json: target_parameters=",
    ),
    "weights-garbage": (b"\x08" + bytes(7) + b'{"a":1}', r"adapter_model.safetensors is not a "),
}


@pytest.mark.parametrize("case", list(HOSTILE_PEFT))
def test_a_hostile_peft_folder_is_a_checkpoint_error_naming_its_file(
    peft_folder: Path, tmp_path: Path, case: str
) -> None:
    change, said = HOSTILE_PEFT[case]
    folder = tmp_path / "adapter"
    shutil.copytree(peft_folder, folder)
    config_file, weights = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    if isinstance(change, dict):
        config = json.loads(config_file.read_text())
        config.update(change)
        config_file.write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    elif isinstance(change, bytes):
        (config_file if case.startswith("config") else weights).write_bytes(change)
    else:
        tensors = load_file(str(weights))
        changed = {
            k: v.astype(change) if isinstance(change, type) else np.full_like(v, change)
            for k, v in tensors.items()
        }
        save_file(changed, str(weights))
    with pytest.raises(CheckpointError, match=f"^{folder}/{said}"):
        load_peft(folder, TINY)
    assert load_peft(peft_folder, TINY)[0].lora == Lora(4, 8.0, ("q", "v"))  # (the folder: fine)


@pytest.mark.parametrize(
    ("value", "dtype"),
    [(np.nan, "float32"), (-np.inf, "float32"), (3.4e38, "bfloat16")],
    ids=["nan", "inf", "past-bfloat16"],
)
def test_weights_that_are_not_finite_are_refused_naming_the_tensor(
    single: Path, value: float, dtype: str
) -> None:
    """A checkpoint holding NaN or inf (or a value the run's dtype cannot hold: 3.4e38,
    finite in float32, is inf in bfloat16) loaded, served NaN logits and trained on them in
    silence (`jarl eval`, `jarl train`); `jarl export` already refused to write such weights."""
    file = single / "model.safetensors"
    tensors = load_file(file)
    name = "model.layers.1.mlp.up_proj.weight"
    tensors[name] = tensors[name].astype(np.float64)
    tensors[name].flat[7] = value
    save_file({k: v.astype(np.float32) for k, v in tensors.items()}, file)
    with pytest.raises(
        CheckpointError, match=re.escape(f"{file}: tensor {name!r} holds NaN or inf")
    ):
        load_hf(single, dtype, sharder=one_device_sharder())  # type: ignore[arg-type]
