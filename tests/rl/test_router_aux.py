"""The router's load-balancing loss (``algorithm.router_aux_loss_coef``): HF's value on the
same checkpoint and padded batch, and what it adds to the RL loss and its gradient.

Tolerances. The loss is ``E * sum_e f_e P_e`` (`moe.load_balancing_loss`): ``f`` counts top-k
choices (exact when both sides choose the same experts, which the test checks), ``P`` is a
mean of router probabilities. A softmax moves each probability by at most half the largest
change of its logits (``sum_j |dp_e / dz_j| = 2 p_e (1 - p_e) <= 1/2``), so logits that
differ by at most ``dz`` move the loss by at most ``E * k * dz / 2`` (``sum_e f_e = k``). On
top of that, fp32 sums of ``n`` terms in another order: ``n * 2^-24`` of the loss.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from jax_agent_rl.config import AlgorithmSection, OptimSection
from jax_agent_rl.models import (
    DecoderPolicy,
    ModelConfig,
    Packed,
    Routing,
    forward,
    init_params,
    load_hf,
)
from jax_agent_rl.models.hf_local import TINY_MOE, write_hf_checkpoint
from jax_agent_rl.models.moe import load_balancing_loss
from jax_agent_rl.models.sharding import one_device_sharder
from jax_agent_rl.rl.learner import Learner
from jax_agent_rl.rl.objectives import SamplingSpec, StepSpec, policy_objective
from tests.models.hf_reference import hf_forward, padded_batch
from tests.rl.test_learner import (
    REWARDS,
    _step,
    grads_of,
    random_batch,
    random_trajectories,
)

MOE = ModelConfig.from_hf({**TINY_MOE, "vocab_size": 256})
EPS32 = 2.0**-24


def _rounding(n_terms: int, value: float) -> float:
    """fp32 sums of ``n_terms`` in another order: ``n * 2^-24`` of the value."""
    return n_terms * EPS32 * abs(value)


def test_router_loss_equals_transformers(tmp_path: object) -> None:
    path = write_hf_checkpoint(tmp_path / "moe", TINY_MOE)  # type: ignore[operator]
    cfg, w = load_hf(path, sharder=one_device_sharder())
    tokens, mask, positions = padded_batch(cfg.vocab_size)
    out = hf_forward(path, tokens, mask, positions, output_router_logits=True)
    hf_aux = float(out.aux_loss)
    B, T = tokens.shape
    hf_logits = np.stack([x.numpy().reshape(B, T, -1) for x in out.router_logits])
    logits = forward(
        w,
        cfg,
        Packed(
            jnp.asarray(tokens),
            jnp.asarray(positions),
            jnp.asarray(mask, jnp.int32),  # segment 1 for real tokens, 0 for padding
        ),
        routing=Routing(router_logits=True),
        sharder=one_device_sharder(),
    ).router_logits
    ours = np.asarray(logits)
    S, E, k = sum(cfg.moe_layers), cfg.num_experts, cfg.num_experts_per_tok
    assert ours.shape == hf_logits.shape == (S, B, T, E) and S == 2  # layer 1 is dense
    real = mask.astype(bool)
    dz = float(np.abs(ours - hf_logits)[:, real].max())
    assert dz <= 1e-4  # the parity tests' logit tolerance
    # the same experts chosen on every real token (f is then the same count on both sides)
    top = lambda z: np.sort(np.argsort(-z, -1)[..., :k], -1)  # noqa: E731
    assert (top(ours)[:, real] == top(hf_logits)[:, real]).all()

    aux = float(load_balancing_loss(cfg, logits, jnp.asarray(mask)))
    n_terms = S * int(mask.sum())
    assert abs(aux - hf_aux) <= E * k * dz / 2 + _rounding(n_terms, hf_aux), (aux, hf_aux)
    # and the function alone, on the same logits: only the order of the sums differs
    same = load_balancing_loss_func(
        tuple(torch.tensor(x.reshape(B * T, E)) for x in ours), E, k, torch.tensor(mask)
    )
    assert abs(aux - float(same)) <= _rounding(n_terms, float(same))
    # padding is left out: the mean over every position would be another number
    everything = float(load_balancing_loss(cfg, logits, jnp.ones((B, T))))
    assert abs(everything - aux) > 1e3 * _rounding(S * B * T, aux)


def _spec(coef: float) -> StepSpec:
    algo = AlgorithmSection(router_aux_loss_coef=coef, tis_cap=None)
    return StepSpec(
        DecoderPolicy(MOE),
        "float32",
        SamplingSpec(0.8),
        algo,
        remat=False,
        sharder=one_device_sharder(),
    )


def _moe_params() -> object:
    """Random weights with router logits of order 1 (HF's 0.02 init routes almost uniformly)."""
    w = init_params(jax.random.key(3), MOE, sharder=one_device_sharder())
    return dataclasses.replace(w, layers=dataclasses.replace(w.layers, router=w.layers.router * 50))


def test_the_policy_loss_adds_coef_times_the_router_loss() -> None:
    """Off, the loss is the policy loss alone and no router metric is reported; on, it adds
    ``coef * aux`` of each micro-batch (over its every real token: prompt and tool tokens too)
    weighted by its share of the sampled tokens, the metric is that weighted mean, and the
    router weights receive its gradient. Two micro-batches (one is the same accumulation loop
    run once, its weight 1)."""
    m = 2
    params = _moe_params()
    batch, given = random_batch(B=4, T=24, seed=1)
    coef = 0.3
    loss_off, grads_off, m_off = grads_of(policy_objective, _spec(0.0), params, batch, given, m)
    loss_on, grads_on, m_on = grads_of(policy_objective, _spec(coef), params, batch, given, m)
    assert "router_aux_loss" not in m_off
    assert float(loss_off) == float(m_off["pg_loss"])  # nothing else in the loss
    assert float(m_on["pg_loss"]) == pytest.approx(float(m_off["pg_loss"]), rel=1e-6)

    # each micro-batch's loss from its own forward, weighted by its sampled tokens
    real = np.asarray(batch.segment_ids) > 0
    sampled = np.asarray(batch.mask).sum(-1)
    rows = np.split(np.arange(batch.shape[0]), m)
    want = 0.0
    for r in rows:
        logits = forward(
            params,  # type: ignore[arg-type]
            MOE,
            Packed(
                jnp.asarray(batch.tokens)[r],
                jnp.asarray(batch.positions)[r],
                jnp.asarray(batch.segment_ids)[r],
            ),
            routing=Routing(router_logits=True),
            sharder=one_device_sharder(),
        ).router_logits
        aux = float(load_balancing_loss(MOE, logits, jnp.asarray(real[r])))
        want += aux * float(sampled[r].sum() / sampled.sum())
    k = MOE.num_experts_per_tok
    assert k * 0.9 < want < MOE.num_experts  # balanced: k; all on k experts: E
    n_terms = sum(MOE.moe_layers) * int(real.sum())
    assert float(m_on["router_aux_loss"]) == pytest.approx(want, abs=_rounding(n_terms, want))
    added = float(loss_on - loss_off)
    assert added == pytest.approx(coef * want, abs=_rounding(n_terms, coef * want) + 1e-6)

    router = np.asarray(grads_on.layers.router - grads_off.layers.router)
    sparse = np.asarray(MOE.moe_layers)
    assert np.abs(router[sparse]).min(axis=(1, 2)).max() > 0 and np.abs(router).max() > 1e-4
    assert not np.any(router[~sparse])  # a dense layer's (unused) router: no gradient


def test_the_learner_reports_the_router_loss_only_when_on() -> None:
    trajs = random_trajectories(8, seed=2)
    batch, sequences, real = _step(trajs, REWARDS[:8], 1, 64, 2)
    metrics = {}
    for coef in (0.0, 0.1):
        learner = Learner(
            MOE,
            algo=AlgorithmSection(router_aux_loss_coef=coef),
            optim=OptimSection(lr=1e-3),
            sampling=SamplingSpec(0.8),
            micro_batch_size=2,
            sharder=one_device_sharder(),
        )
        state = learner.init_state(_moe_params())  # type: ignore[arg-type]
        _, metrics[coef], _ = learner.rl_update(state, batch, sequences, real)
    assert "router_aux_loss" not in metrics[0.0]
    aux = metrics[0.1]["router_aux_loss"]
    assert MOE.num_experts_per_tok * 0.9 < aux < MOE.num_experts
    assert metrics[0.1]["loss"] > metrics[0.0]["loss"]
