"""launch/tpu_pod.sh: the commands it runs on a TPU VM slice, checked through --dry-run."""

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TPU_POD = ROOT / "launch" / "tpu_pod.sh"
CONFIG = "configs/demo_calculator_cpu.yaml"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(TPU_POD), *args], cwd=ROOT, capture_output=True, text=True, check=False
    )


def _commands(out: str) -> list[str]:
    return [line[2:] for line in out.splitlines() if line.startswith("+ ")]


def test_dry_run_creates_syncs_sets_up_and_runs_on_every_worker() -> None:
    out = _run(
        "--name", "pod", "--zone", "us-west4-a", "--accelerator-type", "v5litepod-16",
        "--spot", "--sync", "/data/model", "--dry-run", CONFIG, "mesh.fsdp=16",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    create, bundle, copy, unpack, mkdir, sync, system, setup, train = _commands(out.stdout)
    assert create == (
        "gcloud compute tpus tpu-vm create pod --zone us-west4-a --accelerator-type "
        "v5litepod-16 --version v2-alpha-tpuv5-lite --spot"
    )
    assert bundle.startswith("git ls-files -z | tar")
    assert copy.startswith("gcloud compute tpus tpu-vm scp ") and copy.endswith("--worker=all")
    for cmd in (unpack, mkdir, system, setup, train):
        assert cmd.startswith("gcloud compute tpus tpu-vm ssh pod --zone us-west4-a --worker=all")
    assert "scp --recurse /data/model pod:/data/" in sync
    assert "python3.11" in system and "bubblewrap" in system
    assert 'bash scripts/setup.sh tpu"' in setup  # .venv with jax[tpu] (scripts/setup.sh)
    assert (
        f".venv/bin/python -m jax_agent_rl.cli train {CONFIG} mesh.fsdp=16 --distributed" in train
    )
    # worker 0 (process 0) streams, the others append to their log only
    assert "agent-worker-number" in train and "2>&1 | tee -a ~/jarl-train.log; else" in train


def test_the_setup_it_runs_installs_jax_tpu_at_the_locked_version() -> None:
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert 'install --quiet "jax[tpu]==$jax_version"' in setup
    lock = (ROOT / "requirements" / "lock.txt").read_text().splitlines()
    assert any(line.startswith("jax==") for line in lock)


def test_an_existing_slice_is_reused_without_an_accelerator_type() -> None:
    out = _run("--name", "pod", "--zone", "z", "--dry-run", CONFIG)
    assert out.returncode == 0, out.stderr
    assert not any(" create " in c for c in _commands(out.stdout))
    assert "--distributed" in _commands(out.stdout)[-1]


def test_help_and_refusals() -> None:
    assert "--accelerator-type" in _run("--help").stdout
    missing = _run("--zone", "z", CONFIG)
    assert missing.returncode == 2 and "--name and --zone are required" in missing.stderr
    no_config = _run("--name", "pod", "--zone", "z", "--dry-run", "nope.yaml")
    assert no_config.returncode == 2 and "no config file nope.yaml" in no_config.stderr
    unknown = _run("--name", "pod", "--zone", "z", "--accelerator-type", "v9-8", CONFIG)
    assert unknown.returncode == 2 and "--version" in unknown.stderr
