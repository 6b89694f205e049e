"""Orbax checkpoints of a run: policy (and critic) train states plus JSON metadata.

A checkpoint is written asynchronously (training goes on while it is written) into a
temporary folder that orbax renames only once every file is on disk, so a run killed at any
moment leaves either a complete checkpoint or none; `latest_step` only sees complete ones. A
complete checkpoint that cannot be read back (a file of it corrupted or cut short since, a
config whose model it does not fit) is a `CheckpointError` naming its folder.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from jax_agent_rl.config import JarlConfig
from jax_agent_rl.models import (
    CheckpointError,
    ModelConfig,
    Policy,
    Weights,
    abstract_policy,
    one_device_sharder,
    policy_of,
)
from jax_agent_rl.tokenization import Tokenizer
from jax_agent_rl.train.learners import run_model
from jax_agent_rl.train.run_policy import module_policy
from jax_agent_rl.usercode.threads import error_text

RUN_CONFIG = "config.yaml"  # the run folder's resolved config


class RunCheckpoints:
    def __init__(self, directory: Path, keep: int) -> None:
        self.manager = ocp.CheckpointManager(
            directory.absolute(),
            options=ocp.CheckpointManagerOptions(
                max_to_keep=keep, enable_async_checkpointing=True, create=True
            ),
        )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def steps(self) -> list[int]:
        """The steps of every complete checkpoint, oldest first."""
        return sorted(self.manager.all_steps())

    @staticmethod
    def steps_in(directory: Path) -> list[int]:
        """The steps saved in ``directory`` (a run's ``checkpoints``), read without opening it
        (orbax writes a step under another name until it is complete); none if it is not
        there."""
        if not directory.is_dir():
            return []
        return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())

    def drop_after(self, step: int) -> None:
        """Removes every checkpoint after ``step``: a run resumed at ``step`` saves the steps
        it redoes again, and orbax saves no step at or below its latest."""
        for later in self.steps():
            if later > step:
                self.manager.delete(later)

    def save(self, step: int, states: dict[str, Any], meta: dict[str, Any]) -> None:
        """Starts writing; returns as soon as the arrays are copied off the devices."""
        args = {name: ocp.args.StandardSave(state) for name, state in states.items()}
        self.manager.save(step, args=ocp.args.Composite(meta=ocp.args.JsonSave(meta), **args))

    def restore(self, step: int, targets: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """States shaped and sharded like ``targets`` (abstract or concrete), and the metadata."""
        args = {name: ocp.args.StandardRestore(t) for name, t in targets.items()}
        composite = ocp.args.Composite(meta=ocp.args.JsonRestore(), **args)
        with self._reading(step):
            out = self.manager.restore(step, args=composite)
        return {name: out[name] for name in targets}, dict(out["meta"])

    def restore_part(self, step: int, name: str, target: Any) -> Any:
        """Only the leaves of state ``name`` that ``target`` names (a policy's parameters
        without its optimizer state, say), as host numpy arrays shaped like ``target``."""
        restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), target)
        item = ocp.args.PyTreeRestore(target, restore_args=restore_args, partial_restore=True)
        with self._reading(step):
            return self.manager.restore(step, args=ocp.args.Composite(**{name: item}))[name]

    @contextlib.contextmanager
    def _reading(self, step: int) -> Iterator[None]:
        """What orbax raises reading the checkpoint of ``step`` (a bare JSONDecodeError for a
        cut metadata file, TensorStore's spec for a cut array: neither names the checkpoint)
        as a `CheckpointError` naming its folder."""
        try:
            yield
        except Exception as e:
            first = (error_text(e).splitlines() or [type(e).__name__])[0][:300]
            folder = self.manager.directory / str(step)
            raise CheckpointError(
                f"the checkpoint of step {step} ({folder}) cannot be restored: {first}; a file "
                "of it is corrupt or cut short, or the config's model is not the one it saved "
                f"(remove the folder to resume from an earlier one; saved steps: {self.steps()})"
            ) from e

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def checkpoint_step(run_dir: Path, cfg: JarlConfig, step: int | None = None) -> int:
    """``step`` if ``run_dir`` has a complete checkpoint of it, else (``None``) its latest;
    raises `FileNotFoundError` naming the saved steps when there is none, or saying that
    ``run_dir/checkpoints`` is no folder (a file, a FIFO, a link to nowhere or to itself)."""
    folder = run_dir / "checkpoints"
    if (folder.exists() or folder.is_symlink()) and not folder.is_dir():
        raise FileNotFoundError(f"{folder} is not a folder of checkpoints")
    checkpoints = RunCheckpoints(folder, cfg.trainer.keep_checkpoints)
    try:
        saved = checkpoints.steps()
    finally:
        checkpoints.close()
    if not saved or (step is not None and step not in saved):
        wanted = "checkpoint" if step is None else f"checkpoint of step {step}"
        raise FileNotFoundError(f"{run_dir} has no {wanted}; saved steps: {saved}")
    return saved[-1] if step is None else step


def saved_policy(run_dir: Path, cfg: JarlConfig, step: int) -> tuple[Policy, Weights]:
    """The policy ``cfg`` names and its parameters of ``run_dir``'s checkpoint of ``step``
    (not its optimizer state), as host float32 arrays, as the learner keeps them (a LoRA
    run's: its base and adapters)."""
    checkpoints = RunCheckpoints(run_dir / "checkpoints", cfg.trainer.keep_checkpoints)
    try:
        policy: Policy
        if cfg.model.module:  # a custom policy: the one its module makes, as the run did
            tokenizer = Tokenizer.from_pretrained(cfg.model.tokenizer or cfg.model.path)
            policy = module_policy(cfg, tokenizer)
        else:
            policy = policy_of(run_model(cfg, ModelConfig.from_pretrained(cfg.model.path)))
        target = {"params": abstract_policy(policy, one_device_sharder())}
        params = checkpoints.restore_part(step, "policy", target)["params"]
        # (a LoRA run computing in bfloat16 keeps its frozen base so: `master_weights`)
        return policy, jax.tree.map(lambda x: np.asarray(x, np.float32), params)
    finally:
        checkpoints.close()
