"""Rollout backends by name: ``engine.backend`` picks one from here.

The embedded JAX engine is built in. Every other backend (vLLM's and JetStream's in
``jax_agent_rl/backends/``, a user's own) registers a `BackendFactory`, either by calling
`register_backend` or through the ``jax_agent_rl.backends`` entry-point group of its package's
metadata, so nothing else in ``jax_agent_rl`` imports a backend's home: each declares itself in
pyproject.toml

    [project.entry-points."jax_agent_rl.backends"]
    vllm = "jax_agent_rl.backends.vllm.backend:FACTORY"

and is imported only when a run asks for ``engine.backend=vllm``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from importlib.metadata import entry_points
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jax_agent_rl.config.rollout import SamplingSection
from jax_agent_rl.protocol import RolloutBackend
from jax_agent_rl.rollout.stops import Decode

if TYPE_CHECKING:
    from jax_agent_rl.config import EngineSection
    from jax_agent_rl.engine import Engine
    from jax_agent_rl.models import ModelConfig, Policy, Sharder, Weights

ENTRY_POINT_GROUP = "jax_agent_rl.backends"


@dataclasses.dataclass(frozen=True)
class BackendBuild:
    """What every backend is built from: ``policy`` (`models.Policy`: what computes, and its
    ``cfg``, the sizes every backend reads as ``model``) with ``params`` (already in
    ``dtype``) served as weight ``version``; ``checkpoint`` is the HF folder they came from,
    for engines that load their own copy first (vLLM) and then receive ``params``.
    ``sharder`` lays out an in-process engine on the run's inference mesh
    (`models.inference_mesh`); backends that own their devices (vLLM's processes) ignore it.
    ``stop_token_ids`` are the ids every request of the run stops at (the chat template's end
    of turn, the parser's stop tokens): a backend that cannot take stop ids per request
    (JetStream) stops at these server-wide.
    ``on_program(done, total)`` hears of each program an in-process engine compiles before it
    serves (progress for a start that takes a while); other backends may ignore it.
    ``decode``: the run's tokenizer, with which the embedded engine and the JetStream client
    end a request once it completes one of its stop strings (`jax_agent_rl.rollout.stops`);
    without it (a Ray replica), or in vLLM, the request runs on to a stop id or its length and
    the agent loop cuts the result at the stop string all the same."""

    engine: EngineSection
    policy: Policy
    params: Weights
    checkpoint: str | Path
    dtype: str
    sharder: Sharder
    version: int = 0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()
    on_program: Callable[[int, int], None] | None = None  # (not sent to replicas)
    decode: Decode | None = None  # (not sent to replicas)
    # how every request samples, for a backend that samples server-wide (JetStream); the
    # others take each request's own
    sampling: SamplingSection = dataclasses.field(default_factory=SamplingSection)

    @property
    def model(self) -> ModelConfig:
        return self.policy.cfg


def _no_problems(engine: EngineSection, processes: int) -> list[str]:
    del engine, processes
    return []


def _no_notes(engine: EngineSection) -> list[str]:
    del engine
    return []


def _no_placement(engine: EngineSection) -> dict[str, str]:
    del engine
    return {}


@dataclasses.dataclass(frozen=True)
class BackendFactory:
    """``build`` starts the backend; ``check(engine, processes)`` lists, one line each naming
    the key, what in the engine section would make ``build`` fail in a run of ``processes``
    processes (``jarl train --dry-run`` and the pre-run check call it, so a missing interpreter
    is reported before any model loads). ``trainer_env(engine)``: the environment variables
    `jarl train` sets in its own process before JAX starts a backend, for the devices the
    backend's engines leave to the trainer (JetStream's server on chips of its own); it raises
    ``ValueError`` naming the key where ``check`` reports a problem. ``unread``: the engine
    section's settings (``page_size``, ``kv_cache_gib``, ``prefill_chunk``,
    ``steps_per_call``, ``batch_buckets``, ``warmup``) that the backend cannot honour, each
    with why; set away from its default, one is refused before the run (`unhonoured`).
    ``self_tuned``: those it does not read because it tunes them itself (speed only: what the
    run computes is the same); set, one is noted, not refused (`tuned_by_backend`), so that a
    config written for the embedded engine runs on this backend as it is. ``notes(engine)``:
    what the backend will choose by itself that a user should hear before the run (the vllm
    backend's weight transport), one line each."""

    build: Callable[[BackendBuild], RolloutBackend]
    check: Callable[[EngineSection, int], list[str]] = _no_problems
    trainer_env: Callable[[EngineSection], dict[str, str]] = _no_placement
    unread: Mapping[str, str] = dataclasses.field(default_factory=dict)
    self_tuned: Mapping[str, str] = dataclasses.field(default_factory=dict)
    notes: Callable[[EngineSection], list[str]] = _no_notes


def unhonoured(engine: EngineSection) -> list[str]:
    """One line for each setting of ``engine`` set away from its default that its
    backend cannot honour (`BackendFactory.unread`), naming the key and the backend."""
    return [
        f"engine.{key}={value!r}: the {engine.backend} backend cannot honour it ({why}); drop it"
        for key, value, why in _set(engine, backend_factory(engine.backend).unread)
    ]


def tuned_by_backend(engine: EngineSection) -> list[str]:
    """One note for each speed setting of ``engine`` set away from its default that its
    backend tunes itself (`BackendFactory.self_tuned`)."""
    return [
        f"engine.{key}={value!r} is not read by the {engine.backend} backend ({why})"
        for key, value, why in _set(engine, backend_factory(engine.backend).self_tuned)
    ]


def unread_sections(engine: EngineSection) -> list[str]:
    """One note for each setting of a backend's own section (``engine.vllm``,
    ``engine.jetstream``) set away from its default while ``engine.backend`` is another, and
    of ``engine.ray`` while its address is empty: nothing reads it (``engine.vllm.replicas=4``
    beside the default backend ran one embedded engine, silently)."""
    from jax_agent_rl.config import EngineSection

    default = EngineSection()
    notes = [
        f"engine.{name}.{f.name}={getattr(getattr(engine, name), f.name)!r} is read by the "
        f"{name} backend only, and engine.backend={engine.backend}: nothing reads it"
        for name in ("vllm", "jetstream")
        if engine.backend != name
        for f in dataclasses.fields(getattr(engine, name))
        if getattr(getattr(engine, name), f.name) != getattr(getattr(default, name), f.name)
    ]
    # engine.ray's settings place replicas on a cluster: with its address empty (no Ray),
    # engine.ray.replicas=4 ran one engine here, silently (tool_servers is refused instead)
    return notes + [
        f"engine.ray.{f.name}={getattr(engine.ray, f.name)!r} is read on a Ray cluster only, "
        "and engine.ray.address is empty (no Ray: one engine runs here): nothing reads it"
        for f in dataclasses.fields(engine.ray)
        if not engine.ray.address
        and f.name not in ("address", "tool_servers")
        and getattr(engine.ray, f.name) != getattr(default.ray, f.name)
    ]


def _set(engine: EngineSection, keys: Mapping[str, str]) -> list[tuple[str, Any, str]]:
    from jax_agent_rl.config import EngineSection

    default = EngineSection()
    return [
        (key, getattr(engine, key), why)
        for key, why in keys.items()
        if getattr(engine, key) != getattr(default, key)
    ]


def make_engine(
    engine: EngineSection,
    policy: Policy,
    dtype: str,
    sharder: Sharder,
) -> Engine:
    """The embedded engine ``engine`` describes, serving ``policy`` in ``dtype`` on
    ``sharder``'s mesh (its programs compiled for the platform of the mesh's devices: TPU for
    a plan's abstract TPU devices, `engine.compile_platform`)."""
    import jax

    from jax_agent_rl.engine import Engine, cache_dtype, compile_platform, pool_pages

    r = engine
    policy = policy.in_dtype(dtype)
    model = policy.cfg
    # the pages' dtype on the platform the engine compiles for (`Engine.cache_dtype`)
    width = jax.numpy.dtype(cache_dtype(model, compile_platform(sharder))).itemsize
    return Engine(
        policy,
        max_concurrent_decodes=r.max_concurrent,
        max_len=r.max_model_len,
        page_size=r.page_size,
        num_pages=pool_pages(
            model, r.page_size, width, r.kv_cache_gib, r.max_concurrent, r.max_model_len
        ),
        prefill_chunk=r.prefill_chunk,
        max_step_tokens=r.max_step_tokens,
        batch_buckets=r.batch_buckets,
        sharder=sharder,
    )


def _build_embedded(spec: BackendBuild) -> RolloutBackend:
    from jax_agent_rl.rollout.embedded import EmbeddedBackend

    engine = make_engine(spec.engine, spec.policy, spec.dtype, spec.sharder)
    return EmbeddedBackend(
        engine,
        spec.params,
        weight_version=spec.version,
        steps_per_call=spec.engine.steps_per_call,
        seed=spec.seed,
        warmup=spec.engine.warmup,
        on_program=spec.on_program,
        decode=spec.decode,
        keep_kv_on_update=spec.engine.keep_kv_on_update,
        staged_push=spec.engine.push.staged,
    )


_REGISTERED: dict[str, BackendFactory] = {"embedded": BackendFactory(_build_embedded)}


def register_backend(name: str, factory: BackendFactory) -> None:
    """Makes ``engine.backend=name`` build with ``factory`` (a name taken already is an error)."""
    if name in _REGISTERED or name in _entry_points():
        raise ValueError(f"rollout backend {name!r} is registered already")
    _REGISTERED[name] = factory


def _entry_points() -> dict[str, str]:
    return {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)}


def backend_names() -> list[str]:
    """Every name ``engine.backend`` accepts, sorted."""
    return sorted({*_REGISTERED, *_entry_points()})


def backend_factory(name: str) -> BackendFactory:
    """The factory registered as ``name``; an entry point is loaded on first use."""
    if name not in _REGISTERED:
        found = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == name]
        if not found:
            raise ValueError(
                f"engine.backend={name!r} is not a registered backend: use one of {backend_names()}"
            )
        factory = found[0].load()
        if not isinstance(factory, BackendFactory):
            raise TypeError(
                f"entry point {found[0].value!r} of rollout backend {name!r} is not a "
                "BackendFactory"
            )
        _REGISTERED[name] = factory
    return _REGISTERED[name]


def lora_problem(spec: BackendBuild, backend: RolloutBackend) -> str | None:
    """Why ``backend``, built from ``spec``, cannot serve the run (None: it can): its policy
    carries LoRA adapters (``model.lora``), which a run pushes alone, and the backend does not
    declare `Capabilities.lora` (every built-in backend does)."""
    if spec.model.lora is None or backend.capabilities.lora:
        return None
    return (
        f"model.lora: engine.backend={spec.engine.backend} does not serve LoRA adapters "
        "(its capabilities.lora is false): use a backend that does (embedded, vllm, "
        "jetstream) or model.lora.rank=0"
    )


def make_backend(spec: BackendBuild) -> RolloutBackend:
    """The backend ``spec.engine.backend`` names, started and serving ``spec.params``."""
    return backend_factory(spec.engine.backend).build(spec)
