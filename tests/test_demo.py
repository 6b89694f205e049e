"""The demo's closing list of what the run wrote: read from the run folder, so every file and
folder there is named (the HF export ``hf/`` included), the known ones described."""

from pathlib import Path

from jax_agent_rl.cli.demo import OUTPUTS, lora_phases, run_outputs, task_files


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


def test_the_lora_demo_sfts_every_weight_then_trains_adapters_on_that_policy(
    tmp_path: Path,
) -> None:
    """``jarl demo --lora``: adapters on the random-init base would learn nothing, so the first
    run is the demo's SFT of every weight (no RL) and the second trains rank-16 adapters on its
    export (no SFT); a user's override reaches both, and cannot make the SFT a LoRA one."""
    files = task_files(tmp_path / "task")
    sft, rl = lora_phases(tmp_path, files, ["optim.grad_clip=0.5", "model.lora.rank=8"])
    assert sft.model.lora.rank == 0 and sft.trainer.steps == 0 and sft.sft.steps > 0
    assert sft.trainer.run_dir == str(tmp_path / "sft") and sft.model.path == str(files.model)
    assert (rl.model.lora.rank, rl.model.lora.alpha) == (8, 32)  # alpha from the LoRA config
    assert rl.model.path == str(tmp_path / "sft" / "hf") and not rl.sft.data
    assert rl.trainer.run_dir == str(tmp_path) and rl.trainer.steps > 0
    assert sft.optim.grad_clip == rl.optim.grad_clip == 0.5
