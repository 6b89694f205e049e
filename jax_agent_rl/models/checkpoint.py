"""HF safetensors <-> `Weights`, through one declarative table.

Each `TensorRule` names an HF tensor (``{i}`` stands for the layer index, ``{e}`` for the
expert's), the `Weights` field it fills, the layers that hold it, and its layout:

- ``copy``: same shape on both sides (embeddings, norms);
- ``flat``: HF keeps it flat, we split heads (biases: [H*K] -> [H, K]);
- ``linear``: an ``nn.Linear`` weight [out, in]; we store [in..., out...], so import is
  transpose + reshape and export the reverse. ``in_axes`` says how many of our leading
  (per-layer) dimensions form HF's ``in``.

Qwen3-MoE: HF stores each expert's projections on their own (``mlp.experts.{e}.gate_proj``,
as transformers' ``save_pretrained`` writes them); we stack them on an expert axis
(`jax_agent_rl.models.moe`). A sparse layer has the router and experts, a dense one the dense
MLP; the set a layer lacks is zeros on our side.

Import checks every tensor's name, dtype and shape from the safetensors headers before it reads
any data; a missing, unexpected or duplicated HF tensor is an error that names it, and so is a
shard an index names outside the checkpoint folder, a file that is not a regular one (a FIFO
would block the load for ever), or a header that claims more data than its file holds. Export writes
the same names back (sharded with an index past ``max_shard_bytes``), so transformers and vLLM
can load a trained policy, and with a `GenerationConfig` the token ids and the
``generation_config.json`` that make HF ``generate`` stop where the agent loop stops. Weight
sync to other engines reuses `hf_tensors`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import jax
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from jax_agent_rl.files import regular_file
from jax_agent_rl.models.config import ModelConfig
from jax_agent_rl.models.decoder import is_spec

Layout = Literal["copy", "flat", "linear"]
Kind = Literal["every", "dense", "sparse"]  # the layers that hold a tensor


class CheckpointError(ValueError):
    """A checkpoint that does not match its config, or cannot be read (the message names the
    tensor, the file or the folder)."""


@dataclasses.dataclass(frozen=True)
class TensorRule:
    hf: str
    ours: str  # a Weights field, or "layers.<Layer field>" for per-layer tensors
    layout: Layout = "copy"
    in_axes: int = 1
    kind: Kind = "every"


DECODER_RULES = (
    TensorRule("model.embed_tokens.weight", "embed"),
    TensorRule("model.norm.weight", "final_norm"),
    TensorRule("lm_head.weight", "lm_head", "linear"),
    TensorRule("model.layers.{i}.input_layernorm.weight", "layers.attn_norm"),
    TensorRule("model.layers.{i}.self_attn.q_proj.weight", "layers.q", "linear"),
    TensorRule("model.layers.{i}.self_attn.k_proj.weight", "layers.k", "linear"),
    TensorRule("model.layers.{i}.self_attn.v_proj.weight", "layers.v", "linear"),
    TensorRule("model.layers.{i}.self_attn.o_proj.weight", "layers.o", "linear", in_axes=2),
    TensorRule("model.layers.{i}.self_attn.q_proj.bias", "layers.q_bias", "flat"),
    TensorRule("model.layers.{i}.self_attn.k_proj.bias", "layers.k_bias", "flat"),
    TensorRule("model.layers.{i}.self_attn.v_proj.bias", "layers.v_bias", "flat"),
    TensorRule("model.layers.{i}.self_attn.q_norm.weight", "layers.q_norm"),
    TensorRule("model.layers.{i}.self_attn.k_norm.weight", "layers.k_norm"),
    TensorRule("model.layers.{i}.post_attention_layernorm.weight", "layers.mlp_norm"),
    TensorRule("model.layers.{i}.mlp.gate_proj.weight", "layers.gate", "linear", kind="dense"),
    TensorRule("model.layers.{i}.mlp.up_proj.weight", "layers.up", "linear", kind="dense"),
    TensorRule("model.layers.{i}.mlp.down_proj.weight", "layers.down", "linear", kind="dense"),
    TensorRule("model.layers.{i}.mlp.gate.weight", "layers.router", "linear", kind="sparse"),
    TensorRule(
        "model.layers.{i}.mlp.experts.{e}.gate_proj.weight",
        "layers.expert_gate",
        "linear",
        kind="sparse",
    ),
    TensorRule(
        "model.layers.{i}.mlp.experts.{e}.up_proj.weight",
        "layers.expert_up",
        "linear",
        kind="sparse",
    ),
    TensorRule(
        "model.layers.{i}.mlp.experts.{e}.down_proj.weight",
        "layers.expert_down",
        "linear",
        kind="sparse",
    ),
)


def rule_of(ours: str) -> TensorRule:
    """The rule of our field ``ours`` ("layers.q", ...); LoRA adapters are named after the HF
    module of the weight they wrap (`jax_agent_rl.models.adapters`)."""
    (rule,) = (r for r in DECODER_RULES if r.ours == ours)
    return rule


def hf_shape(rule: TensorRule, ours: tuple[int, ...]) -> tuple[int, ...]:
    """HF's shape for one tensor whose shape on our side (per layer) is ``ours``."""
    if rule.layout == "copy":
        return ours
    if rule.layout == "flat":
        return (math.prod(ours),)
    return (math.prod(ours[rule.in_axes :]), math.prod(ours[: rule.in_axes]))


def to_ours(rule: TensorRule, x: np.ndarray, ours: tuple[int, ...]) -> np.ndarray:
    if rule.layout == "linear":
        return x.T.reshape(ours)
    return x.reshape(ours)


def to_hf(rule: TensorRule, y: Any) -> Any:
    """``y`` (host numpy, or a JAX array, which stays where it is) in HF's layout."""
    if rule.layout == "copy":
        return y
    if rule.layout == "flat":
        return y.reshape(-1)
    n_in = math.prod(y.shape[: rule.in_axes])
    hf = y.reshape(n_in, -1).T
    return np.ascontiguousarray(hf) if isinstance(hf, np.ndarray) else hf


Index = tuple[int, ...]  # where a tensor goes in our stacked array: (layer,) or (layer, expert)


def _spec_at(specs: Any, ours: str) -> Any:
    """The `ParamSpec` at our dotted field ``ours`` of a policy's spec tree (None: absent)."""
    node = specs
    for part in ours.split("."):
        node = getattr(node, part, None)
    return node


def _entries(
    cfg: ModelConfig, specs: Any, rules: tuple[TensorRule, ...]
) -> Iterator[tuple[str, TensorRule, Index, tuple[int, ...]]]:
    """(HF name, rule, index in our array (empty for a whole one), the tensor's shape on our
    side) for every tensor of a policy of ``cfg`` whose parameters ``specs`` declares and whose
    HF names ``rules`` gives."""
    for rule in rules:
        spec = _spec_at(specs, rule.ours)
        if spec is None:
            continue
        if "." not in rule.ours:
            yield rule.hf, rule, (), spec.shape
            continue
        for i, sparse in enumerate(cfg.moe_layers):
            if rule.kind != "every" and (rule.kind == "sparse") != sparse:
                continue
            if "{e}" not in rule.hf:
                yield rule.hf.format(i=i), rule, (i,), spec.shape[1:]
                continue
            for e in range(cfg.num_experts):
                yield rule.hf.format(i=i, e=e), rule, (i, e), spec.shape[2:]


def _shard(folder: Path, name: object) -> Path:
    """The file of shard ``name`` in the index of ``folder``. The index is data from wherever
    the checkpoint came from, so a name must stay inside the folder (no absolute path, no
    ``..``); the file itself may be a link, as in the Hugging Face cache, whose snapshot
    folders link every file to ``../../blobs``."""
    parts = Path(name).parts if isinstance(name, str) else ()
    if not parts or Path(str(name)).is_absolute() or ".." in parts:
        raise CheckpointError(
            f"shard {name!r} of {folder / 'model.safetensors.index.json'} is not a file inside "
            f"the checkpoint folder {folder.resolve()}: an index names its shards by paths "
            "relative to the folder, without '..'"
        )
    return folder / str(name)


# safetensors dtype -> bytes per value, for the dtypes a weight may be stored in
_FLOAT_DTYPES = {"F16": 2, "BF16": 2, "F32": 4, "F64": 8}
_MAX_HEADER_BYTES = 100 * 2**20  # the safetensors library's own limit
_MAX_DIMS = 8  # a weight has 1 or 2; many huge ones would make their product slow to compute


@dataclasses.dataclass(frozen=True)
class _Stored:
    """One tensor as a safetensors header describes it, before any of its data is read."""

    file: Path
    shape: tuple[int, ...]


def _regular(file: Path) -> bool:
    """`regular_file`, failing with a `CheckpointError`."""
    try:
        return regular_file(file, "a checkpoint folder")
    except ValueError as e:
        raise CheckpointError(str(e)) from None


def _header(file: Path) -> tuple[dict[str, Any], int]:
    """A safetensors file's header, checked to be a JSON object whose ``__metadata__`` (taken
    out) maps strings to strings, and the size of its data region."""
    if not _regular(file):
        raise CheckpointError(f"shard {file} does not exist")
    size = file.stat().st_size
    with file.open("rb") as f:
        length = int.from_bytes(f.read(8), "little") if size >= 8 else -1
        if not 0 < length <= min(size - 8, _MAX_HEADER_BYTES):
            raise CheckpointError(
                f"{file} is not a safetensors file: its header length {length} does not fit "
                f"its {size} bytes or is over {_MAX_HEADER_BYTES}"
            )
        try:
            header = json.loads(f.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
            raise CheckpointError(f"{file}: the safetensors header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{file}: the safetensors header is not a JSON object")
    metadata = header.pop("__metadata__", {})
    if not (
        isinstance(metadata, dict)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())
    ):  # (the safetensors library refuses it when it reads the data: a traceback)
        raise CheckpointError(
            f"{file}: the safetensors header's __metadata__ is {metadata!r:.100}: expected an "
            "object of strings"
        )
    return header, size - 8 - length


def stored_tensors(file: Path) -> dict[str, _Stored]:
    """The tensors a safetensors file holds, from its header alone: an 8-byte little-endian
    length, then that many bytes of JSON giving each tensor's dtype, shape and data offsets
    (relative to the end of the header). As the safetensors library requires, each tensor's
    bytes must be its shape times its dtype's size, and the tensors must tile the data region
    exactly, so a header that claims data the file does not hold fails here, naming the
    tensor, before anything is allocated."""
    header, data_bytes = _header(file)
    out = {}
    spans: list[tuple[int, int, str]] = []
    for name, entry in header.items():
        try:
            dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
            ok = (
                isinstance(shape, list)
                and len(shape) <= _MAX_DIMS
                and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
                and all(isinstance(o, int) and not isinstance(o, bool) for o in (begin, end))
            )
        except (TypeError, KeyError, ValueError):
            ok = False
        if not ok:
            raise CheckpointError(
                f"{file}: tensor {name!r} has a malformed header entry {entry!r:.200}: expected "
                f"dtype, shape (at most {_MAX_DIMS} whole numbers) and data_offsets [begin, end]"
            )
        if dtype not in _FLOAT_DTYPES:
            raise CheckpointError(
                f"{file}: tensor {name!r} is stored as {dtype!r}: expected one of "
                f"{sorted(_FLOAT_DTYPES)}"
            )
        if (
            not 0 <= begin <= end <= data_bytes
            or end - begin != math.prod(shape) * _FLOAT_DTYPES[dtype]
        ):
            raise CheckpointError(
                f"{file}: tensor {name!r} ({dtype}, shape {tuple(shape)}) claims bytes "
                f"{begin}..{end} of a data region of {data_bytes} bytes: the header does not "
                "match the file"
            )
        out[name] = _Stored(file, tuple(shape))
        spans.append((begin, end, name))
    covered = 0
    for begin, end, name in sorted(spans):
        if begin != covered:
            raise CheckpointError(
                f"{file}: tensor {name!r} starts at byte {begin} of the data region, where "
                f"{covered} was expected: tensors must not overlap or leave gaps"
            )
        covered = end
    if covered != data_bytes:
        raise CheckpointError(
            f"{file}: the tensors end at byte {covered} of a data region of {data_bytes} bytes"
        )
    return out


def _locate(path: Path) -> dict[str, _Stored]:
    """HF name -> the tensor as stored (one file, or shards listed by an index), read from the
    files' headers only. Every file must be a regular one: a FIFO named as a shard would
    block the load for ever."""
    index = path / "model.safetensors.index.json"
    has_index = _regular(index)
    single = not has_index and _regular(path / "model.safetensors")
    listed: set[str] | None = None
    if has_index:
        try:
            weight_map = json.loads(index.read_bytes())
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
            raise CheckpointError(f"{index} is not JSON: {e}") from None
        weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index} has no weight_map object")
        listed = set(weight_map)
        files = sorted({_shard(path, file) for file in weight_map.values()})
    elif single:
        files = [path / "model.safetensors"]
    else:
        raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {path}")
    seen: dict[str, _Stored] = {}
    for file in files:
        for name, stored in stored_tensors(file).items():
            if name in seen:
                raise CheckpointError(f"tensor {name!r} is stored twice: {seen[name].file}, {file}")
            seen[name] = stored
    if listed is not None and listed != set(seen):
        raise CheckpointError(
            f"index and shards disagree: only in the index {sorted(listed - set(seen))}, "
            f"only in the shards {sorted(set(seen) - listed)}"
        )
    return seen


def read_hf(path: Path, cfg: ModelConfig, specs: Any, rules: tuple[TensorRule, ...]) -> Any:
    """The parameters (host arrays in ``cfg``'s dtype, the tree of ``specs``) of a policy of
    ``cfg`` from the checkpoint folder ``path`` by its HF table ``rules``.

    Every tensor's name, dtype and shape are checked from the files' headers before any data
    is read; a tensor that holds NaN or inf after the cast to ``cfg``'s dtype is refused."""
    where = _locate(path)
    entries = list(_entries(cfg, specs, rules))
    expected = {name for name, *_ in entries}
    tied_head = cfg.tie_embeddings and "lm_head.weight" in where
    unexpected = sorted(set(where) - expected - ({"lm_head.weight"} if tied_head else set()))
    if unexpected:
        raise CheckpointError(
            f"unexpected tensors in {path} for a {cfg.family} config: {unexpected}"
        )
    missing = sorted(expected - set(where))
    if missing:
        raise CheckpointError(f"missing tensors in {path}: {missing}")
    wants = [(name, hf_shape(rule, shape)) for name, rule, _, shape in entries]
    if tied_head:
        wants.append(("lm_head.weight", where["model.embed_tokens.weight"].shape))
    for name, want in wants:
        if where[name].shape != want:
            raise CheckpointError(
                f"tensor {name!r} has shape {where[name].shape}, config implies {want}"
            )

    np_dtype = np.dtype(cfg.jnp_dtype)
    handles: dict[Path, Any] = {}

    def read(name: str) -> np.ndarray:
        file = where[name].file
        if file not in handles:
            handles[file] = safe_open(str(file), framework="numpy")
        return handles[file].get_tensor(name)

    stacked: dict[str, np.ndarray] = {}
    for name, rule, index, shape in entries:
        y = to_ours(rule, read(name), shape).astype(np_dtype)
        if not np.isfinite(y).all():  # (NaN weights served and trained NaN in silence)
            raise CheckpointError(
                f"{where[name].file}: tensor {name!r} holds NaN or inf values (as {np_dtype})"
            )
        if not index:
            stacked[rule.ours] = y
        else:
            if rule.ours not in stacked:  # zeros: a mixed MoE model's unused set stays so
                stacked[rule.ours] = np.zeros(_spec_at(specs, rule.ours).shape, np_dtype)
            stacked[rule.ours][index] = y
    if tied_head:
        head = read("lm_head.weight").astype(np_dtype)
        if not np.array_equal(head, stacked["embed"]):
            raise CheckpointError(
                "lm_head.weight differs from model.embed_tokens.weight but tie_word_embeddings=true"
            )
    leaves, treedef = jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec)
    names = [".".join(str(getattr(k, "name", k)) for k in keys) for keys, _ in leaves]
    return jax.tree.unflatten(treedef, [stacked[n] for n in names])


def hf_tensors_of(
    cfg: ModelConfig,
    specs: Any,
    rules: tuple[TensorRule, ...],
    weights: Any,
    on_device: bool = False,
) -> Iterator[tuple[str, Any]]:
    """Every tensor of ``weights`` (a policy's, declared by ``specs``; ``rules`` its HF table)
    under its HF name and layout, in the model dtype: host numpy, or with ``on_device`` JAX
    arrays on the weights' device (the CUDA push)."""
    for name, rule, index, _ in _entries(cfg, specs, rules):
        value = _spec_at(weights, rule.ours)
        arr = value[index] if index else value
        yield name, to_hf(rule, arr if on_device else np.asarray(jax.device_get(arr)))


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
    """What an exported checkpoint tells HF ``generate``: the ids that end a reply (the
    end-of-turn token first), the padding id, and how to sample (``temperature`` 0: greedy)."""

    eos_token_ids: tuple[int, ...]
    pad_token_id: int
    bos_token_id: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: off

    def token_ids(self) -> dict[str, Any]:
        """The special token ids, as config.json and generation_config.json both carry them."""
        eos = self.eos_token_ids
        return {
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos[0] if len(eos) == 1 else list(eos),
            "pad_token_id": self.pad_token_id,
        }

    def to_hf(self) -> dict[str, Any]:
        """``generation_config.json``: sampling stated in full, so none of HF's own defaults
        (``top_k=50`` among them) applies."""
        out = {**self.token_ids(), "do_sample": self.temperature > 0}
        if self.temperature > 0:
            out.update(temperature=self.temperature, top_p=self.top_p, top_k=max(self.top_k, 0))
        return out


def write_hf(
    path: Path,
    tensors: Iterator[tuple[str, np.ndarray]],
    config: dict[str, Any],
    max_shard_bytes: int,
    generation: GenerationConfig | None,
) -> None:
    """Writes ``tensors`` as safetensors (sharded with an index when over ``max_shard_bytes``)
    and ``config`` as config.json; with ``generation``, also its token ids in config.json and
    ``generation_config.json``."""
    path.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, arr in tensors:
        if shards[-1] and size + arr.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = arr
        size += arr.nbytes
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], str(path / "model.safetensors"), metadata=meta)
    else:
        weight_map: dict[str, str] = {}
        for n, shard in enumerate(shards, start=1):
            file = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(path / file), metadata=meta)
            weight_map.update(dict.fromkeys(shard, file))
        total = sum(a.nbytes for s in shards for a in s.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    if generation is not None:
        config = {**config, **generation.token_ids()}
        (path / "generation_config.json").write_text(
            json.dumps(generation.to_hf(), indent=2) + "\n"
        )
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
