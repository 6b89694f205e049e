"""Datasets in verl's column layout and synthetic tasks."""

from jax_agent_rl.data.datasets import DatasetError, PromptSampler, load_samples, write_jsonl

__all__ = ["DatasetError", "PromptSampler", "load_samples", "write_jsonl"]
