"""``engine.jetstream.chips``: a TPU host's chips split between its JetStream server and the
trainer. The split itself against layouts worked out by hand (chip i of an X x Y x Z host at
(i mod X, i div X mod Y, i div XY)), the refusals, the pre-run check over a slice's hosts, then
the processes: the real server started with the setting reports, from its own environment,
exactly the server's half and serves on its own device count (CPU: as many devices as chips),
and `jarl train` applies the trainer's half to itself before JAX starts. No TPU here: these are
libtpu's variables, checked as set, not as obeyed."""

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import jax
import pytest

from jax_agent_rl.backends.jetstream.chips import (
    ChipSplitError,
    TpuLayout,
    chip_problems,
    split_chips,
)
from jax_agent_rl.backends.jetstream.client import JetStreamBackend, ServerSampling
from jax_agent_rl.cli.demo import DEMO_CONFIG, TaskFiles, prepare
from jax_agent_rl.data.arithmetic import ArithmeticTask
from jax_agent_rl.engine import Engine
from jax_agent_rl.models import ModelConfig, Sharder, load_hf, make_mesh
from jax_agent_rl.models.hf_local import TINY_QWEN2, write_hf_checkpoint
from jax_agent_rl.models.sharding import one_device_sharder
from jax_agent_rl.rollout import EmbeddedBackend, GenerateRequest, SamplingParams
from tests.processes import group_gone

ROOT = Path(__file__).resolve().parents[3]
V6E_8 = TpuLayout((2, 4, 1))  # one host, 8 chips in 2 columns of 4 rows
V5E_8 = TpuLayout((4, 2, 1))  # one host, 8 chips in 4 columns of 2 rows


def test_half_a_host_each() -> None:
    # 2x4 host: chips 4..7 are rows 2-3 (a 2x2 square), 0..3 rows 0-1
    split = split_chips("4,5,6,7", V6E_8)
    assert split.server_env(8601) == {
        "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
        "TPU_VISIBLE_CHIPS": "4,5,6,7",
        "TPU_CHIPS_PER_PROCESS_BOUNDS": "2,2,1",
        "TPU_PROCESS_BOUNDS": "1,1,1",
        "TPU_PROCESS_PORT": "8601",
        "TPU_PROCESS_ADDRESSES": "localhost:8601",
        "CLOUD_TPU_TASK_ID": "0",
    }
    assert split.trainer_env() == {
        "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
        "TPU_VISIBLE_CHIPS": "0,1,2,3",
        "TPU_CHIPS_PER_PROCESS_BOUNDS": "2,2,1",
        "TPU_PROCESS_BOUNDS": "1,1,1",
    }
    # 4x2 host: chips 4..7 are row 1 (4 wide), and a column is 0,4
    wide = split_chips("4,5,6,7", V5E_8)
    assert (wide.server_box, wide.trainer_box) == ((4, 1, 1), (4, 1, 1))
    column = split_chips("3,7", V5E_8)
    assert (column.server_box, column.trainer_chips, column.trainer_box) == (
        (1, 2, 1),
        (0, 1, 2, 4, 5, 6),
        (3, 2, 1),
    )


@pytest.mark.parametrize(
    ("chips", "layout", "says"),
    [
        ("4,x", V6E_8, "expected the host's chip indices"),
        ("4,4", V6E_8, "lists chip 4 twice"),
        ("6,7,8", V6E_8, "chip 8 is not on this host, whose 8 chips are 0..7"),
        ("0,1,2,3,4,5,6,7", V6E_8, "leaves the trainer no chip"),
        ("1,2", V6E_8, "the server's chips are not a rectangle"),  # (1,0) and (0,1)
        ("2,3,4,5", V6E_8, "leaves the trainer chips 0,1,6,7, which are not a rectangle"),
        ("0", V6E_8, "leaves the trainer chips 1,2,3,4,5,6,7, which are not a rectangle"),
        # a 4x4 slice of four 2x2 hosts: half of each host splits y, which the hosts split too
        ("2,3", TpuLayout((2, 2, 1), (2, 2, 1)), "span 1 of the host's 2 along y"),
        ("1,3", TpuLayout((2, 2, 1), (2, 2, 1)), "span 1 of the host's 2 along x"),
    ],
)
def test_a_split_that_cannot_be_is_refused(chips: str, layout: TpuLayout, says: str) -> None:
    with pytest.raises(ChipSplitError, match=r"^engine\.jetstream\.chips") as e:
        split_chips(chips, layout)
    assert says in str(e.value)


def test_a_slice_whose_hosts_stack_along_an_axis_the_trainer_keeps_whole() -> None:
    """2x2x2 of two 2x2x1 hosts (stacked along z): the trainer's row y=0 of both hosts is one
    2x1x2 rectangle; each host's server has row y=1 of its host, a slice of its own."""
    split = split_chips("2,3", TpuLayout((2, 2, 1), (1, 1, 2)))
    assert split.trainer_env()["TPU_PROCESS_BOUNDS"] == "1,1,2"
    assert split.trainer_env()["TPU_CHIPS_PER_PROCESS_BOUNDS"] == "2,1,1"
    assert split.server_env(1)["TPU_PROCESS_BOUNDS"] == "1,1,1"


def test_the_pre_run_check_holds_one_trainer_process_per_host(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CHIPS_PER_HOST_BOUNDS", "2,2,1")
    monkeypatch.setenv("HOST_BOUNDS", "1,1,2")
    assert chip_problems("2,3", 2, 8) == []
    assert chip_problems("", 3, 8) == []  # no split, nothing to hold
    (problem,) = chip_problems("2,3", 4, 8)
    assert problem.startswith("engine.jetstream.chips='2,3': the run has 4 processes and the ")
    assert "slice 2 hosts (HOST_BOUNDS=1,1,2)" in problem
    (problem,) = chip_problems("2,3", 2, 5)
    assert problem == (
        "engine.max_concurrent=5 does not split over the JetStream server's 2 chips "
        "(engine.jetstream.chips='2,3'; its decode slots): use a multiple of 2"
    )
    monkeypatch.setenv("HOST_BOUNDS", "2,2,1")
    (problem,) = chip_problems("2,3", 4, 8)
    assert "along y" in problem
    monkeypatch.delenv("HOST_BOUNDS")
    monkeypatch.delenv("CHIPS_PER_HOST_BOUNDS")
    (problem,) = chip_problems("2,3", 1, 8)  # this build host has no TPU
    assert "splits a TPU host's chips, and this host has none" in problem


# ---------------------------------------------------------------------------- the processes


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_hf_checkpoint(tmp_path_factory.mktemp("chips") / "tiny", TINY_QWEN2)


@pytest.fixture
def v6e_host(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """This process as a v6e-8 TPU VM's tpu-env describes its host (the server inherits it)."""
    monkeypatch.setenv("CHIPS_PER_HOST_BOUNDS", "2,4,1")
    monkeypatch.setenv("HOST_BOUNDS", "1,1,1")
    yield


@pytest.mark.usefixtures("v6e_host")
def test_the_server_runs_under_its_half_on_its_own_devices(checkpoint: Path) -> None:
    """What the server process reports of its own environment is the split's server half; on
    CPU it opens as many devices as it has chips, and serves the greedy tokens of the same
    engine in process laid out on as many devices, before and after a weight push that changes
    them."""
    model = ModelConfig.from_pretrained(checkpoint)
    backend = JetStreamBackend(
        checkpoint,
        model,
        sampling=ServerSampling(temperature=0.0),
        max_model_len=128,
        slots=8,
        chips="4,5,6,7",
    )
    try:
        port = int(backend.placement["TPU_PROCESS_PORT"])
        assert backend.placement == split_chips("4,5,6,7", V6E_8).server_env(port)
        assert backend.devices == 4
        _, weights = load_hf(checkpoint, sharder=one_device_sharder())
        pushed = jax.tree.map(lambda x: x * 1.5, weights)  # greedy tokens change
        prompts = [tuple(range(3, 3 + n)) for n in (5, 11, 23)]
        served = asyncio.run(_greedy(backend, prompts))
        asyncio.run(backend.update_weights(pushed, 1))
        served_after = asyncio.run(_greedy(backend, prompts))
    finally:
        asyncio.run(backend.close())
        assert group_gone(backend.proc.pid)
    # the server's layout: slots split over 4 devices, every step over all of them
    sharder = Sharder(make_mesh(4, 1, 1, devices=jax.devices()[:4]))
    engine = Engine(
        model, max_concurrent_decodes=8, max_len=128, batch_buckets=False, sharder=sharder
    )
    assert served == asyncio.run(_greedy(EmbeddedBackend(engine, weights), prompts))
    assert served_after == asyncio.run(_greedy(EmbeddedBackend(engine, pushed), prompts))
    assert served_after != served


async def _greedy(backend: object, prompts: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
    sampling = SamplingParams(max_tokens=12, temperature=0.0)
    requests = [GenerateRequest(f"r{i}", p, sampling) for i, p in enumerate(prompts)]
    results = await asyncio.gather(*(backend.generate(r) for r in requests))  # type: ignore[attr-defined]
    return [r.token_ids for r in results]


@pytest.fixture(scope="module")
def task(tmp_path_factory: pytest.TempPathFactory) -> TaskFiles:
    return prepare(tmp_path_factory.mktemp("task"), ArithmeticTask(), n_train=16, n_val=4, n_sft=8)


def _dry_run(task: TaskFiles, *extra: str, host: str = "2,4,1") -> subprocess.CompletedProcess:
    command = [
        sys.executable, "-m", "jax_agent_rl.cli", "train", str(DEMO_CONFIG),
        f"model.path={task.model}", f"data.train={task.train}", f"data.val={task.val}",
        f"sft.data={task.sft}", f"tools.config={task.tools}", "engine.backend=jetstream",
        "engine.max_model_len=128", *extra, "--dry-run",
    ]  # fmt: skip
    env = {**_clean_env(), "CHIPS_PER_HOST_BOUNDS": host}
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, check=False)


def _clean_env() -> dict[str, str]:
    tpu = ("TPU_", "CHIPS_PER_HOST_BOUNDS", "HOST_BOUNDS", "ALLOW_MULTIPLE_LIBTPU_LOAD")
    return {k: v for k, v in os.environ.items() if not k.startswith(tpu)}


def test_jarl_train_takes_the_trainers_half_before_jax_starts(task: TaskFiles) -> None:
    """The trainer's process sets the split's trainer half in its own environment (its line
    reads the variables back) before the checks start JAX; a split that cannot be, and a run
    of more processes than the slice has hosts, stop it naming the key."""
    done = _dry_run(task, "engine.jetstream.chips=4,5,6,7")
    assert done.returncode == 0, done.stderr[-3000:]
    trainer = split_chips("4,5,6,7", V6E_8).trainer_env()
    shown = " ".join(f"{k}={v}" for k, v in trainer.items())
    assert f"# this process's devices beside engine.backend: {shown}\n" in done.stderr
    assert "TPU_VISIBLE_CHIPS=0,1,2,3 " in shown  # none of the server's

    bad = _dry_run(task, "engine.jetstream.chips=1,2")
    assert bad.returncode == 2
    assert (
        "jarl: engine.jetstream.chips='1,2': the server's chips are not a rectangle" in bad.stderr
    )
    two = ["--coordinator", "127.0.0.1:1", "--num-processes", "2", "--process-id", "0"]
    many = _dry_run(task, "engine.jetstream.chips=4,5,6,7", "data.prompts_per_step=2", *two)
    assert many.returncode == 2
    assert "the run has 2 processes and the slice 1 hosts (HOST_BOUNDS=1,1,1)" in many.stderr
