"""One conformance suite for every rollout backend.

Each backend is built by a factory registered in ``BACKENDS`` from the same locally written
checkpoint, once for each model of ``MODELS`` (a Qwen2-style model and a Qwen3-MoE, head_dim
64, which every engine here can serve). Backends
that need their own venv run it in their own processes (vLLM: `jax_agent_rl.backends.vllm`,
under ``.venv-vllm``; JetStream: `jax_agent_rl.backends.jetstream`, under ``.venv-jetstream``);
the Ray pool serves from an embedded replica in a Ray actor (`jax_agent_rl.rollout.ray_pool`).
The suite itself does not change. What a backend's `Capabilities` exclude, the suite checks it
refuses (or, for logprobs, does not make up).

Each backend is also built serving a LoRA policy (`lora_policy`: the dense model with adapters
of `LORA`), once, for the weight-update tests (test_lora_conformance.py): there a push is the
adapters alone and the learner recomputes logprobs with the base and the adapters (`Pushes`).
"""

import asyncio
import dataclasses
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_agent_rl.engine import Engine, sampling_logprobs, token_logprobs
from jax_agent_rl.models import (
    DecoderPolicy,
    Lora,
    ModelConfig,
    Packed,
    Weights,
    forward,
    lm_logits,
    load_hf,
)
from jax_agent_rl.models.adapters import init_adapters, with_adapters
from jax_agent_rl.models.hf_local import TINY_QWEN2, TINY_QWEN3_MOE, write_hf_checkpoint
from jax_agent_rl.models.lora import Adapter, LayerAdapters
from jax_agent_rl.models.sharding import one_device_sharder
from jax_agent_rl.rollout import EmbeddedBackend, RolloutBackend, SamplingParams

T = TypeVar("T")
MAX_LEN = 128
SLOTS = 4  # fewer than the concurrent tests' requests, so queueing is exercised


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


# the suite's LoRA policy: rank 4 on every projection of the dense model
LORA = Lora(rank=4, alpha=8.0)


def lora_adapters(cfg: ModelConfig, seed: int) -> LayerAdapters:
    """Adapters of ``cfg.lora``: A as PEFT initialises it, B drawn too (PEFT's zeros would
    change nothing, so a backend that dropped the adapters would pass)."""
    fresh = init_adapters(jax.random.key(seed), cfg)
    leaves, treedef = jax.tree.flatten(fresh, is_leaf=lambda x: isinstance(x, Adapter))
    keys = jax.random.split(jax.random.key(seed + 100), len(leaves))
    drawn = [
        Adapter(a.a, 0.3 * jax.random.normal(k, a.b.shape))
        for a, k in zip(leaves, keys, strict=True)
    ]
    return jax.tree.unflatten(treedef, drawn)


def lora_policy(path: Path) -> tuple[ModelConfig, Weights]:
    """The checkpoint's model with `LORA`'s adapters (`lora_adapters` of seed 0) on it."""
    cfg, w = load_hf(path, sharder=one_device_sharder())
    cfg = dataclasses.replace(cfg, lora=LORA)
    return cfg, with_adapters(w, lora_adapters(cfg, seed=0))


def _served(path: Path, lora: bool) -> tuple[ModelConfig, Weights]:
    """The model and weights a backend is started with: the checkpoint's, or `lora_policy`."""
    return lora_policy(path) if lora else load_hf(path, sharder=one_device_sharder())


def _embedded(path: Path, lora: bool) -> RolloutBackend:
    cfg, w = _served(path, lora)
    return EmbeddedBackend(
        Engine(cfg, max_concurrent_decodes=SLOTS, max_len=MAX_LEN, sharder=one_device_sharder()),
        w,
        seed=0,
    )


def _vllm(path: Path, lora: bool) -> RolloutBackend:
    # starts vLLM in its own venv and processes (a LoRA policy: its adapters pushed at start)
    from jax_agent_rl.backends.vllm.backend import VLLMBackend

    cfg, w = _served(path, lora)
    return VLLMBackend(
        path,
        cfg,
        params=w if lora else None,
        max_model_len=MAX_LEN,
        max_num_seqs=SLOTS,
        kv_cache_bytes=32 * 2**20,  # fixed and small: no dependence on the machine's free RAM
        pausable=True,  # the suite holds it at a state (`pause`)
    )


def _jetstream(path: Path, lora: bool) -> RolloutBackend:
    from jax_agent_rl.backends.jetstream.client import JetStreamBackend, ServerSampling

    cfg, w = _served(path, lora)
    return JetStreamBackend(  # JetStream's server in its own venv and process
        path,
        cfg,
        params=w if lora else None,
        sampling=ServerSampling(SERVER_SAMPLING.temperature, SERVER_SAMPLING.top_k),
        max_model_len=MAX_LEN,
        slots=SLOTS,
        warmup=False,  # as the embedded backend here: each program compiles when first needed
    )


def _ray(path: Path, lora: bool) -> RolloutBackend:
    from jax_agent_rl.config import EngineSection, RaySection
    from jax_agent_rl.rollout.ray_pool import RayPool
    from jax_agent_rl.rollout.registry import BackendBuild

    cfg, w = _served(path, lora)
    # one embedded replica as a Ray actor on a one-node cluster: the protocol through the pool
    # and the actor boundary (for the MoE: its expert ids cross it). Routing between replicas
    # (sessions spread by requests in flight, kept on one replica, moved off a dead one) is
    # tests/rollout/test_ray.py's, on two nodes; two replicas here compiled their engines at
    # once, and their setup was the conformance suite's longest (233 s in a fresh-clone run)
    engine = EngineSection(
        max_concurrent=SLOTS,
        max_model_len=MAX_LEN,
        ray=RaySection(address="local", replicas=1, num_cpus=0.5),
        warmup=False,  # as the embedded backend here: each program compiles when first needed
    )
    return RayPool(
        BackendBuild(
            engine,
            DecoderPolicy(cfg),
            w,
            checkpoint=path,
            dtype="float32",
            sharder=one_device_sharder(),
        )
    )


# name -> build(checkpoint, lora): the backend serving the checkpoint, or `lora_policy`
BACKENDS: dict[str, Callable[[Path, bool], RolloutBackend]] = {
    "embedded": _embedded,
    "ray": _ray,
    "vllm": _vllm,
    "jetstream": _jetstream,
}

# how a backend without per-request sampling (JetStream) is started here: greedy, so that its
# results can be compared with the others'
SERVER_SAMPLING = SamplingParams(max_tokens=1, temperature=0.0)


def as_served(backend: RolloutBackend, sampling: SamplingParams) -> SamplingParams:
    """``sampling`` as ``backend`` serves it: unchanged where it samples per request, else the
    server's sampling (and no seed) with the request's budget and stop ids."""
    if backend.capabilities.per_request_sampling:
        return sampling
    return dataclasses.replace(
        sampling,
        temperature=SERVER_SAMPLING.temperature,
        top_k=SERVER_SAMPLING.top_k,
        top_p=SERVER_SAMPLING.top_p,
        seed=None,
    )


def pause(backend: RolloutBackend, request_id: str, tokens: int) -> None:
    """Holds ``backend`` once request ``request_id`` (not sent yet) has produced ``tokens``
    tokens: nothing generates then, and aborts are served, until `resume`. Each backend has
    this test hook (not in the protocol); the Ray pool's replicas are reached in their actors:
    ``request_id`` goes to replica 0 (the pool routes to the fewest requests in flight, the
    lowest index first) and the other replicas hold at once."""
    if not _is_ray(backend):
        backend.pause(request_id, tokens)  # type: ignore[attr-defined]
        return
    import ray

    def hold(replica: Any, index: int) -> None:
        if index == 0:
            replica.backend.pause(request_id, tokens)
        else:
            replica.backend.pause()

    ray.get([a.__ray_call__.remote(hold, i) for i, a in enumerate(_replicas(backend))])


def is_paused(backend: RolloutBackend) -> bool:
    """Whether `pause` has taken effect (on the Ray pool: on replica 0)."""
    if not _is_ray(backend):
        return bool(backend.is_paused())  # type: ignore[attr-defined]
    import ray

    return bool(ray.get(_replicas(backend)[0].__ray_call__.remote(_replica_paused)))


def resume(backend: RolloutBackend) -> None:
    """Undoes `pause`."""
    if not _is_ray(backend):
        backend.resume()  # type: ignore[attr-defined]
        return
    import ray

    ray.get([a.__ray_call__.remote(_replica_resume) for a in _replicas(backend)])


def served_bits(backend: RolloutBackend) -> list[bytes]:
    """The bits of every weight ``backend`` serves, leaf by leaf (a test hook of the backends
    whose weights live in this process or in Ray replicas' embedded engines: each replica's,
    one after the other)."""
    if not _is_ray(backend):
        return _leaf_bits(backend)
    import ray

    per_replica = ray.get([a.__ray_call__.remote(_replica_bits) for a in _replicas(backend)])
    return [bits for replica in per_replica for bits in replica]


def _leaf_bits(backend: Any) -> list[bytes]:
    import numpy as np

    return [np.asarray(jax.device_get(x)).tobytes() for x in jax.tree.leaves(backend._params)]


def _replica_bits(replica: Any) -> list[bytes]:
    return _leaf_bits(replica.backend)


def _replica_paused(replica: Any) -> bool:
    return bool(replica.backend.is_paused())


def _replica_resume(replica: Any) -> None:
    replica.backend.resume()


def _is_ray(backend: RolloutBackend) -> bool:
    from jax_agent_rl.rollout.ray_pool import RayPool

    return isinstance(backend, RayPool)


def _replicas(pool: Any) -> list[Any]:
    """The pool's replica actors, by the names it gives them (none was restarted here)."""
    import ray

    return [ray.get_actor(f"jarl-replica-{i}.0") for i in range(len(pool.in_flight()))]


# the suite's models (HF fields): a dense one, and a mixture of experts with a dense layer
MODELS: dict[str, dict[str, Any]] = {"qwen2": TINY_QWEN2, "qwen3_moe": TINY_QWEN3_MOE}


@pytest.fixture(scope="session", params=sorted(MODELS))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("conformance") / request.param
    return write_hf_checkpoint(folder, MODELS[request.param])


@pytest.fixture(scope="module", params=sorted(BACKENDS))
def backend(request: pytest.FixtureRequest, checkpoint: Path) -> Iterator[RolloutBackend]:
    """Each backend once for the suite's module; the last one closes with the module, not with
    the session (the Ray pool's connection would outlive it into other modules' tests)."""
    be = BACKENDS[request.param](checkpoint, False)
    yield be
    run(be.close())


class Learner:
    """The learner's side: recompute sampled tokens' logprobs with the training forward."""

    def __init__(self, path: Path) -> None:
        self.cfg, self.weights = load_hf(path, sharder=one_device_sharder())
        self._logits = jax.jit(self._logits_impl)

    def _logits_impl(self, w: Weights, tokens: jax.Array) -> jax.Array:
        T = tokens.shape[1]
        positions = jnp.arange(T)[None]
        return lm_logits(
            w,
            forward(
                w,
                self.cfg,
                Packed(tokens, positions, jnp.ones((1, T), jnp.int32)),
                sharder=one_device_sharder(),
            ).hidden,
        )

    def logprobs(
        self,
        prompt: tuple[int, ...],
        sampled: tuple[int, ...],
        sampling: SamplingParams,
        weights: Weights | None = None,
    ) -> np.ndarray:
        seq = np.array([prompt + sampled[:-1]], np.int32)
        logits = self._logits(self.weights if weights is None else weights, seq)[0]
        logits = logits[len(prompt) - 1 :]  # the positions that predicted each sampled token
        n = len(sampled)
        lp = sampling_logprobs(
            logits,
            jnp.full((n,), sampling.temperature),
            jnp.full((n,), sampling.top_k),
            jnp.full((n,), sampling.top_p),
        )
        return np.asarray(token_logprobs(lp, jnp.asarray(sampled)))


@pytest.fixture(scope="session")
def learner(checkpoint: Path) -> Learner:
    return Learner(checkpoint)


@pytest.fixture(scope="session")
def pushes(learner: Learner) -> "Pushes":
    return Pushes(learner)


class Pushes:
    """What the weight-update tests push, and the weights the learner recomputes logprobs
    under: the whole model (``adapters`` None), or a LoRA policy's adapters alone, served on
    the learner's base (the learner's config carrying the `Lora`)."""

    def __init__(self, learner: Learner, adapters: LayerAdapters | None = None) -> None:
        self.learner = learner
        self.start: Weights | LayerAdapters = learner.weights if adapters is None else adapters
        self._lora = adapters is not None

    def other(self, seed: int) -> Weights | LayerAdapters:
        """Another push of the same shapes (what a training step sends)."""
        return perturbed(self.start, seed)

    def weights(self, pushed: Weights | LayerAdapters) -> Weights:
        """The whole weights a backend serves after the push ``pushed``."""
        if self._lora:
            assert isinstance(pushed, LayerAdapters)
            return with_adapters(self.learner.weights, pushed)
        assert isinstance(pushed, Weights)
        return pushed


def perturbed(weights: T, seed: int) -> T:
    """Other weights of the same shapes (what a training step pushes)."""
    leaves, treedef = jax.tree.flatten(weights)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(
        treedef,
        [
            x + 0.5 * jnp.std(x) * jax.random.normal(k, x.shape)
            for x, k in zip(leaves, keys, strict=True)
        ],
    )
