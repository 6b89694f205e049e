"""The twenty-first adversarial pass (the merged result of the rollout section's split, the
learner's TrainSequence and verl's wing).

- A config's bare ``rollout:`` (every line under it commented out, ``rollout: {}``, or the
  override ``rollout=...``) was refused as an unknown key, naming none of the sections its
  keys moved to; it names engine, group and sampling now, as ``rollout.n`` names group.n.
- ``jarl eval`` of data.val prompts longer than engine.max_model_len ran every episode to
  ``max_model_len`` before its first token and printed a pass table of wrong answers, with no
  word (``jarl train --dry-run`` checked data.train's prompts only); both now refuse it,
  naming data.val, before the weights load.
- ``engine.ray.replicas=4`` (or any engine.ray setting but tool_servers, refused) with
  ``engine.ray.address`` empty ran one engine here, with no word, as ``engine.vllm.*`` beside
  another backend did before the twentieth pass; the pre-run check notes each.
- ``jarl eval RUN`` and ``jarl export RUN`` of a run made before the split refused its
  config.yaml's old key ("config key 'rollout.backend' is now 'engine.backend'") naming no
  file, where the user had named only the folder; a problem of the run's file names it (an
  override's does not).
- An interpolation of a moved key (``${rollout.temperature}``) said only that the key was not
  found; it names the key's new one."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from jax_agent_rl.config import EngineSection, load_config
from jax_agent_rl.config.rollout import RaySection
from jax_agent_rl.demo import make_checkpoint
from jax_agent_rl.errors import ConfigError
from jax_agent_rl.rollout.registry import unread_sections
from jax_agent_rl.train.check import check_run
from jax_agent_rl.train.evaluation import EvalInputError, eval_target
from jax_agent_rl.train.export import export_run

REQUIRED = "model:\n  path: /m\ndata:\n  train: /d\n"


@pytest.mark.parametrize("section", ["rollout:\n", "rollout: {}\n", "rollout: 5\n"])
def test_the_split_rollout_section_names_where_its_keys_went(tmp_path: Path, section: str) -> None:
    (tmp_path / "run.yaml").write_text(REQUIRED + section)
    with pytest.raises(ConfigError, match=r"'rollout' split.*engine, group, sampling"):
        load_config(tmp_path / "run.yaml")


def test_an_empty_section_that_still_exists_loads(tmp_path: Path) -> None:
    (tmp_path / "run.yaml").write_text(REQUIRED + "agent: {}\n")
    assert load_config(tmp_path / "run.yaml").group.n == 8


def test_held_out_prompts_that_leave_no_room_are_refused(tmp_path: Path) -> None:
    make_checkpoint(tmp_path / "ckpt", "tiny", 0)
    short = {"prompt": [{"role": "user", "content": "1 + 1?"}], "ground_truth": "2"}
    long = {"prompt": [{"role": "user", "content": "1 + 1? " * 200}], "ground_truth": "2"}
    (tmp_path / "train.jsonl").write_text(json.dumps(short) + "\n")
    (tmp_path / "val.jsonl").write_text(json.dumps(short) + "\n" + json.dumps(long) + "\n")
    config = tmp_path / "config.yaml"
    config.write_text(
        f"model:\n  path: {tmp_path / 'ckpt'}\nengine:\n  max_model_len: 512\n"
        f"data:\n  train: {tmp_path / 'train.jsonl'}\n  val: {tmp_path / 'val.jsonl'}\n"
    )
    no_room = r"engine.max_model_len=512 leaves no room .* a prompt of data.val is \d+ tokens"
    with pytest.raises(EvalInputError, match=no_room):
        eval_target(str(config))
    problems = check_run(load_config(config))
    assert [p for p in problems if "leaves no room" in p and "data.val" in p], problems
    assert not [p for p in problems if "data.train is" in p], problems


def test_ray_settings_without_a_cluster_are_noted() -> None:
    ray = RaySection(replicas=4, num_gpus=1.0)
    notes = unread_sections(EngineSection(ray=ray))
    assert len(notes) == 2 and all("engine.ray.address is empty" in n for n in notes), notes
    assert "engine.ray.replicas=4" in notes[0] and "engine.ray.num_gpus=1.0" in notes[1]
    on_a_cluster = dataclasses.replace(ray, address="auto")
    assert unread_sections(EngineSection(ray=on_a_cluster)) == []


def test_eval_of_a_run_with_an_old_key_names_its_config_file(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(REQUIRED + "rollout:\n  backend: embedded\n")
    with pytest.raises(ConfigError, match=r"run/config\.yaml: config key 'rollout\.backend'"):
        eval_target(str(run))
    (run / "config.yaml").write_text(REQUIRED)
    with pytest.raises(ConfigError) as refused:
        eval_target(str(run), overrides=["group.x=1"])
    assert "config.yaml" not in str(refused.value)


def test_export_of_a_run_with_an_old_key_names_its_config_file(tmp_path: Path) -> None:
    (tmp_path / "config.yaml").write_text(REQUIRED + "rollout:\n  n: 4\n")
    with pytest.raises(ConfigError, match=r"config\.yaml: config key 'rollout\.n' is now"):
        export_run(tmp_path)


def test_an_interpolation_of_a_moved_key_names_its_new_key(tmp_path: Path) -> None:
    (tmp_path / "run.yaml").write_text(
        REQUIRED + "sampling:\n  temperature: ${rollout.temperature}\n"
    )
    with pytest.raises(ConfigError, match=r"'rollout\.temperature' is now 'sampling\.temperature'"):
        load_config(tmp_path / "run.yaml")
