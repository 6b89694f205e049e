"""Datasets in verl's column layout and synthetic tasks."""

from jax_agent_rl.data.datasets import DatasetError, PromptSampler, load_samples, write_jsonl
from jax_agent_rl.data.sample import Sample

__all__ = ["DatasetError", "PromptSampler", "Sample", "load_samples", "write_jsonl"]
