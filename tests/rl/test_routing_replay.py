"""Routing replay through the run: the engine samples a tiny Qwen3-MoE policy and reports
each sampled token's experts, the trajectory carries them next to the rollout logprobs, and
the learner replays them (``algorithm.routing_replay``) for its logprobs and reports how its
own routing differs.

Tolerances. The engine and the learner compute the same fp32 function in another order; the
sampled-vs-learner logprob gap that leaves is `FP32_LOGPROB_TOLERANCE` (1e-4, what a dense
model's backend guarantees, rl/test_learner.py holds the dense model to it). The
perturbation below raises one expert's layer-0 router logit only where the policy did not
choose that expert (it is orthogonal to the router inputs of every position that did), and
the tiny-moe preset renormalises its top-k gates (``norm_topk_prob``): a replayed position's
gates, and so the whole replayed forward, are then those of the unperturbed weights up to
fp32 rounding of the softmax (~1e-7 relative), so with replay the gap must stay within the
dense tolerance. Without replay, each flipped position swaps one of its experts: its MLP
output changes by a whole expert's share, a change of the order of the expert outputs
themselves, not of rounding, so the gap must exceed that tolerance.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_agent_rl.agent.episode import Episode
from jax_agent_rl.agent.trajectory import Trajectory
from jax_agent_rl.cli.demo import make_checkpoint
from jax_agent_rl.config import AlgorithmSection, OptimSection, load_config, to_yaml
from jax_agent_rl.config.errors import ConfigError
from jax_agent_rl.engine import Engine
from jax_agent_rl.models import (
    ModelConfig,
    Packed,
    Routing,
    Weights,
    forward,
    init_params,
    load_hf,
)
from jax_agent_rl.models.hf_local import TINY
from jax_agent_rl.models.sharding import one_device_sharder
from jax_agent_rl.protocol import FP32_LOGPROB_TOLERANCE
from jax_agent_rl.rl.batch import make_batch, step_batch
from jax_agent_rl.rl.learner import Learner
from jax_agent_rl.rl.objectives import SamplingSpec, sampled_experts
from jax_agent_rl.rollout import EmbeddedBackend, GenerateRequest, SamplingParams
from jax_agent_rl.tokenization import Tokenizer
from jax_agent_rl.train.traces import trace_record
from jax_agent_rl.view.data import trajectory as view_trajectory

TOL = FP32_LOGPROB_TOLERANCE
PERTURBATION = 1e-3  # the largest change of a router weight
N = 4  # trajectories


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("moe") / "ckpt"
    make_checkpoint(path, "tiny-moe")
    return path


@pytest.fixture(scope="module")
def moe(checkpoint: Path) -> tuple[ModelConfig, Weights]:
    cfg, w = load_hf(checkpoint, sharder=one_device_sharder())
    assert cfg.norm_topk_prob and cfg.moe_layers == (True, False, True)
    return dataclasses.replace(cfg, dtype="float32"), w


def sample_trajectories(cfg: ModelConfig, w: Weights) -> list[Trajectory]:
    """Two-turn episodes sampled by the embedded engine (temperature 1): a prompt, a model
    turn, tool-like tokens, a second model turn of the same session (prefilled after the
    cached first turn)."""
    engine = Engine(
        cfg,
        max_concurrent_decodes=4,
        max_len=128,
        page_size=8,
        prefill_chunk=16,
        sharder=one_device_sharder(),
    )
    backend = EmbeddedBackend(engine, w, steps_per_call=4)
    assert backend.capabilities.expert_ids == any(cfg.moe_layers)
    rng = np.random.default_rng(0)

    async def episode(i: int) -> Trajectory:
        prompt = rng.integers(0, cfg.vocab_size, 6 + 3 * i).tolist()
        traj = Trajectory(uid=f"e{i}", group_id=str(i // 2), prompt_ids=prompt)
        for turn in range(2):
            sampling = SamplingParams(max_tokens=9 + i, temperature=1.0, seed=10 * i + turn)
            request = GenerateRequest(
                f"e{i}/{turn}", (*traj.prompt_ids, *traj.response_ids), sampling, f"e{i}"
            )
            result = await backend.generate(request)
            assert result.logprobs is not None
            traj.add_sample(list(result.token_ids), list(result.logprobs), 0, result.expert_ids)
            if turn == 0:
                traj.add_observation(rng.integers(0, cfg.vocab_size, 5).tolist())
        return traj

    async def go() -> list[Trajectory]:
        try:
            return list(await asyncio.gather(*(episode(i) for i in range(N))))
        finally:
            await backend.close()

    return asyncio.run(go())


@pytest.fixture(scope="module")
def sampled(moe: tuple[ModelConfig, Weights]) -> list[Trajectory]:
    return sample_trajectories(*moe)


def learner(cfg: ModelConfig, replay: bool) -> Learner:
    return Learner(
        cfg,
        algo=AlgorithmSection(routing_replay=replay),
        optim=OptimSection(),
        sampling=SamplingSpec(1.0),
        micro_batch_size=4,
        sharder=one_device_sharder(),
    )


def step_metrics(cfg: ModelConfig, w: Weights, trajs: list[Trajectory], replay: bool) -> dict:
    """One RL step of ``w``: its metrics (the gaps are taken before it)."""
    batch, sequences, real = step_batch(
        [t.train_sequence(0.0) for t in trajs],
        np.arange(len(trajs), dtype=np.float32),
        [t.group_id for t in trajs],
        np.ones(len(trajs)),
        mini_batches=1,
        row_tokens=None,
        bucket=16,
        rows_per_micro=4,
    )
    replaying = learner(cfg, replay)
    state = replaying.init_state(jax.tree.map(jnp.copy, w))  # its own: the update donates it
    return replaying.rl_update(state, batch, sequences, real)[1]


# ----------------------------------------------------------------- sampler -> trajectory


def test_the_trajectory_carries_the_samplers_experts(
    moe: tuple[ModelConfig, Weights], sampled: list[Trajectory]
) -> None:
    """Each sampled token's experts (int8: 8 experts) are those the training forward of the
    same weights chooses at the position that predicts it, in both sparse layers, the first
    token of each turn (sampled in a prefill) included; tool tokens carry -1."""
    cfg, w = moe
    for traj in sampled:
        ids = traj.expert_ids
        assert ids is not None and ids.dtype == np.int8
        assert ids.shape == (len(traj.response_ids), 2, cfg.num_experts_per_tok)
        mask = np.asarray(traj.loss_mask, bool)
        assert (ids[~mask] == -1).all() and (ids[mask] >= 0).all()
    batch = make_batch([t.train_sequence(0.0) for t in sampled], bucket=16)
    own = forward(
        w,
        cfg,
        Packed(batch.tokens, batch.positions, batch.segment_ids),
        routing=Routing(record=True),
        sharder=one_device_sharder(),
    ).expert_ids
    for b, traj in enumerate(sampled):  # one trajectory per row
        mask = np.asarray(traj.loss_mask, bool)
        P, T = len(traj.prompt_ids), len(traj.prompt_ids) + len(traj.response_ids)
        predicting = np.asarray(own)[:, b, P - 1 : T - 1].swapaxes(0, 1)  # [n, S, k]
        np.testing.assert_array_equal(
            np.sort(traj.expert_ids[mask], -1), np.sort(predicting[mask], -1)
        )


def test_dense_trajectories_carry_no_experts() -> None:
    cfg = ModelConfig.from_hf(TINY["qwen2"])
    (traj,) = sample_trajectories(
        cfg, init_params(jax.random.key(0), cfg, sharder=one_device_sharder())
    )[:1]
    assert traj.expert_ids is None and traj.num_model_tokens > 0
    assert make_batch([traj.train_sequence(0.0)], bucket=16).expert_ids is None


# ------------------------------------------------------------------- learner replay


def layer0_router_input(cfg: ModelConfig, w: Weights, batch: object) -> np.ndarray:
    """Layer 0's normed MLP input [B, T, D] (what its router reads): a one-layer model whose
    experts add nothing and whose final norm is layer 0's MLP norm returns it."""
    one = dataclasses.replace(cfg, num_layers=1, mlp_only_layers=())
    layers = jax.tree.map(lambda x: x[:1], w.layers)
    layers = dataclasses.replace(layers, expert_down=jnp.zeros_like(layers.expert_down))
    w0 = dataclasses.replace(w, layers=layers, final_norm=layers.mlp_norm[0])
    return np.asarray(
        forward(
            w0,
            one,
            Packed(batch.tokens, batch.positions, batch.segment_ids),
            sharder=one_device_sharder(),
        ).hidden
    )


def flipping_perturbation(cfg: ModelConfig, w: Weights, batch: object) -> tuple[np.ndarray, int]:
    """A change [D, E] of layer 0's router, every entry below `PERTURBATION`, that puts one
    expert e into the top-k of a sampled position (the one of smallest margin that allows
    it) and changes no other logit of a position that chose e, nor the top-k of any prompt
    or tool position (those are routed by the learner itself); and that position's flat
    index. The direction is that position's router input projected off the inputs of every
    position that chose e."""
    x = layer0_router_input(cfg, w, batch).reshape(-1, cfg.hidden_size)
    logits = x @ np.asarray(w.layers.router[0])  # [N, E]
    k = cfg.num_experts_per_tok
    kth = -np.sort(-logits, -1)[:, k - 1]
    top = np.argsort(-logits, -1)[:, :k]
    real = np.asarray(batch.segment_ids).reshape(-1) > 0
    given = np.asarray(batch.expert_ids).reshape(len(x), -1, k)[:, 0]  # layer 0 [N, k]
    model = given[:, 0] >= 0
    candidates = [
        (kth[t] - logits[t, e], t, e)
        for t in np.flatnonzero(model)
        for e in range(cfg.num_experts)
        if e not in top[t]
    ]
    for margin, t, e in sorted(candidates)[:50]:
        chose = real & (top == e).any(-1)
        basis = np.linalg.svd(x[chose], full_matrices=False)[2]  # their span's basis
        v = x[t] - basis.T @ (basis @ x[t])
        step = 1.5 * margin * v / (v @ x[t])
        moved = x @ step
        others = real & ~chose & ~model
        if (
            np.abs(step).max() < PERTURBATION
            and (moved[others] < (kth - logits[:, e])[others] / 2).all()
        ):
            delta = np.zeros((cfg.hidden_size, cfg.num_experts), np.float32)
            delta[:, e] = step
            return delta, int(t)
    raise AssertionError("no perturbation below PERTURBATION flips a sampled position")


def perturbed(w: Weights, delta: np.ndarray) -> Weights:
    router = w.layers.router.at[0].add(delta)
    return dataclasses.replace(w, layers=dataclasses.replace(w.layers, router=router))


def test_replay_holds_the_gap_to_the_dense_tolerance_under_flipped_routing(
    moe: tuple[ModelConfig, Weights], sampled: list[Trajectory]
) -> None:
    cfg, w = moe
    batch = make_batch([t.train_sequence(0.0) for t in sampled], bucket=16)
    # the learner with the sampler's weights routes as the sampler did, within tolerance
    same = step_metrics(cfg, w, sampled, replay=True)
    assert same["routing/differs"] == 0.0
    assert same["logprob_gap/max"] <= TOL
    delta, flipped = flipping_perturbation(cfg, w, batch)
    assert 0 < np.abs(delta).max() < PERTURBATION
    w2 = perturbed(w, delta)
    replayed = step_metrics(cfg, w2, sampled, replay=True)
    own = step_metrics(cfg, w2, sampled, replay=False)
    tokens = sum(t.num_model_tokens for t in sampled)
    for m in (replayed, own):  # measured the same way whichever routing trains
        assert m["routing/differs"] >= 1 / tokens
        assert m["routing/logprob_gap_replayed"] <= TOL
        assert m["routing/logprob_gap_own"] > m["routing/logprob_gap_replayed"]
    # measured here: max |delta| 1.6e-5 flips 2 of 84 sampled positions; max gap 9.5e-7
    # replayed (as unperturbed), 5.3e-3 routed by the learner itself
    assert replayed["logprob_gap/max"] <= TOL
    assert own["logprob_gap/max"] > TOL
    # the replayed experts are exactly the sampler's; positions without them route themselves
    given = sampled_experts(jax.tree.map(jnp.asarray, batch))
    rows = Packed(batch.tokens, batch.positions, batch.segment_ids)
    free = forward(
        w2, cfg, rows, routing=Routing(record=True), sharder=one_device_sharder()
    ).expert_ids
    used = forward(
        w2, cfg, rows, routing=Routing(replay=given, record=True), sharder=one_device_sharder()
    ).expert_ids
    has = np.asarray(given) >= 0
    np.testing.assert_array_equal(np.asarray(used)[has], np.asarray(given)[has])
    np.testing.assert_array_equal(np.asarray(used)[~has], np.asarray(free)[~has])
    k = cfg.num_experts_per_tok
    layer0 = lambda ids: np.sort(np.asarray(ids)[0].reshape(-1, k)[flipped])  # noqa: E731
    assert (layer0(free) != layer0(given)).any() and (layer0(used) == layer0(given)).all()


# ------------------------------------------------------------------- refusals, config


def test_expert_ids_of_the_wrong_shape_are_refused(
    moe: tuple[ModelConfig, Weights], sampled: list[Trajectory]
) -> None:
    cfg, w = moe
    one_layer = [dataclasses.replace(t, expert_ids=t.expert_ids[:, :1]) for t in sampled]
    with pytest.raises(ValueError, match=r"expert_ids hold \(1, 2\).*\(sparse layers, "):
        step_metrics(cfg, w, one_layer, replay=True)
    short = dataclasses.replace(sampled[1], expert_ids=sampled[1].expert_ids[:-1])
    with pytest.raises(ValueError, match=r"trajectory 'e1': expert_ids of shape"):
        make_batch([sampled[0].train_sequence(0.0), short.train_sequence(0.0)], bucket=16)
    with pytest.raises(ValueError, match=r"expert ids of shape \(3, 2, 2\) for 4 sampled"):
        Trajectory("x", "g", [1]).add_sample([1, 2, 3, 4], [0.0] * 4, 0, np.zeros((3, 2, 2)))
    # half a row: one expert's gate mixed with another's MLP
    half = sampled[0].expert_ids.copy()
    half[3, 0] = [5, -1]
    half_given = [dataclasses.replace(sampled[0], expert_ids=half), *sampled[1:]]
    with pytest.raises(ValueError, match=r"expert_ids give \[5, -1\] for one token"):
        step_metrics(cfg, w, half_given, replay=True)
    dense = ModelConfig.from_hf(TINY["qwen2"])
    with pytest.raises(ValueError, match=r"carry expert_ids .*, but the policy has no experts"):
        step_metrics(
            dense,
            init_params(jax.random.key(0), dense, sharder=one_device_sharder()),
            sampled,
            replay=True,
        )


def test_the_routing_replay_key_round_trips_and_bad_values_are_named(tmp_path: Path) -> None:
    required = ["data.train=train.jsonl", "model.path=model"]
    assert load_config(None, required).algorithm.routing_replay is True
    cfg = load_config(None, ["algorithm.routing_replay=false", *required])
    assert cfg.algorithm.routing_replay is False
    path = tmp_path / "run.yaml"
    path.write_text(to_yaml(cfg))
    assert load_config(path, []) == cfg
    with pytest.raises(ConfigError, match=r"^algorithm\.routing_replay=.*expected true or false"):
        load_config(None, ["algorithm.routing_replay=maybe", *required])


def test_the_trace_viewer_shows_a_sampled_tokens_experts(
    checkpoint: Path, sampled: list[Trajectory]
) -> None:
    """A trace record keeps the experts, and the viewer's token shows them for model tokens
    only ("3 5 | 0 7": one group per sparse layer)."""
    traj = sampled[0]
    tokenizer = Tokenizer.from_pretrained(checkpoint)
    record = json.loads(json.dumps(trace_record(Episode(traj), tokenizer, 1)))
    tokens = view_trajectory(record)["tokens"]
    assert traj.expert_ids is not None
    for tok, m, e in zip(tokens, traj.loss_mask, traj.expert_ids, strict=True):
        assert tok[7] == (" | ".join(" ".join(map(str, layer)) for layer in e) if m else "")
