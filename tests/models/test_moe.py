"""Qwen3-MoE: config, logits against transformers' own forward, checkpoint round trips,
routing replay, the experts sharded over fake CPU devices, and the engine's greedy tokens.

Tolerances as in test_parity.py and test_sharding.py: 1e-4 on fp32 logits against HF (the
same real-number function, fp32 rounding near 1e-6), 1e-5 between sharded and unsharded (the
same sums in another order). Routing is a discrete choice: rounding of that size flips no
token's experts unless one sits within ~1e-6 of a tie; such a flip would show as a logit
error far above the tolerance (another expert's output), never be absorbed by it.
"""

import asyncio
import dataclasses
import json
import os
import re
from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from jax.sharding import PartitionSpec
from safetensors.numpy import load_file, save_file

from jax_agent_rl.cli import main
from jax_agent_rl.engine import Engine
from jax_agent_rl.models import (
    CheckpointError,
    ModelConfig,
    Packed,
    Paged,
    Routing,
    Sharder,
    UnsupportedConfigError,
    Weights,
    abstract_params,
    forward,
    init_pages,
    init_params,
    lm_logits,
    load_hf,
    make_mesh,
    save_hf,
)
from jax_agent_rl.models.hf_local import TINY, TINY_MOE, write_hf_checkpoint
from jax_agent_rl.models.moe import block_rows, route, router_logits, sparse_mlp
from jax_agent_rl.models.sharding import one_device_sharder
from jax_agent_rl.rollout import EmbeddedBackend, GenerateRequest, SamplingParams
from tests.models.hf_reference import hf_logits, padded_batch

TOL = 1e-4


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[bool, Path]:
    """TINY_MOE written by transformers, with and without norm_topk_prob."""
    root = tmp_path_factory.mktemp("moe")
    return {
        norm: write_hf_checkpoint(root / f"norm{norm}", {**TINY_MOE, "norm_topk_prob": norm})
        for norm in (True, False)
    }


# ------------------------------------------------------------------------------------ config


def test_config_reads_the_moe_fields_and_round_trips() -> None:
    cfg = ModelConfig.from_hf(TINY_MOE)
    assert (cfg.family, cfg.num_experts, cfg.num_experts_per_tok) == ("qwen3_moe", 8, 2)
    assert (cfg.moe_intermediate_size, cfg.norm_topk_prob, cfg.mlp_only_layers) == (32, True, (1,))
    assert cfg.moe_layers == (True, False, True)
    assert cfg.router_aux_loss_coef == 0.001  # HF's default where config.json gives none
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg
    # transformers >= 5 writes num_local_experts; older checkpoints num_experts
    renamed = {k: v for k, v in TINY_MOE.items() if k != "num_experts"}
    assert ModelConfig.from_hf({**renamed, "num_local_experts": 8}) == cfg
    # decoder_sparse_step 2: layers 1, 3 sparse, unless mlp_only
    stepped = ModelConfig.from_hf({**TINY_MOE, "num_hidden_layers": 4, "decoder_sparse_step": 2})
    assert stepped.moe_layers == (False, False, False, True)
    # transformers reads our config.json as the same architecture
    hf = transformers.Qwen3MoeConfig(**cfg.to_hf())
    assert (hf.num_experts, hf.mlp_only_layers, hf.norm_topk_prob) == (8, [1], True)


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"num_experts_per_tok": 9}, "num_experts_per_tok=9 exceeds num_experts=8"),
        ({"num_experts": 0}, "num_experts=0"),
        ({"num_local_experts": 4}, "num_local_experts=4 disagree"),
        ({"moe_intermediate_size": 0}, "moe_intermediate_size=0"),
        ({"decoder_sparse_step": 0}, "decoder_sparse_step=0"),
        ({"norm_topk_prob": "yes"}, "norm_topk_prob='yes'"),
        ({"mlp_only_layers": [3]}, r"mlp_only_layers=\(3,\)"),
        ({"mlp_only_layers": [1, 1]}, "mlp_only_layers"),
        ({"mlp_only_layers": 1}, "mlp_only_layers=1"),
        ({"router_aux_loss_coef": -1}, "router_aux_loss_coef=-1"),
        ({"moe_intermediate_size": None}, "moe_intermediate_size=None"),
        ({"shared_expert_intermediate_size": 64}, "shared_expert_intermediate_size"),
    ],
)
def test_bad_moe_field_is_named(fields: dict[str, object], named: str) -> None:
    with pytest.raises(UnsupportedConfigError, match=named):
        ModelConfig.from_hf({**TINY_MOE, **fields})


def test_missing_moe_field_is_named() -> None:
    hf = {k: v for k, v in TINY_MOE.items() if k != "moe_intermediate_size"}
    with pytest.raises(UnsupportedConfigError, match="lacks the required field 'moe_intermediate"):
        ModelConfig.from_hf(hf)
    dense = ModelConfig.from_hf(TINY["qwen3"])
    with pytest.raises(UnsupportedConfigError, match="a qwen3 model has no experts"):
        dataclasses.replace(dense, num_experts=4)


# ----------------------------------------------------------------------------------- forward


@pytest.mark.parametrize("norm", [True, False])
def test_forward_matches_transformers(norm: bool, checkpoints: dict[bool, Path]) -> None:
    cfg, w = load_hf(checkpoints[norm], sharder=one_device_sharder())
    assert cfg.norm_topk_prob == norm and cfg.moe_layers == (True, False, True)
    tokens, mask, positions = padded_batch(cfg.vocab_size)
    ref = hf_logits(checkpoints[norm], tokens, mask, positions)
    logits = np.asarray(
        lm_logits(
            w, forward(w, cfg, Packed(tokens, positions, mask), sharder=one_device_sharder()).hidden
        )
    )
    valid = mask.astype(bool)
    assert np.abs(ref[valid]).max() > 1.0  # the comparison is not between near-zero numbers
    assert np.abs(logits - ref)[valid].max() <= TOL


def test_cached_prefill_and_decode_route_as_the_training_forward(
    checkpoints: dict[bool, Path],
) -> None:
    """The paged path (prefill, then one decode step) chooses the experts the training
    forward chooses for the same tokens, and gives the same hidden states."""
    cfg, w = load_hf(checkpoints[True], sharder=one_device_sharder())
    rng = np.random.default_rng(3)
    B, T = 2, 9
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, T)))
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))
    # jitted (run eagerly, each of the forward's operations would compile on its own: minutes)
    record = Routing(record=True)

    @jax.jit
    def fwd_packed(w, tokens, positions, segments):  # type: ignore[no-untyped-def]
        out = forward(
            w,
            cfg,
            Packed(tokens, positions, segments),
            sharder=one_device_sharder(),
            routing=record,
        )
        return out.hidden, out.expert_ids

    @partial(jax.jit, static_argnames="pages_read")
    def fwd_paged(  # type: ignore[no-untyped-def]
        w, tokens, pages, table, pos, num_new, pages_read=None
    ):
        rows = Paged(tokens, pages, table, pos, num_new, pages_read=pages_read)
        out = forward(w, cfg, rows, sharder=one_device_sharder(), routing=record)
        return out.hidden, out.cache, out.expert_ids

    h_full, ids_full = fwd_packed(w, tokens, positions, jnp.ones((B, T), jnp.int32))
    pages = init_pages(cfg, num_pages=2 * B, page_size=8, sharder=one_device_sharder())
    table = jnp.arange(2 * B, dtype=jnp.int32).reshape(B, 2)
    h_pre, pages, ids_pre = fwd_paged(
        w, tokens[:, :-1], pages, table, jnp.zeros(B, jnp.int32), jnp.full(B, T - 1), pages_read=2
    )
    h_dec, _, ids_dec = fwd_paged(
        w, tokens[:, -1:], pages, table, jnp.full(B, T - 1), jnp.ones(B, jnp.int32)
    )
    np.testing.assert_array_equal(np.concatenate([ids_pre, ids_dec], axis=2), ids_full)
    h_cached = np.concatenate([h_pre, h_dec], axis=1)
    assert np.abs(h_cached - np.asarray(h_full)).max() <= 1e-5


# -------------------------------------------------------------------------------- checkpoint


def test_export_round_trips_bitwise(checkpoints: dict[bool, Path], tmp_path: Path) -> None:
    """HF -> ours -> HF gives transformers the same tensors; ours -> HF -> ours the same
    arrays. The dense layer's unused expert arrays (and the sparse layers' unused dense
    ones) load as zeros and are written nowhere."""
    cfg, w = load_hf(checkpoints[True], sharder=one_device_sharder())
    assert not np.asarray(w.layers.expert_gate[1]).any()
    assert not np.asarray(w.layers.gate[0]).any() and not np.asarray(w.layers.gate[2]).any()
    save_hf(tmp_path, cfg, w)
    assert json.loads((tmp_path / "config.json").read_text())["num_experts"] == 8
    before = transformers.AutoModelForCausalLM.from_pretrained(checkpoints[True]).state_dict()
    after = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).state_dict()
    assert before.keys() == after.keys()
    for name, tensor in before.items():
        assert torch.equal(tensor, after[name]), name
    cfg2, w2 = load_hf(tmp_path, sharder=one_device_sharder())
    assert cfg2 == cfg
    leaves, leaves2 = jax.tree.leaves(w), jax.tree.leaves(w2)
    assert len(leaves) == len(leaves2)
    assert all(np.array_equal(a, b) for a, b in zip(leaves, leaves2, strict=True))


def test_missing_expert_tensor_is_named(checkpoints: dict[bool, Path], tmp_path: Path) -> None:
    cfg, w = load_hf(checkpoints[True], sharder=one_device_sharder())
    save_hf(tmp_path, cfg, w)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.2.mlp.experts.7.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"layers\.2\.mlp\.experts\.7\.up_proj"):
        load_hf(tmp_path, sharder=one_device_sharder())


@pytest.mark.parametrize(
    ("ragged", "tokens"),
    [(True, 7), (False, 7), (False, 520)],
    ids=["ragged_dot", "blocks-of-8", "blocks-of-256"],
)
def test_grouped_experts_and_their_gradients_equal_a_dense_reference(
    ragged: bool, tokens: int
) -> None:
    """`sparse_mlp` (sorted tokens; ragged_dot as on TPU, or padded blocks as elsewhere: 28
    assignments in blocks of 8, 2080 in blocks of 256, groups spanning two) against every
    expert run on every token and masked by a one-hot of the chosen ones: outputs and gradients
    (tokens, router, experts) agree to fp32 rounding: 1e-5 of the largest entry (summed in
    another order, as ragged_dot does on a GPU, gradients of order 5 differ by ~2e-5)."""
    cfg = ModelConfig.from_hf(TINY_MOE)
    layer = jax.tree.map(
        lambda x: x[0], init_params(jax.random.key(1), cfg, sharder=one_device_sharder()).layers
    )
    layer = jax.tree.map(lambda x: x * 10 if x.ndim >= 2 else x, layer)  # std 0.2: O(1) outputs
    x_btd = jax.random.normal(jax.random.key(2), (2, tokens, cfg.hidden_size))
    N = 2 * tokens

    def dense(lw, x_btd):  # type: ignore[no-untyped-def]
        gates_nk, ids_nk = route(cfg, router_logits(lw.router, x_btd.reshape(N, -1)))
        weight_ne = (jax.nn.one_hot(ids_nk, cfg.num_experts) * gates_nk[..., None]).sum(1)
        x_nd = x_btd.reshape(N, -1)
        h = jax.nn.silu(jnp.einsum("nd,edm->nem", x_nd, lw.expert_gate)) * jnp.einsum(
            "nd,edm->nem", x_nd, lw.expert_up
        )
        y_ned = jnp.einsum("nem,emd->ned", h, lw.expert_down)
        return jnp.einsum("ned,ne->nd", y_ned, weight_ne).reshape(x_btd.shape)

    def loss(fn, lw, x_btd):  # type: ignore[no-untyped-def]
        return jnp.sum(jnp.sin(fn(lw, x_btd)))

    def grouped(lw, x_btd):  # type: ignore[no-untyped-def]
        return sparse_mlp(cfg, lw, x_btd, ragged=ragged)[0]

    if not ragged:  # the blocks and groups are as the case's id says
        _, ids_nk = route(cfg, router_logits(layer.router, x_btd.reshape(N, -1)))
        b = block_rows(N * cfg.num_experts_per_tok, cfg.num_experts)
        assert b == (8 if tokens == 7 else 256)
        assert (np.bincount(np.asarray(ids_nk).ravel()).max() > b) == (tokens == 520)
    # jitted (run eagerly, each operation would compile on its own: a minute a case)
    out, ref = jax.jit(grouped)(layer, x_btd), jax.jit(dense)(layer, x_btd)
    assert np.abs(np.asarray(ref)).max() > 0.5
    assert _off(out, ref) <= 1e-5
    grads = jax.jit(jax.grad(partial(loss, grouped), argnums=(0, 1)))(layer, x_btd)
    ref_grads = jax.jit(jax.grad(partial(loss, dense), argnums=(0, 1)))(layer, x_btd)
    for name in ("router", "expert_gate", "expert_up", "expert_down"):
        g, r = getattr(grads[0], name), getattr(ref_grads[0], name)
        assert np.abs(np.asarray(r)).max() > 1e-2, name
        assert _off(g, r) <= 1e-5, name
    assert _off(grads[1], ref_grads[1]) <= 1e-5


def _off(got: jax.Array, want: jax.Array) -> float:
    """The largest difference, over the largest entry of ``want`` (at least 1)."""
    want_np = np.asarray(want)
    return float(np.abs(np.asarray(got) - want_np).max() / max(1.0, np.abs(want_np).max()))


# ------------------------------------------------------------------------------------ replay


def test_replaying_the_chosen_experts_reproduces_the_forward(
    checkpoints: dict[bool, Path],
) -> None:
    cfg, w = load_hf(checkpoints[True], sharder=one_device_sharder())
    tokens, mask, positions = padded_batch(cfg.vocab_size)
    h, ids = _routed(w, cfg, tokens, positions, mask)
    assert ids.shape == (2, 3, 20, 2) and ids.dtype == jnp.int32
    assert len(np.unique(np.asarray(ids))) == cfg.num_experts  # every expert gets tokens
    h_replay, ids_replay = _routed(w, cfg, tokens, positions, mask, replay=ids)
    np.testing.assert_array_equal(ids_replay, ids)
    np.testing.assert_array_equal(h_replay, h)


def test_replay_keeps_the_routing_of_perturbed_weights(checkpoints: dict[bool, Path]) -> None:
    """A router change under 1e-3 per weight, built to flip one token's k-th expert in the
    first layer: the free forward's experts change; the replayed forward keeps the original
    experts, so its logits there move only by the gates' small change."""
    cfg, w = load_hf(checkpoints[True], sharder=one_device_sharder())
    tokens, mask, positions = padded_batch(cfg.vocab_size)
    h, ids = _routed(w, cfg, tokens, positions, mask)
    # layer 0's router input: the normed embeddings after layer 0's attention, taken from a
    # one-layer model (layer 0 is sparse: its MLP input does not depend on its own router)
    one = dataclasses.replace(cfg, num_layers=1, mlp_only_layers=())
    w1 = dataclasses.replace(w, layers=jax.tree.map(lambda x: x[:1], w.layers))
    x = _layer0_router_input(one, w1, tokens, positions, mask)  # [B, T, D]
    logits = np.asarray(x @ w.layers.router[0])  # [B, T, E]
    order = np.argsort(-logits, axis=-1)
    k = cfg.num_experts_per_tok
    top = np.take_along_axis(logits, order, -1)
    gap = np.where(mask.astype(bool), top[..., k - 1] - top[..., k], np.inf)
    b, t = np.unravel_index(np.argmin(gap), gap.shape)
    loser = order[b, t, k]  # raise the (k+1)-th expert's logit past the k-th's for this token
    xv = np.asarray(x[b, t])
    delta = np.zeros_like(np.asarray(w.layers.router))
    delta[0, :, loser] = 1.5 * gap[b, t] * xv / (xv @ xv)
    assert 0 < np.abs(delta).max() < 1e-3
    w2 = dataclasses.replace(
        w, layers=dataclasses.replace(w.layers, router=w.layers.router + delta)
    )
    h_free, ids_free = _routed(w2, cfg, tokens, positions, mask)
    assert loser in np.asarray(ids_free[0, b, t]) and loser not in np.asarray(ids[0, b, t])
    h_replay, ids_replay = _routed(w2, cfg, tokens, positions, mask, replay=ids)
    np.testing.assert_array_equal(ids_replay, ids)
    free_moved = np.abs(np.asarray(h_free[b, t]) - np.asarray(h[b, t])).max()
    replay_moved = np.abs(np.asarray(h_replay[b, t]) - np.asarray(h[b, t])).max()
    assert replay_moved < free_moved / 10


def _routed(
    w: Any, cfg: ModelConfig, tokens: Any, positions: Any, mask: Any, replay: Any = None
) -> tuple[jax.Array, jax.Array]:
    """The training forward's final hidden states and the experts each token chose (those
    ``replay`` gives, if any)."""
    out = forward(
        w,
        cfg,
        Packed(tokens, positions, mask),
        routing=Routing(replay=replay, record=True),
        sharder=one_device_sharder(),
    )
    assert out.expert_ids is not None
    return out.hidden, out.expert_ids


def _layer0_router_input(
    cfg: ModelConfig, w: Weights, tokens: np.ndarray, positions: np.ndarray, mask: np.ndarray
) -> jax.Array:
    """Layer 0's normed MLP input [B, T, D], from the one-layer model ``cfg``, ``w``: with the
    experts' down projections zeroed its MLP adds nothing, so the final norm's input is the
    MLP's input, and with the MLP norm's scale as the final norm's, its output is the router's
    input."""
    no_mlp = dataclasses.replace(w.layers, expert_down=jnp.zeros_like(w.layers.expert_down))
    w0 = dataclasses.replace(w, layers=no_mlp, final_norm=w.layers.mlp_norm[0])
    return forward(w0, cfg, Packed(tokens, positions, mask), sharder=one_device_sharder()).hidden


# ---------------------------------------------------------------------------------- sharding


def test_sharded_forward_equals_unsharded() -> None:
    """Experts split over fsdp=4 (two whole experts a device), their M over tensor=2."""
    assert jax.device_count() == 8
    sharder = Sharder(make_mesh(data=1, fsdp=4, tensor=2))
    cfg = ModelConfig.from_hf(TINY_MOE)
    w = init_params(jax.random.key(0), cfg, sharder)
    gate = w.layers.expert_gate  # [L, E, D, M]
    L, E, D, M = gate.shape
    assert gate.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", None, "tensor")
    assert {s.data.shape for s in gate.addressable_shards} == {(L, E // 4, D, M // 2)}
    w_local = jax.device_put(w, jax.devices()[0])
    rng = np.random.default_rng(0)
    B, T = 4, 12
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, T)))
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))
    segments = jnp.ones((B, T), jnp.int32).at[1, 9:].set(0)

    def run(w, tokens, sharder):  # type: ignore[no-untyped-def]
        out = forward(
            w,
            cfg,
            Packed(tokens, positions, segments),
            sharder=sharder,
            routing=Routing(record=True),
        )
        return lm_logits(w, out.hidden), out.expert_ids

    batch_sharding = sharder.sharding(("batch", "seq"), (B, T))
    sharded, ids = jax.jit(partial(run, sharder=sharder))(w, jax.device_put(tokens, batch_sharding))
    local, ids_local = jax.jit(partial(run, sharder=one_device_sharder()))(w_local, tokens)
    assert len(sharded.sharding.device_set) == 8
    np.testing.assert_array_equal(ids, ids_local)
    assert np.abs(np.asarray(sharded) - np.asarray(local)).max() <= 1e-5


def test_tiny_moe_preset_loads_here_and_in_transformers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = tmp_path / "ckpt"
    assert main(["checkpoint", "make", "--out", str(ckpt), "--preset", "tiny-moe"]) == 0
    assert "qwen3_moe checkpoint" in capsys.readouterr().out
    cfg, w = load_hf(ckpt, sharder=one_device_sharder())
    assert (cfg.family, cfg.num_experts, cfg.num_experts_per_tok) == ("qwen3_moe", 8, 2)
    assert cfg.moe_layers == (True, False, True)
    tokens, mask, positions = padded_batch(cfg.vocab_size)
    ref = hf_logits(ckpt, tokens, mask, positions)
    logits = np.asarray(
        lm_logits(
            w, forward(w, cfg, Packed(tokens, positions, mask), sharder=one_device_sharder()).hidden
        )
    )
    assert np.abs(logits - ref)[mask.astype(bool)].max() <= TOL


# ------------------------------------------------------------------------------------ engine


def test_engine_greedy_tokens_equal_transformers_generate(checkpoints: dict[bool, Path]) -> None:
    """The engine's paged prefill and decode on a MoE checkpoint: greedy tokens as HF's."""
    path = checkpoints[True]
    cfg, w = load_hf(path, sharder=one_device_sharder())
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (5, 11, 17)]
    steps = 8
    backend = EmbeddedBackend(
        Engine(cfg, max_concurrent_decodes=4, max_len=64, sharder=one_device_sharder()), w
    )
    greedy = SamplingParams(max_tokens=steps, temperature=0.0)

    async def generate() -> list:
        try:
            requests = (GenerateRequest(f"p{i}", tuple(p), greedy) for i, p in enumerate(prompts))
            return list(await asyncio.gather(*(backend.generate(r) for r in requests)))
        finally:
            await backend.close()

    results = asyncio.run(generate())
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for prompt, result in zip(prompts, results, strict=True):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            new = model.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=steps
            )
        assert list(result.token_ids) == new[0, len(prompt) :].tolist()


def test_loss_and_gradient_compile_for_tpu_with_experts_sharded() -> None:
    """The training forward's loss and gradient with the experts' ids returned, compiled on
    this CPU host for an abstract TPU v5e 2x2 (fsdp 2 x tensor 2): the experts' weights split
    over fsdp, and their matmuls stay grouped: TPU ragged-dot kernels (a dense all-experts
    einsum would show none)."""
    # libtpu takes a lock per host unless told that several processes may load it (compiling
    # only, no chip is touched)
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2")
    sharder = Sharder(make_mesh(fsdp=2, tensor=2, devices=topology.devices))
    # head dim 128, as the TPU attention kernel reads it
    cfg = dataclasses.replace(ModelConfig.from_hf(TINY_MOE), head_dim=128, dtype="bfloat16")
    rows, T = 4, 256

    def loss(w: Weights, tokens_bt: jax.Array, segment_ids_bt: jax.Array) -> jax.Array:
        positions = jnp.broadcast_to(jnp.arange(T), tokens_bt.shape)
        out = forward(
            w,
            cfg,
            Packed(tokens_bt, positions, segment_ids_bt),
            sharder=sharder,
            routing=Routing(record=True),
        )
        assert out.expert_ids is not None
        return jnp.mean(lm_logits(w, out.hidden)) + 0 * out.expert_ids.sum()

    params = abstract_params(cfg, sharder)
    assert params.layers.expert_gate.sharding.spec == PartitionSpec(None, "fsdp", None, "tensor")
    batch = jax.ShapeDtypeStruct(
        (rows, T), jnp.int32, sharding=sharder.sharding(("batch", "seq"), (rows, T))
    )
    hlo = jax.jit(jax.value_and_grad(loss)).lower(params, batch, batch).compile().as_text()
    call = r"%(ragged-dot-none)(?:\.\d+)? = .*custom_call_target=\"tpu_custom_call\""
    # gate, up and down, and their inputs' gradients in the backward
    assert len(re.findall(call, hlo)) == 6
