"""launch/tpu_pod.sh: the commands it runs on a TPU VM slice, checked through --dry-run."""

import importlib.metadata
import json
import os
import subprocess
from pathlib import Path

from packaging.requirements import Requirement

from jax_agent_rl.plan.presets import PRESETS

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
    plan, create, bundle, copy, unpack, mkdir, sync, system, setup, start, follow = _commands(
        out.stdout
    )
    # before any slice: the run compiled for the slice's topology (jarl plan), here
    assert plan == (
        f".venv/bin/python -m jax_agent_rl.cli plan {CONFIG} mesh.fsdp=16 --topology v5e-16"
    )
    assert create == (
        "gcloud compute tpus tpu-vm create pod --zone us-west4-a --accelerator-type "
        "v5litepod-16 --version v2-alpha-tpuv5-lite --spot"
    )
    assert bundle.startswith("git ls-files -z | tar")
    assert copy.startswith("gcloud compute tpus tpu-vm scp ") and copy.endswith("--worker=all")
    for cmd in (unpack, mkdir, system, setup, start):
        assert cmd.startswith("gcloud compute tpus tpu-vm ssh pod --zone us-west4-a --worker=all")
    assert "scp --recurse /data/model pod:/data/" in sync
    assert "python3.11" in system and "bubblewrap" in system
    assert 'bash scripts/setup.sh tpu"' in setup  # .venv with the locked libtpu
    assert "setsid nohup bash .jarl/run.sh" in start  # detached: a dropped ssh does not stop it
    assert follow.endswith("--worker=0 --command bash ~/jax_agent_rl/.jarl/follow.sh")
    run = _scripts(out.stdout)["run.sh"]
    assert f".venv/bin/python -m jax_agent_rl.cli train {CONFIG} mesh.fsdp=16 --distributed" in run


def _scripts(out: str) -> dict[str, str]:
    """The .jarl/ scripts a dry run prints (``# .jarl/NAME:`` then ``#   `` lines)."""
    scripts: dict[str, list[str]] = {}
    name = ""
    for line in out.splitlines():
        if line.startswith("# .jarl/"):
            name = line[len("# .jarl/") : -1]
            scripts[name] = []
        elif line.startswith("#   ") and name:
            scripts[name].append(line[4:])
    return {k: "\n".join(v) + "\n" for k, v in scripts.items()}


def test_the_workers_scripts_run_detached_and_follow_to_the_exit_code(tmp_path: Path) -> None:
    """The run script and the follower, run as a worker runs them (with an interpreter that
    prints its arguments and exits 3 in place of the training): the follower prints the log
    and ends with the run's exit code; quoted overrides arrive as single arguments."""
    out = _run(
        "--name", "pod", "--zone", "z", "--no-plan", "--dry-run", CONFIG, "trainer.run_dir=a b"
    )
    assert out.returncode == 0, out.stderr
    worker = tmp_path / "jax_agent_rl"
    (worker / ".jarl").mkdir(parents=True)
    for name, text in _scripts(out.stdout).items():
        (worker / ".jarl" / name).write_text(text)
    python = worker / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text('#!/usr/bin/env bash\nfor a in "$@"; do echo "arg[$a]"; done\nexit 3\n')
    python.chmod(0o755)
    env = {"HOME": str(tmp_path), "PATH": "/usr/bin:/bin"}
    subprocess.run(
        "setsid nohup bash .jarl/run.sh > /dev/null 2>&1 < /dev/null &",
        shell=True, cwd=worker, env=env, check=True,
    )  # fmt: skip
    follow = subprocess.run(
        ["bash", str(worker / ".jarl" / "follow.sh")],
        env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert follow.returncode == 3
    assert "arg[trainer.run_dir=a b]" in follow.stdout and "arg[--distributed]" in follow.stdout


def test_the_setup_it_runs_installs_the_libtpu_jax_tpu_pins_for_the_locked_jax() -> None:
    """A slice's workers (`setup.sh tpu`), their JetStream servers (`setup.sh jetstream` on a TPU
    VM) and `jarl plan` (`setup.sh tpu-plan`) take libtpu from requirements/tpu-lock.txt: the
    release jax[tpu] asks for at the locked jax version, which both venvs lock."""
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert "add_to_venv tpu-plan requirements/tpu-lock.txt libtpu" in setup
    # the tpu and jetstream environments
    assert setup.count('uv_install "$venv/bin/python" --no-deps -r requirements/tpu-lock.txt') == 2
    versions = set()
    for name in ("lock.txt", "jetstream-lock.txt"):
        lock = (ROOT / "requirements" / name).read_text().splitlines()
        versions |= {line.removeprefix("jax==") for line in lock if line.startswith("jax==")}
    (jax_version,) = versions
    assert importlib.metadata.version("jax") == jax_version
    wanted = [
        Requirement(r)
        for r in importlib.metadata.requires("jax") or []
        if r.startswith("libtpu") and 'extra == "tpu"' in r
    ]
    pins = [
        line
        for line in (ROOT / "requirements" / "tpu-lock.txt").read_text().splitlines()
        if line and not line.startswith("#")
    ]
    assert len(wanted) == 1 and pins and pins[0].startswith("libtpu==")
    assert wanted[0].specifier.contains(pins[0].removeprefix("libtpu=="))


def test_an_existing_slice_is_reused_without_an_accelerator_type() -> None:
    out = _run("--name", "pod", "--zone", "z", "--no-plan", "--dry-run", CONFIG)
    assert out.returncode == 0, out.stderr
    assert not any(" create " in c for c in _commands(out.stdout))
    assert "--distributed" in _scripts(out.stdout)["run.sh"]


def test_help_and_refusals() -> None:
    assert "--accelerator-type" in _run("--help").stdout
    missing = _run("--zone", "z", CONFIG)
    assert missing.returncode == 2 and "--name and --zone are required" in missing.stderr
    no_config = _run("--name", "pod", "--zone", "z", "--dry-run", "nope.yaml")
    assert no_config.returncode == 2 and "no config file nope.yaml" in no_config.stderr
    unknown = _run("--name", "pod", "--zone", "z", "--accelerator-type", "v9-8", CONFIG)
    assert unknown.returncode == 2 and "--version" in unknown.stderr
    no_topology = _run("--name", "pod", "--zone", "z", "--dry-run", CONFIG)
    assert no_topology.returncode == 2 and "pass --accelerator-type (or --no-plan)" in (
        no_topology.stderr
    )


def test_a_jetstream_run_sets_up_the_server_venv_on_every_worker() -> None:
    """engine.backend=jetstream (from the config or an override): every worker also builds
    .venv-jetstream, which `scripts/setup.sh jetstream` gives the locked libtpu on a TPU VM, so
    each worker's server opens the chips engine.jetstream.chips gives it."""
    chips = ("engine.backend=jetstream", "engine.jetstream.chips=4,5,6,7")
    out = _run("--name", "pod", "--zone", "z", "--no-plan", "--dry-run", CONFIG, *chips)
    assert out.returncode == 0, out.stderr
    setups = [c for c in _commands(out.stdout) if "scripts/setup.sh" in c]
    assert [c.split("--worker=all --command ")[1] for c in setups] == [
        '"cd ~/jax_agent_rl && PYTHON=python3.11 bash scripts/setup.sh tpu"',
        '"cd ~/jax_agent_rl && PYTHON=python3.11 bash scripts/setup.sh jetstream"',
    ]
    run = _scripts(out.stdout)["run.sh"]
    # (bash's %q quoting: the worker's shell reads 4\,5 as 4,5)
    assert f"train {CONFIG} engine.backend=jetstream engine.jetstream.chips=4\\,5\\,6\\,7 " in run
    embedded = _run("--name", "pod", "--zone", "z", "--no-plan", "--dry-run", CONFIG)
    assert [c for c in _commands(embedded.stdout) if "setup.sh jetstream" in c] == []


def test_a_run_that_does_not_fit_the_slice_is_refused_before_any_slice(tmp_path: Path) -> None:
    """The real `jarl plan` runs first (this host compiles for TPU): Qwen2.5-32B on a v5e-4
    does not fit, so the script stops with its line and never calls gcloud to create, copy
    or run anything (a `gcloud` on PATH records every call)."""
    model = tmp_path / "qwen32b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(PRESETS["qwen2.5-32b"]))
    calls = tmp_path / "gcloud-calls"
    gcloud = tmp_path / "bin" / "gcloud"
    gcloud.parent.mkdir()
    gcloud.write_text(f'#!/usr/bin/env bash\necho "$*" >> {calls}\nexit 1\n')
    gcloud.chmod(0o755)
    out = subprocess.run(
        ["bash", str(TPU_POD), "--name", "pod", "--zone", "z", "--accelerator-type",
         "v5litepod-4", "configs/gsm8k_tools_qwen2.5.yaml", f"model.path={model}",
         "mesh.fsdp=4", "data.train=unused.parquet"],
        cwd=ROOT, capture_output=True, text=True, check=False, timeout=1200,
        env={**os.environ, "PATH": f"{gcloud.parent}:{os.environ['PATH']}"},
    )  # fmt: skip
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
    assert "does not fit: rl_update needs" in out.stdout
    assert "jarl plan refused the run on v5litepod-4" in out.stderr
    assert not calls.exists() or "create" not in calls.read_text()
    assert not calls.exists() or "ssh" not in calls.read_text()
