"""Rollout backends by name: ``rollout.backend`` picks one from here.

The embedded JAX engine is built in. Every other backend (vLLM's and JetStream's in
``jax_agent_rl/backends/``, a user's own) registers a `BackendFactory`, either by calling
`register_backend` or through the ``jax_agent_rl.backends`` entry-point group of its package's
metadata, so nothing else in ``jax_agent_rl`` imports a backend's home: each declares itself in
pyproject.toml

    [project.entry-points."jax_agent_rl.backends"]
    vllm = "jax_agent_rl.backends.vllm.backend:FACTORY"

and is imported only when a run asks for ``rollout.backend=vllm``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from importlib.metadata import entry_points
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jax_agent_rl.rollout.protocol import RolloutBackend
from jax_agent_rl.rollout.stops import Decode

if TYPE_CHECKING:
    from jax_agent_rl.config import RolloutSection
    from jax_agent_rl.engine import Engine
    from jax_agent_rl.models import ModelConfig, Sharder, Weights

ENTRY_POINT_GROUP = "jax_agent_rl.backends"


@dataclasses.dataclass(frozen=True)
class BackendBuild:
    """What every backend is built from: ``params`` (already in ``dtype``) served as weight
    ``version``; ``checkpoint`` is the HF folder they came from, for engines that load their
    own copy first (vLLM) and then receive ``params``. ``sharder`` lays out an in-process
    engine on the run's inference mesh (`models.inference_mesh`); backends that own their
    devices (vLLM's processes) ignore it. ``stop_token_ids`` are the ids every request of the
    run stops at (the chat template's end of turn, the parser's stop tokens): a backend that
    cannot take stop ids per request (JetStream) stops at these server-wide.
    ``on_program(done, total)`` hears of each program an in-process engine compiles before it
    serves (progress for a start that takes a while); other backends may ignore it.
    ``decode``: the run's tokenizer, with which the embedded engine and the JetStream client
    end a request once it completes one of its stop strings (`jax_agent_rl.rollout.stops`);
    without it (a Ray replica), or in vLLM, the request runs on to a stop id or its length and
    the agent loop cuts the result at the stop string all the same."""

    rollout: RolloutSection
    model: ModelConfig
    params: Weights
    checkpoint: str | Path
    dtype: str
    sharder: Sharder
    version: int = 0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()
    on_program: Callable[[int, int], None] | None = None  # (not sent to replicas)
    decode: Decode | None = None  # (not sent to replicas)


def _no_problems(rollout: RolloutSection, processes: int) -> list[str]:
    del rollout, processes
    return []


def _no_placement(rollout: RolloutSection) -> dict[str, str]:
    del rollout
    return {}


@dataclasses.dataclass(frozen=True)
class BackendFactory:
    """``build`` starts the backend; ``check(rollout, processes)`` lists, one line each naming
    the key, what in the rollout section would make ``build`` fail in a run of ``processes``
    processes (``jarl train --dry-run`` and the pre-run check call it, so a missing interpreter
    is reported before any model loads). ``trainer_env(rollout)``: the environment variables
    `jarl train` sets in its own process before JAX starts a backend, for the devices the
    backend's engines leave to the trainer (JetStream's server on chips of its own); it raises
    ``ValueError`` naming the key where ``check`` reports a problem. ``unread``: the rollout
    section's engine settings (``page_size``, ``kv_cache_gib``, ``prefill_chunk``,
    ``steps_per_call``, ``batch_buckets``) that the backend cannot honour, each with why; set
    away from its default, one is refused before the run (`unhonoured`). ``self_tuned``: those
    it does not read because it tunes them itself (speed only: what the run computes is the
    same); set, one is noted, not refused (`tuned_by_backend`), so that a config written for
    the embedded engine runs on this backend as it is."""

    build: Callable[[BackendBuild], RolloutBackend]
    check: Callable[[RolloutSection, int], list[str]] = _no_problems
    trainer_env: Callable[[RolloutSection], dict[str, str]] = _no_placement
    unread: Mapping[str, str] = dataclasses.field(default_factory=dict)
    self_tuned: Mapping[str, str] = dataclasses.field(default_factory=dict)


def unhonoured(rollout: RolloutSection) -> list[str]:
    """One line for each engine setting of ``rollout`` set away from its default that its
    backend cannot honour (`BackendFactory.unread`), naming the key and the backend."""
    return [
        f"rollout.{key}={value!r}: the {rollout.backend} backend cannot honour it ({why}); drop it"
        for key, value, why in _set(rollout, backend_factory(rollout.backend).unread)
    ]


def tuned_by_backend(rollout: RolloutSection) -> list[str]:
    """One note for each speed setting of ``rollout`` set away from its default that its
    backend tunes itself (`BackendFactory.self_tuned`)."""
    return [
        f"rollout.{key}={value!r} is not read by the {rollout.backend} backend ({why})"
        for key, value, why in _set(rollout, backend_factory(rollout.backend).self_tuned)
    ]


def unread_sections(rollout: RolloutSection) -> list[str]:
    """One note for each setting of a backend's own section (``rollout.vllm``,
    ``rollout.jetstream``) set away from its default while ``rollout.backend`` is another:
    no backend reads it (``rollout.vllm.replicas=4`` beside the default backend ran one
    embedded engine, silently)."""
    from jax_agent_rl.config import RolloutSection

    default = RolloutSection()
    return [
        f"rollout.{name}.{f.name}={getattr(getattr(rollout, name), f.name)!r} is read by the "
        f"{name} backend only, and rollout.backend={rollout.backend}: nothing reads it"
        for name in ("vllm", "jetstream")
        if rollout.backend != name
        for f in dataclasses.fields(getattr(rollout, name))
        if getattr(getattr(rollout, name), f.name) != getattr(getattr(default, name), f.name)
    ]


def _set(rollout: RolloutSection, keys: Mapping[str, str]) -> list[tuple[str, Any, str]]:
    from jax_agent_rl.config import RolloutSection

    default = RolloutSection()
    return [
        (key, getattr(rollout, key), why)
        for key, why in keys.items()
        if getattr(rollout, key) != getattr(default, key)
    ]


def make_engine(
    rollout: RolloutSection,
    model: ModelConfig,
    dtype: str,
    sharder: Sharder,
) -> Engine:
    """The embedded engine ``rollout`` describes, serving ``model`` in ``dtype`` on
    ``sharder``'s mesh (its programs compiled for the platform of the mesh's devices: TPU for
    a plan's abstract TPU devices, `engine.compile_platform`)."""
    import jax

    from jax_agent_rl.engine import Engine, cache_dtype, compile_platform, pool_pages

    r = rollout
    model = dataclasses.replace(model, dtype=dtype)  # type: ignore[arg-type]
    # the pages' dtype on the platform the engine compiles for (`Engine.cache_dtype`)
    width = jax.numpy.dtype(cache_dtype(model, compile_platform(sharder))).itemsize
    return Engine(
        model,
        max_concurrent_decodes=r.max_concurrent,
        max_len=r.max_model_len,
        page_size=r.page_size,
        num_pages=pool_pages(
            model, r.page_size, width, r.kv_cache_gib, r.max_concurrent, r.max_model_len
        ),
        prefill_chunk=r.prefill_chunk,
        batch_buckets=r.batch_buckets,
        sharder=sharder,
    )


def _build_embedded(spec: BackendBuild) -> RolloutBackend:
    from jax_agent_rl.rollout.embedded import EmbeddedBackend

    engine = make_engine(spec.rollout, spec.model, spec.dtype, spec.sharder)
    return EmbeddedBackend(
        engine,
        spec.params,
        weight_version=spec.version,
        steps_per_call=spec.rollout.steps_per_call,
        seed=spec.seed,
        warmup=True,
        on_program=spec.on_program,
        decode=spec.decode,
        keep_kv_on_update=spec.rollout.keep_kv_on_update,
    )


_REGISTERED: dict[str, BackendFactory] = {"embedded": BackendFactory(_build_embedded)}


def register_backend(name: str, factory: BackendFactory) -> None:
    """Makes ``rollout.backend=name`` build with ``factory`` (a name taken already is an error)."""
    if name in _REGISTERED or name in _entry_points():
        raise ValueError(f"rollout backend {name!r} is registered already")
    _REGISTERED[name] = factory


def _entry_points() -> dict[str, str]:
    return {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)}


def backend_names() -> list[str]:
    """Every name ``rollout.backend`` accepts, sorted."""
    return sorted({*_REGISTERED, *_entry_points()})


def backend_factory(name: str) -> BackendFactory:
    """The factory registered as ``name``; an entry point is loaded on first use."""
    if name not in _REGISTERED:
        found = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == name]
        if not found:
            raise ValueError(
                f"rollout.backend={name!r} is not a registered backend: use one of "
                f"{backend_names()}"
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
        f"model.lora: rollout.backend={spec.rollout.backend} does not serve LoRA adapters "
        "(its capabilities.lora is false): use a backend that does (embedded, vllm, "
        "jetstream) or model.lora.rank=0"
    )


def make_backend(spec: BackendBuild) -> RolloutBackend:
    """The backend ``spec.rollout.backend`` names, started and serving ``spec.params``."""
    return backend_factory(spec.rollout.backend).build(spec)
