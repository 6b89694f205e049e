"""RoPE as config.json describes it: the default frequencies and Llama 3.1's scaling."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from jax_agent_rl.models.config_checks import (
    UnsupportedConfigError,
    check_positive,
    check_size,
    shown,
)

# the largest max_position_embeddings accepted (far above any real context: 10M positions)
MAX_POSITIONS = 1 << 24


@dataclasses.dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1's frequency-dependent RoPE scaling (``rope_type: llama3``)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self) -> None:
        for name, value in llama3_values("rope_parameters", dataclasses.asdict(self)).items():
            object.__setattr__(self, name, value)


def llama3_values(key: str, values: dict[str, Any]) -> dict[str, Any]:
    """`Llama3RopeScaling`'s fields checked, the factors as floats; errors name ``key.field``."""
    out = dict(values)
    for name in ("factor", "low_freq_factor", "high_freq_factor"):  # stored as floats
        out[name] = check_positive(f"{key}.{name}", values[name])
    low, high = out["low_freq_factor"], out["high_freq_factor"]
    if high <= low:  # the smooth interpolation divides by their difference
        raise UnsupportedConfigError(
            f"{key}.high_freq_factor={high} must exceed low_freq_factor={low}"
        )
    check_size(
        f"{key}.original_max_position_embeddings",
        values["original_max_position_embeddings"],
        MAX_POSITIONS,
    )
    return out


def rope_from_hf(hf: dict[str, Any]) -> tuple[float, Llama3RopeScaling | None]:
    """Reads RoPE from either layout: ``rope_parameters`` (transformers 5) or ``rope_theta`` +
    ``rope_scaling`` (older checkpoints). Errors name the field as config.json spells it; both
    layouts given must agree, and so must ``rope_type`` and its older spelling ``type``."""
    for field in ("rope_parameters", "rope_scaling"):
        if not isinstance(hf.get(field, {}), dict | None):
            raise UnsupportedConfigError(
                f"{field}={shown(hf[field])}: expected a JSON object or null"
            )
    given = {f: _rope_fields(f, hf[f]) for f in ("rope_parameters", "rope_scaling") if hf.get(f)}
    for field, params in given.items():
        if params.get("rope_type", "default") not in ("default", "llama3"):
            raise UnsupportedConfigError(
                f"{field}.rope_type={shown(params['rope_type'])} is not supported (only "
                "'default', 'llama3')"
            )
    if len(given) == 2:
        new, old = given.values()
        clash = sorted(k for k in old if new.get(k, old) != old[k])  # (old: absent from new)
        if clash:
            raise UnsupportedConfigError(
                f"rope_parameters and rope_scaling disagree on {shown(clash)}: give one"
            )
    field = next(iter(given), "rope_parameters")
    params = dict(given.get(field, {}))
    theta = params.pop("rope_theta", hf.get("rope_theta", 10000.0))
    if hf.get("rope_theta", theta) != theta:
        raise UnsupportedConfigError(
            f"rope_theta={shown(hf['rope_theta'])} and {field}.rope_theta={shown(theta)} "
            "disagree: give one"
        )
    rope_type = params.pop("rope_type", "default")
    if rope_type == "default":
        if params:  # partial_rotary_factor, mrope_section, ...: each changes the forward pass
            raise UnsupportedConfigError(
                f"{field}: fields {shown(sorted(params))} are not supported with "
                "rope_type 'default'"
            )
        return theta, None
    fields = {f.name for f in dataclasses.fields(Llama3RopeScaling)}
    extra, missing = sorted(set(params) - fields), sorted(fields - set(params))
    if extra or missing:
        raise UnsupportedConfigError(
            f"{field}: llama3 rope scaling: unexpected fields {extra}, missing fields {missing}"
        )
    return theta, Llama3RopeScaling(**llama3_values(field, params))


def _rope_fields(field: str, params: dict[str, Any]) -> dict[str, Any]:
    """``params`` with the older ``type`` read as ``rope_type`` (both given must agree)."""
    out = dict(params)
    if "type" in out:
        older = out.pop("type")
        if out.setdefault("rope_type", older) != older:
            raise UnsupportedConfigError(
                f"{field}.rope_type={shown(out['rope_type'])} and {field}.type="
                f"{shown(older)} disagree: give one"
            )
    return out


def rope_inv_freq(head_dim: int, theta: float, scaling: Llama3RopeScaling | None) -> np.ndarray:
    """Inverse RoPE frequencies [head_dim // 2], float32, as HF computes them.

    Default: ``1 / theta ** (2i / d)``. Llama 3 scaling divides the low frequencies (wavelength
    above ``L / low_freq_factor``, ``L`` the original context) by ``factor``, keeps the high ones
    (wavelength below ``L / high_freq_factor``) and interpolates smoothly in between.
    """
    d = head_dim
    inv = (1.0 / theta ** (np.arange(0, d, 2, dtype=np.float32) / np.float32(d))).astype(np.float32)
    s = scaling
    if s is None:
        return inv
    wavelen = 2 * math.pi / inv
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    scaled = np.where(wavelen > low_wavelen, inv / s.factor, inv)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)
