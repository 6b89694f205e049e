"""Typed run configuration: frozen dataclasses per concern, filled from YAML plus dotted overrides.

A YAML file only fills in these dataclasses (OmegaConf structured configs do the merging and
type checks). An unknown or misspelled key, a value of the wrong type or outside a ``Literal``
is a `ConfigError` naming the full dotted key and the keys allowed there::

    cfg = load_config("configs/demo.yaml", ["model.dtype=bfloat16", "mesh.fsdp=2"])

Every number is then checked against the range declared on its field (``setting(8, COUNT)``:
steps >= 0, temperature >= 0, top_p in (0, 1], ...) and against the values it must fit
(`check_ranges`: micro-batches split over the mesh, ...), so every command refuses a bad value,
not only ``jarl train``; all such problems are reported at once, one line each. A field that
moved says where it was (``setting(..., was="rollout.max_refills")``), and a config still
spelling the old key is told the new one. Names looked up in registries (backends, filters,
parsers) are checked by ``jarl train``'s pre-run check (`jax_agent_rl.train.check`).

Paths. A relative path in a config (a YAML file or an override) is relative to the current
directory, as on verl's and Hydra's command lines, wherever the YAML file lies. A value
``pkg://<package>/<path>`` names a file inside an installed Python package and is replaced by
that file's path when the config loads, so files shipped with the project work from any
directory: the default ``tools.config`` is ``pkg://jax_agent_rl/configs/tools_default.yaml``.
A run folder's ``config.yaml`` holds every path absolute (`absolute_paths`, against the
directory the run started in), so ``jarl export RUN``, ``jarl eval RUN``, ``jarl traces RUN``
and a resume from ``RUN/config.yaml`` work from any directory.

Modules: `sections` (the dataclasses; `model` the model's, LoRA's among them), `ranges` (what a
number accepts, declared on its field), `checks` (ranges and values that must fit), `load` (YAML
and overrides), `yaml_text` (a config file's text), `paths` (``pkg://`` and run-folder paths).
"""

from jax_agent_rl.config.checks import check_ranges, field_ranges
from jax_agent_rl.config.errors import ConfigError
from jax_agent_rl.config.load import Preview, load_config, preview_config, to_yaml
from jax_agent_rl.config.model import LoraSection, ModelSection
from jax_agent_rl.config.paths import (
    CODE_KEYS,
    CODE_MAP_KEYS,
    PATH_KEYS,
    absolute_paths,
    missing_paths,
    package_file,
)
from jax_agent_rl.config.rollout import (
    EngineSection,
    GroupSection,
    JetStreamSection,
    PushSection,
    RaySection,
    SamplingSection,
    TreeSection,
    VLLMSection,
)
from jax_agent_rl.config.sections import (
    AgentSection,
    AlgorithmSection,
    DataSection,
    EnvSection,
    JarlConfig,
    JudgeSection,
    LearnerSection,
    MeshSection,
    OptimSection,
    SFTSection,
    ToolServerSection,
    ToolsSection,
    TrainerSection,
)

__all__ = [
    "CODE_KEYS",
    "CODE_MAP_KEYS",
    "PATH_KEYS",
    "AgentSection",
    "AlgorithmSection",
    "ConfigError",
    "DataSection",
    "EngineSection",
    "EnvSection",
    "GroupSection",
    "JarlConfig",
    "JetStreamSection",
    "JudgeSection",
    "LearnerSection",
    "LoraSection",
    "MeshSection",
    "ModelSection",
    "OptimSection",
    "Preview",
    "PushSection",
    "RaySection",
    "SFTSection",
    "SamplingSection",
    "ToolServerSection",
    "ToolsSection",
    "TrainerSection",
    "TreeSection",
    "VLLMSection",
    "absolute_paths",
    "check_ranges",
    "field_ranges",
    "load_config",
    "missing_paths",
    "package_file",
    "preview_config",
    "to_yaml",
]
