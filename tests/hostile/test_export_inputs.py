"""`jarl export` against careless inputs: an --out that already holds another export's files.

The run folder is made by hand (a LoRA run's config); what is refused is refused before any
checkpoint or weight is read, so none is written."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from jax_agent_rl.cli import main
from jax_agent_rl.config import load_config, to_yaml


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A LoRA run's folder (its config.yaml) over a base folder; no step saved, and nothing
    in the base is read before what is refused is."""
    where = tmp_path_factory.mktemp("lora")
    source, run_dir = where / "source", where / "run"
    source.mkdir()
    cfg = load_config(
        None,
        [
            *(f"model.path={source}", "data.train=t", f"trainer.run_dir={run_dir}"),
            *("model.lora.rank=4", "model.lora.alpha=8", "model.lora.targets=[q,o,down]"),
        ],
    )
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    return run_dir


def test_an_export_into_another_exports_folder_is_refused(
    lora_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``jarl export RUN --out X`` (the adapters) then ``jarl export RUN --merge --out X``
    wrote the merged checkpoint beside the adapter folder's files (exit 0), and transformers
    loads such a folder as the adapter on a base, so what loaded X was neither export
    (measured on a tiny qwen3: logits off the merged export's by up to 1.27). An --out that
    exists and is not an empty folder (or is a file) is refused, naming it, before a checkpoint
    is read, and nothing in it changes; an empty folder passes (this run has no step saved,
    which is what then stops it)."""
    out = tmp_path / "x"
    out.mkdir()
    (out / "adapter_config.json").write_text('{"peft_type": "LORA"}')
    (tmp_path / "file").write_text("x")
    for taken in (out, tmp_path / "file"):
        assert main(["export", str(lora_run), "--merge", "--out", str(taken)]) == 2
        assert f"--out {taken} exists and is not an empty folder" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["adapter_config.json"]
    assert (out / "adapter_config.json").read_text() == '{"peft_type": "LORA"}'
    (tmp_path / "empty").mkdir()
    assert main(["export", str(lora_run), "--merge", "--out", str(tmp_path / "empty")]) == 2
    assert "exists and is not an empty folder" not in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["file", "fifo", "link loop"])
def test_checkpoints_that_are_no_folder_are_named(
    lora_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    """A run's ``checkpoints`` that is a file or a FIFO was told "has no checkpoint; saved
    steps: []", and a link to itself "[Errno 17] File exists"."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text((lora_run / "config.yaml").read_text())
    checkpoints = run / "checkpoints"
    if kind == "file":
        checkpoints.write_text("x")
    elif kind == "fifo":
        os.mkfifo(checkpoints)
    else:
        checkpoints.symlink_to(checkpoints)
    assert main(["export", str(run), "--out", str(tmp_path / "out")]) == 2
    assert f"{checkpoints} is not a folder of checkpoints" in capsys.readouterr().err
