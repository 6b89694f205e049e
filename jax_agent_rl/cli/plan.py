"""``jarl plan``: compiles a run's programs for a Cloud TPU slice on this host (no TPU needed)
and says whether they fit its HBM per chip."""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING

from jax_agent_rl.cli.flags import number
from jax_agent_rl.config.ranges import TIMEOUT

if TYPE_CHECKING:
    from jax_agent_rl.config import JarlConfig
    from jax_agent_rl.models import ModelConfig
    from jax_agent_rl.plan import Plan, Topology
    from jax_agent_rl.plan.report import Compiled

DESCRIPTION = (
    "Proves, before a TPU slice is rented, that every program of a run compiles for that TPU"
    " at the model's real size and fits its HBM per chip. libtpu compiles here, for abstract"
    " devices of the slice; nothing runs and no weights are read: the model's shapes come "
    "from model.path's config.json or a --model preset. The programs are the trainer's own: "
    "the RL update (its micro-batches of learner.row_tokens per device, remat, KL reference,"
    " old-policy pass), the SFT step (if sft is set), the weight push from the learner's "
    "layout to the engine's, and the embedded engine's ragged step at its largest row "
    "bucket (engine.max_step_tokens prompt tokens) and a decode call of "
    "engine.steps_per_call steps at its largest batch. A LoRA run (model.lora.rank "
    "> 0) compiles its own: the update trains the adapters alone (the optimizer state is "
    "theirs, the base frozen), the engine runs them unmerged and the push sends them alone; "
    "then the same run training every weight is compiled too, and a table shows both runs' "
    "HBM per chip side by side. Per program: compile seconds, HBM per chip (arguments + "
    "temporaries + outputs - donated/aliased buffers), its matmul FLOPs and HBM bytes per "
    "chip counted from the compiled program with every loop's trip count applied and its "
    "Pallas kernels counted, an estimate of its time and MFU (a roofline per op: an "
    "estimate, not a measurement), the ops moving the most bytes and running the most "
    "FLOPs, and a training step's collectives that its mesh does not imply, if any. The "
    "run's peak per chip is the "
    "learner's state + the engine's weights and KV cache + the largest program's "
    "temporaries. The last line is `fits: ...` or `does not fit: ...`; a run that does not "
    "fit is planned again with less memory per chip on its mesh (learner.row_tokens, "
    "engine.kv_cache_gib or engine.max_concurrent halved, then both, ...; programs a setting "
    "does not change are not compiled again), then on each other (data, fsdp, tensor) mesh "
    "of the slice, as configured and with less memory per chip; a setting that cannot fit "
    "by a floor from its mesh's first plan is skipped, and the first that fits is named. "
    "Each plan prints a line per program and one at least every 15 s while one compiles. "
    "Exit code 0: fits; 1: does not fit; 2: bad input."
)


def add_plan_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "plan",
        help="compile a run for a TPU slice here and check that it fits its HBM per chip",
        description=textwrap.fill(DESCRIPTION, 88),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
        "  jarl plan configs/gsm8k_tools_qwen2.5.yaml mesh.fsdp=4 --model qwen2.5-1.5b \\\n"
        "      --topology v5e-4\n"
        "  jarl plan configs/my.yaml model.path=/ckpt/Qwen2.5-7B mesh.fsdp=4 --topology v5p:2x2x1\n"
        "see docs/tpu.md (`jarl plan`) on reading the output",
    )
    p.add_argument("config", help="YAML config (see configs/)")
    p.add_argument(
        "overrides", nargs="*", help="key.sub=value overrides, right after CONFIG, in order"
    )
    p.add_argument(
        "--topology",
        required=True,
        help="the slice: v5e-N / v6e-N (N chips), v5p-N (N TensorCores, 2 per chip), or its "
        "topology (v5e:4x4, v5p:2x2x4, v6e:2x2); mesh.* must multiply to its chips",
    )
    p.add_argument(
        "--model",
        default=None,
        help="a model preset instead of model.path's config.json: qwen2.5-0.5b, -1.5b, -3b, "
        "-7b, -14b, -32b; qwen3-0.6b, -1.7b, -4b, -8b, -14b, -32b; qwen3-30b-a3b (MoE); "
        "gemma3-1b, -4b",
    )
    p.add_argument(
        "--tokens-per-trajectory",
        type=int,
        default=None,
        metavar="N",
        help="the RL step's trajectories' length for the FLOPs and the batch's shape "
        "(default: engine.max_model_len, the longest)",
    )
    p.add_argument(
        "--compile-timeout",
        type=number(float, TIMEOUT),
        default=None,
        metavar="SECONDS",
        help="give up on a program whose compilation takes longer (reported on its line)",
    )
    p.add_argument(
        "--json",
        default=None,
        metavar="FILE",
        help="also write the plan as JSON (per program: compiled, compile_s, HBM per chip, "
        "FLOPs per device, the counted FLOPs and bytes, the top ops by bytes and by FLOPs, "
        "the collectives, predicted seconds and MFU)",
    )
    p.add_argument(
        "--no-search",
        action="store_true",
        help="when the run does not fit, do not plan it again with less memory per chip or "
        "on the slice's other meshes",
    )
    p.set_defaults(func=run_plan)


def _refuse(problem: str) -> int:
    print(f"jarl: {problem}", file=sys.stderr)
    return 2


def run_plan(args: argparse.Namespace) -> int:
    import jax

    from jax_agent_rl.config import ConfigError, load_config
    from jax_agent_rl.models import ModelConfig
    from jax_agent_rl.plan import parse_topology, preset_model
    from jax_agent_rl.plan.topology import libtpu_problem

    try:
        topology = parse_topology(args.topology)
        model = preset_model(args.model) if args.model else None
    except ValueError as e:
        return _refuse(str(e))
    if (problem := libtpu_problem()) is not None:
        return _refuse(problem)
    # JAX's persistent cache cannot load a program compiled for abstract TPU devices (it
    # needs a client of that platform): each would be a warning and an entry never read
    jax.config.update("jax_enable_compilation_cache", False)
    if args.tokens_per_trajectory is not None and args.tokens_per_trajectory < 1:
        return _refuse(f"--tokens-per-trajectory {args.tokens_per_trajectory}: expected >= 1")
    if args.json is not None and (problem := _json_problem(args.json)) is not None:
        return _refuse(f"--json {args.json}: {problem}")
    unread = ("data.train", "data.val", "sft.data", *(("model.path",) if model else ()))
    try:
        cfg: JarlConfig = load_config(args.config, list(args.overrides), unread=unread)
        if cfg.model.module:
            raise ConfigError(
                f"model.module={cfg.model.module!r}: jarl plan compiles the checkpoint families "
                "(--model or an HF model.path), not a custom policy"
            )
        if model is None:
            model = ModelConfig.from_pretrained(cfg.model.path)
    except (ConfigError, ValueError, OSError) as e:
        return _refuse((str(e).splitlines() or [type(e).__name__])[0])
    say = lambda line: print(line, flush=True)  # noqa: E731
    reuse: dict[tuple, Compiled] = {}  # programs a search's plans share are compiled once
    try:
        plan = _planned(cfg, model, topology, args, "the run's programs", reuse)
    except ValueError as e:  # the mesh does not cover the slice, or the model does not split
        return _refuse(str(e).splitlines()[0])
    for line in plan.lines():
        say(line)
    full = _beside_full(cfg, model, topology, args, plan) if cfg.model.lora.rank else None
    fits, verdict = plan.verdict()
    if not fits and not args.no_search:
        verdict += "; " + _search(cfg, model, topology, args, plan, reuse)
    say(verdict)
    code = 0 if fits else 1
    if args.json is not None:
        record = {**plan.record(), "verdict": verdict}
        record.update({"full_parameter": full.record()} if full is not None else {})
        try:  # (checked before the compiles; the file system may have changed since)
            Path(args.json).write_text(json.dumps(record, indent=1) + "\n")
        except OSError as e:
            print(f"jarl: --json {args.json}: cannot write: {e.strerror or e}", file=sys.stderr)
            code = 2
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # a compilation still running past --compile-timeout stops here


def _json_problem(name: str) -> str | None:
    """Why the plan could not be written to the file ``name``, checked before it is made (it is
    written at the end, after every program compiled): a folder that is not there, a path that is
    no regular file (a FIFO blocked the write for ever; a folder or device fails it), or one no
    file can be made at (a dangling link, a link loop, a read-only folder)."""
    if not name:
        return "name a file to write"
    path = Path(name)
    if not path.absolute().parent.is_dir():
        return "its folder does not exist"
    if path.exists() and not path.is_file():
        return "not a regular file; name a file to write"
    existed = path.exists()
    try:  # (a dangling link, a link loop, a folder that takes no files: /proc, /sys)
        with path.open("a"):
            pass
    except OSError as e:
        return f"cannot be written: {e.strerror or e}"
    if not existed:
        path.unlink(missing_ok=True)
    return None


def _beside_full(
    cfg: JarlConfig, model: ModelConfig, topology: Topology, args: argparse.Namespace, plan: Plan
) -> Plan:
    """A LoRA run's ``plan`` beside the same run training every weight, on the same mesh
    (compiled: its plan, returned, goes into the JSON record)."""
    from jax_agent_rl.plan import beside, full_parameter, plan_run

    print("# planning the same run training every weight (model.lora.rank=0)", flush=True)
    full = plan_run(
        full_parameter(cfg), model, topology, args.tokens_per_trajectory, args.compile_timeout
    )
    for line in beside(plan, full):
        print(line, flush=True)
    return full


def _planned(
    cfg: JarlConfig,
    model: ModelConfig,
    topology: Topology,
    args: argparse.Namespace,
    what: str,
    reuse: dict[tuple, Compiled],
) -> Plan:
    """`plan_run`, saying how far it is (a line per program, and one at least every 15 s while
    a program compiles: a 1.5B update compiles for minutes)."""
    from rich.console import Console

    from jax_agent_rl.console import progress
    from jax_agent_rl.plan import plan_run

    label = f"compiling {what} for {topology.name}"
    known = len(reuse)
    with progress.phase(Console(), label) as phase:

        def compiled(c: Compiled) -> None:
            how = c.error or f"{c.total / 2**30:.2f} GiB per chip"
            phase.update(phase.done + 1, f"{c.name}: {how}")

        plan = plan_run(
            cfg,
            model,
            topology,
            args.tokens_per_trajectory,
            args.compile_timeout,
            on_program=compiled,
            reuse=reuse,
        )
    if known:  # a search's plan: what it took from the earlier ones
        fresh = len(reuse) - known
        print(f"#   {fresh} of {len(plan.programs)} programs compiled, the rest reused", flush=True)
    return plan


def smaller_settings(cfg: JarlConfig) -> list[tuple[str, JarlConfig, int, int]]:
    """``cfg`` with less memory per chip at the same mesh, least change first, each as its
    overrides, the config and its two cuts: the learner's packed rows (``learner.row_tokens``,
    or without packing ``learner.micro_batch_size``) and the engine's KV cache
    (``engine.kv_cache_gib`` where it is set, else the decode slots that size it,
    ``engine.max_concurrent``) halved, then both, then quartered..., each the config checks
    accept (`check_ranges`)."""
    import dataclasses

    from jax_agent_rl.config import check_ranges

    learner, engine = cfg.learner, cfg.engine
    rows_key = "row_tokens" if learner.packing else "micro_batch_size"
    kv_key = "kv_cache_gib" if engine.kv_cache_gib else "max_concurrent"
    rows, kv = getattr(learner, rows_key), getattr(engine, kv_key)
    out: list[tuple[str, JarlConfig, int, int]] = []
    for k in (1, 2, 3):
        for row_cut, kv_cut in ((2**k, 1), (1, 2**k), (2**k, 2**k)):
            r = rows // row_cut
            n = kv / kv_cut if kv_key == "kv_cache_gib" else kv // kv_cut
            if r < 1 or n <= 0:
                continue
            other = dataclasses.replace(
                cfg,
                learner=dataclasses.replace(learner, **{rows_key: r}),
                engine=dataclasses.replace(engine, **{kv_key: n}),
            )
            said = [f"learner.{rows_key}={r}"] * (row_cut > 1)
            said += [f"engine.{kv_key}={n:g}"] * (kv_cut > 1)
            if not check_ranges(other):
                out.append((" ".join(said), other, row_cut, kv_cut))
    return out


def _search(
    cfg: JarlConfig,
    model: ModelConfig,
    topology: Topology,
    args: argparse.Namespace,
    plan: Plan,
    reuse: dict[tuple, Compiled],
) -> str:
    """The first setting on which the run fits, as overrides: on its own mesh with less memory
    per chip (`smaller_settings`: only the programs a setting changes compile again), then
    each of the slice's other meshes as configured and with less memory per chip. A setting
    whose floor (`least_peak`, from its mesh's plan as configured) is over the chip's HBM is
    not compiled: it cannot fit."""
    from jax_agent_rl.plan import other_meshes
    from jax_agent_rl.plan.report import least_peak
    from jax_agent_rl.plan.topology import GiB

    n, hbm = topology.chips, topology.chip.hbm_bytes
    most = max(plan.programs, key=lambda p: p.argument_total)
    least = most.argument_total / n
    # else, split evenly over every chip, one program's arguments are too many for any mesh
    meshes = [cfg, *other_meshes(cfg, n)] if least <= hbm else [cfg]
    for at in meshes:
        m = at.mesh
        here = f"mesh.data={m.data} mesh.fsdp={m.fsdp} mesh.tensor={m.tensor}"
        base = plan
        if at is not cfg:
            found = _tried(here, at, model, topology, args, reuse, plan)
            if isinstance(found, str):
                return found
            if found is None:
                continue
            base = found
        for said, other, row_cut, kv_cut in smaller_settings(at):
            overrides = f"{said} ({here})" if at is cfg else f"{said} {here}"
            floor = least_peak(base, row_cut, kv_cut)
            if floor > hbm:
                print(
                    f"# skipping {overrides}: it needs at least {floor / GiB:.1f} GiB per chip "
                    f"of {hbm / GiB:.0f}",
                    flush=True,
                )
                continue
            found = _tried(overrides, other, model, topology, args, reuse, plan)
            if isinstance(found, str):
                return found
    if least > hbm:
        return (
            f"no smaller setting fits, nor any mesh of {n} chips: {most.name}'s arguments "
            f"alone, split over all {n}, are {least / GiB:.1f} GiB per chip"
        )
    return f"no smaller setting fits on any mesh of {n} chips"


def _tried(
    overrides: str,
    cfg: JarlConfig,
    model: ModelConfig,
    topology: Topology,
    args: argparse.Namespace,
    reuse: dict[tuple, Compiled],
    first: Plan,
) -> str | Plan | None:
    """``cfg`` (``overrides``) planned: the line naming it if it fits, else its plan (None
    where the model does not split over its mesh)."""
    from jax_agent_rl.plan.topology import GiB

    print(f"# planning {overrides}", flush=True)
    try:
        candidate = _planned(cfg, model, topology, args, overrides, reuse)
    except ValueError as e:  # the model does not split over this mesh
        print(f"#   {str(e).splitlines()[0]}", flush=True)
        return None
    if candidate.programs == first.programs:  # (a setting its programs do not read)
        print("#   the same programs as planned first", flush=True)
        return candidate
    fits, verdict = candidate.verdict()
    print(f"#   {verdict}", flush=True)
    if fits:
        return f"{overrides} fits: {candidate.peak[0] / GiB:.1f} GiB per chip"
    return candidate
