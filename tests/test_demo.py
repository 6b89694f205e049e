"""The demo's closing list of what the run wrote: read from the run folder, so every file and
folder there is named (the HF export ``hf/`` included), the known ones described."""

from pathlib import Path

from jax_agent_rl.demo import OUTPUTS, run_outputs


def test_the_closing_list_names_everything_the_run_folder_holds(tmp_path: Path) -> None:
    for folder in ("hf", "checkpoints", "tensorboard", "task", "eval"):
        (tmp_path / folder).mkdir()
    for name in ("metrics.jsonl", "reward.png", "throughput.png", "traces.jsonl", "config.yaml"):
        (tmp_path / name).write_text("")
    lines = run_outputs(tmp_path)
    assert len(lines) == 10
    named = [line.split()[0] for line in lines]
    assert named[:9] == [
        f"{tmp_path / 'reward.png'}",
        f"{tmp_path / 'throughput.png'}",
        f"{tmp_path / 'metrics.jsonl'}",
        f"{tmp_path / 'tensorboard'}/",
        f"{tmp_path / 'traces.jsonl'}",
        f"{tmp_path / 'checkpoints'}/",
        f"{tmp_path / 'hf'}/",
        f"{tmp_path / 'config.yaml'}",
        f"{tmp_path / 'task'}/",
    ]  # in OUTPUTS' order; a name it does not know comes last, undescribed
    assert lines[6].endswith(OUTPUTS["hf"]) and named[9] == f"{tmp_path / 'eval'}/"
    assert lines[9].rstrip() == f"  {tmp_path / 'eval'}/"
