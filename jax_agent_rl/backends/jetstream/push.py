"""A weight push to a JetStream server: what the client writes (`write_push`: a folder in
``/dev/shm`` and the ``jarl.Control/Load`` request naming it) and what the server makes of it
(`read_push`: its engine's new weights).

- A plain model: the whole model as an HF checkpoint (`models.save_hf`, in the served dtype).
- A LoRA model (its config's ``lora``): the adapters alone (`models.lora.LayerAdapters`, what a
  learner training them sends), as an HF PEFT adapter folder (`models.adapters.write_peft`,
  fp32); the server keeps its base and puts them on it unmerged, as the embedded engine does.

What the served model cannot take is refused here, before anything is written: adapters for a
plain model, the whole model for a LoRA one, adapters of another structure.
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jax_agent_rl.models import ModelConfig, Weights, load_hf, save_hf
from jax_agent_rl.models.adapters import check_adapters, load_peft, write_peft
from jax_agent_rl.models.lora import LayerAdapters

if TYPE_CHECKING:
    from jax_agent_rl.engine import Engine
    from jax_agent_rl.models.config import DType

SHM_DIR = Path("/dev/shm")


def write_push(
    model: ModelConfig, dtype: str, params: Weights | LayerAdapters
) -> tuple[dict[str, Any], int]:
    """Writes ``params`` for a server serving ``model`` in ``dtype`` into a new folder in
    ``SHM_DIR`` (the caller removes it once loaded); returns the ``Load`` request (JSON
    ``{"path", "adapters"}``) and the bytes pushed (a LoRA push: its tensors')."""
    problem = _refused(model, params)
    if problem is not None:
        raise ValueError(problem)
    folder = Path(tempfile.mkdtemp(prefix="jarl-weights-", dir=SHM_DIR))
    try:
        if isinstance(params, LayerAdapters):  # (`_refused`: to a LoRA model)
            size = write_peft(folder, model, params)
        else:
            cfg = dataclasses.replace(model, dtype=dtype)  # type: ignore[arg-type]
            save_hf(folder, cfg, params)
            size = sum(f.stat().st_size for f in folder.iterdir())
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return {"path": str(folder), "adapters": isinstance(params, LayerAdapters)}, size


def _refused(model: ModelConfig, params: Weights | LayerAdapters) -> str | None:
    """Why a server serving ``model`` cannot take ``params`` (None: it can)."""
    if model.lora is None:
        if isinstance(params, LayerAdapters):
            return (
                "a push of LoRA adapters (LayerAdapters) to a JetStream server whose model has "
                "none: push the whole model's weights"
            )
        return None
    if not isinstance(params, LayerAdapters):
        return (
            f"a LoRA model's JetStream server takes its adapters alone (LayerAdapters), not "
            f"{type(params).__name__}"
        )
    check_adapters(model, params)
    return None


def read_push(engine: Engine, served: Weights, dtype: DType, load: dict[str, Any]) -> Weights:
    """The weights ``engine`` serves after the push ``load`` (`write_push`'s request): a whole
    model's, or ``served`` (its base untouched) with the pushed adapters. A push that does not
    fit the served model is an error naming both."""
    folder, adapters = load["path"], load["adapters"]
    if adapters != (engine.cfg.lora is not None):
        raise ValueError(
            f"{folder}: a push of {'LoRA adapters' if adapters else 'a whole model'} to a "
            f"server {'without' if adapters else 'of'} LoRA adapters"
        )
    if not adapters:
        cfg, weights = load_hf(folder, dtype, sharder=engine.sharder)
        if cfg != engine.cfg:
            raise ValueError(f"{folder} holds a {cfg}, this server serves a {engine.cfg}")
        return engine.load_params(weights)
    cfg, pushed = load_peft(folder, dataclasses.replace(engine.cfg, lora=None))
    if cfg != engine.cfg:
        raise ValueError(
            f"{folder} holds adapters {cfg.lora}, this server serves {engine.cfg.lora}"
        )
    return engine.load_adapters(served, pushed)
