"""The ``jarl`` command line: its parser and handlers (each imports what its command runs)."""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from rich.console import Console

from jax_agent_rl.cli import compile_cache
from jax_agent_rl.cli.checkpoint import add_checkpoint_parsers
from jax_agent_rl.cli.plan import add_plan_parser
from jax_agent_rl.cli.serve_tools import add_serve_tools
from jax_agent_rl.cli.view import add_view_parser
from jax_agent_rl.usercode.load import working_directory_importable

if TYPE_CHECKING:
    from jax_agent_rl.config import JarlConfig
    from jax_agent_rl.models import ModelConfig, Policy


def _refuse(problems: Sequence[str]) -> int:
    """Prints each problem as one ``jarl:`` line on stderr; the exit code of a bad input."""
    for problem in problems:
        print(f"jarl: {problem}", file=sys.stderr)
    return 2


def _demo(args: argparse.Namespace) -> int:
    from jax_agent_rl.cli import demo
    from jax_agent_rl.config import ConfigError

    run_dir = Path(args.run_dir or f"runs/demo-{time.strftime('%Y%m%d-%H%M%S')}")
    try:
        demo.run(run_dir, Console(), args.overrides, args.model, args.lora, args.task)
    except ConfigError as e:
        return _refuse(str(e).splitlines())
    return 0


def _train(args: argparse.Namespace) -> int:
    """Loads the config, joins the other processes of a multi-process run, then loads all a run
    reads (`check_run`); a run starts when nothing is wrong, ``--dry-run`` stops (joining none)."""
    from jax_agent_rl.cluster.distributed import ProcessGroup
    from jax_agent_rl.config import ConfigError, load_config, to_yaml

    group = ProcessGroup(
        args.coordinator,
        args.num_processes,
        args.process_id,
        args.distributed,
        args.heartbeat_timeout,
    )
    try:
        cfg: JarlConfig = load_config(args.config, list(args.overrides))
    except ConfigError as e:
        return _refuse(str(e).splitlines())
    # (placed before JAX starts a backend: the devices the rollout backend leaves this process)
    problems = group.problems() or _place_trainer(cfg)
    if problems:
        return _refuse(problems)
    if group.auto and args.dry_run:
        return _refuse(
            [
                "--dry-run joins no processes, so --distributed cannot count them: plan an "
                "N-host run with --num-processes N --coordinator x:1 --dry-run"
            ]
        )
    from jax_agent_rl.cluster import distributed
    from jax_agent_rl.models import request_cpu_devices
    from jax_agent_rl.train.check import check_run, run_notes

    processes = group.num_processes if args.dry_run else distributed.initialize(group)
    devices = cfg.mesh.data * cfg.mesh.fsdp * cfg.mesh.tensor
    request_cpu_devices(devices // processes)  # CPU processes: as the run will
    problems = check_run(cfg, processes)
    if processes > 1:  # every host stops if one cannot run (a file missing there, say)
        problems = distributed.problems_of_every_process(problems)
    if problems:
        return _refuse(problems)
    # what the run will do unasked: before a run, after a dry run's plan (its last lines)
    notes = [f"# note: {line}" for line in run_notes(cfg)]
    if args.dry_run:
        import jax

        from jax_agent_rl.train import parts
        from jax_agent_rl.train.memory import fits_here, plan_memory

        print(to_yaml(cfg), end="")
        model: ModelConfig | Policy
        if cfg.model.module:  # (its model is made for the tokenizer: both checked above)
            model = parts.custom_policy(cfg, parts.run_tokenizer(cfg.model, None))
        else:  # (the plan adds model.lora's adapters itself)
            model = parts.checkpoint_model(cfg.model.path)
        plan = plan_memory(cfg, model, processes)
        misfit = fits_here(plan, jax.local_devices())
        for line in [*(f"# {line}" for line in plan.lines(cfg.learner.remat)), *notes]:
            print(line, file=sys.stderr)
        verdict = f"; it {misfit}" if misfit else ""
        print(
            f"# ok: {args.config} and everything it names load; nothing was run{verdict}",
            file=sys.stderr,
        )
        return 0
    for line in notes:
        print(line, file=sys.stderr)
    return _run_training(cfg, group.multi)


def _run_training(cfg: JarlConfig, multi: bool) -> int:
    """`train` in this process: one of a multi-process run stops every process (each saying
    why); a single one refuses a checkpoint it cannot resume from, or a run folder it cannot
    make, in one line."""
    from jax_agent_rl.cluster import distributed
    from jax_agent_rl.config import ConfigError
    from jax_agent_rl.models.checkpoint import CheckpointError
    from jax_agent_rl.train import train
    from jax_agent_rl.train.episodes import RolloutFailedError

    if not multi:
        try:
            run_dir = train(cfg, Console())
        except (CheckpointError, ConfigError) as e:  # (its checkpoint cut short, its folder)
            return _refuse([str(e)])
        except RolloutFailedError as e:  # its two lines say what failed: no traceback of jarl's
            return _refuse(str(e).splitlines()[:2])
    else:
        try:
            run_dir = train(cfg)
        except BaseException as e:  # every process must stop, and say why
            _stop_process(e)
    if distributed.is_primary():
        print(f"run folder: {run_dir}")
    return 0


def _place_trainer(cfg: JarlConfig) -> list[str]:
    """Sets the environment the rollout backend leaves this process (JetStream's server on TPU
    chips of its own: the rest), before JAX starts a backend, and says so; or the problem."""
    from jax_agent_rl.rollout.registry import backend_factory, backend_names

    if cfg.engine.backend not in backend_names():  # (the pre-run check names it)
        return []
    try:
        placed = backend_factory(cfg.engine.backend).trainer_env(cfg.engine)
    except ValueError as e:
        return [str(e)]
    os.environ.update(placed)
    if placed:
        shown = " ".join(f"{key}={os.environ[key]}" for key in placed)
        print(f"# this process's devices beside engine.backend: {shown}", file=sys.stderr)
    return []


def _stop_process(error: BaseException) -> NoReturn:
    """Ends this process of a multi-process run that failed, naming the process to blame.

    An error of this process's own (not a failed exchange with the others) is reported to
    the others at once. A failed exchange means another process stopped: one that reported
    its error, else one whose heartbeat stopped (its host died), else process 0 when the
    coordinator (which process 0 hosts) is unreachable. Exits without waiting for the others,
    which may be gone: closing checkpoints or leaving `jax.distributed` would wait on them."""
    import jax

    from jax_agent_rl.cluster.distributed import Liveness, is_communication_error

    me, processes = jax.process_index(), jax.process_count()
    who = f"process {me} of {processes}"
    resume = "rerun the same command on every host to resume from the last complete checkpoint"
    if isinstance(error, KeyboardInterrupt):
        Liveness.report_failure("interrupted (SIGINT)")
        print(f"jarl: {who}: interrupted; {resume}", file=sys.stderr, flush=True)
        os._exit(130)
    traceback.print_exception(error, file=sys.stderr)
    first = f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:300]}"
    if not is_communication_error(error):
        Liveness.report_failure(first)
        if me == 0:  # the others, failing alike, report and exit first (see await_reports)
            Liveness.await_reports()
        verdict = f"{who} failed: {first} (the traceback above)"
    else:
        print(f"jarl: {who}: {first}; which process stopped?", file=sys.stderr, flush=True)
        failed = {i: text for i, text in Liveness.failures().items() if i != me}
        silent = None if failed else Liveness.silent_processes()
        if failed:
            verdict = "; ".join(
                f"process {i} of {processes} failed: {text} (its log has the traceback)"
                for i, text in sorted(failed.items())
            )
        elif silent is None:
            verdict = (
                "process 0 stopped: it hosts the coordinator, which is unreachable; its log "
                "says whether it failed or its host died"
            )
        elif silent:
            names = ", ".join(str(i) for i in silent)
            verdict = (
                f"process {names} of {processes} stopped responding: its host died or was killed"
            )
        else:
            verdict = f"{who} lost a collective, though every process is alive (see above)"
    print(f"jarl: {who}: {verdict}; {resume}", file=sys.stderr, flush=True)
    os._exit(1)


def _export(args: argparse.Namespace) -> int:
    from jax_agent_rl.train.export import export_run

    try:
        out = export_run(args.run_dir, args.step, args.out, args.merge)
    except (ValueError, OSError) as e:  # config, checkpoint (a file corrupt) and file errors
        print(f"jarl: {e}", file=sys.stderr)
        return 2
    print(f"exported to {out}")
    return 0


def _eval(args: argparse.Namespace) -> int:
    """Reads what to evaluate and loads it (a bad input: one line, exit 2), then evaluates."""
    from jax_agent_rl.train.episodes import RolloutFailedError
    from jax_agent_rl.train.evaluation import eval_command, eval_target, load_policy

    try:
        target = eval_target(
            args.target, args.step, args.checkpoint, args.n, args.out, list(args.overrides)
        )
        policy = load_policy(target)
    except (ValueError, OSError) as e:  # config, data and checkpoint errors included
        return _refuse([(str(e).splitlines() or [type(e).__name__])[0]])
    try:
        eval_command(target, policy, Console())
    except RolloutFailedError as e:  # every episode failed: its two lines say what
        return _refuse(str(e).splitlines()[:2])
    except OSError as e:  # the JSON's write (a full disk): the table is printed above
        return _refuse([f"cannot write {args.out or 'the JSON'}: {e}"])
    return 0


def _traces(args: argparse.Namespace) -> int:
    from jax_agent_rl.train.traces import traces_command

    return traces_command(args.run_dir, args.step, args.limit, args.logprobs, args.mlflow)


def _config(args: argparse.Namespace) -> int:
    from jax_agent_rl.config import ConfigError, preview_config

    config, overrides = args.config, list(args.overrides)
    if config is not None and "=" in config:  # no file given: the first word is an override
        config, overrides = None, [config, *overrides]
    try:
        preview = preview_config(config, overrides)
    except ConfigError as e:
        return _refuse(str(e).splitlines())
    print(preview.yaml, end="")
    if preview.missing:
        settings = " ".join(f"{key}=..." for key in preview.missing)
        print(f"# set before jarl train runs: {settings}")
    return 0


def _add_eval(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "eval",
        help="evaluate a run's policy (or a checkpoint) on the held-out data",
        description=textwrap.fill(
            "Runs the agent loop over the validation prompts (data.val, the first "
            "data.val_size rows) with the run's tools, reward, agent and rollout settings, on "
            "the run's rollout backend, and reports per data source: mean@n (the success rate "
            "over all episodes; a success is an outcome reward of at least data.success_reward, or "
            "an environment's own word) and pass@k for k = 1, 2, 4, ... "
            "n (the unbiased estimate of Chen et al. 2021 that one of k samples succeeds). "
            "With --n 1 (default) decoding is greedy and the figures equal the training run's "
            "held-out evaluation (the `val` records of metrics.jsonl) for the same weights; "
            "with --n N each prompt is sampled N times at sampling.temperature, seeded by "
            "trainer.seed (reproducible). Prints a table and writes a JSON file (pass rates "
            "and every `val` figure) and, beside it, NAME.answers.jsonl: one line per episode "
            "(the prompt, the answer, the whole conversation, reward, success, stop reason). "
            "A bad input is one line on stderr, exit code 2.",
            88,
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
        "  jarl eval runs/demo                      # the latest checkpoint, greedy\n"
        "  jarl eval runs/demo --step 8 --n 8       # step 8, pass@1..8 of 8 samples\n"
        "  jarl eval runs/demo data.val=test.jsonl data.val_size=0 --checkpoint runs/demo/hf\n"
        "  jarl eval configs/my.yaml                # the config's model.path, before training\n"
        "  jarl eval runs/demo data.success_reward=0.5  # a success: reward >= 0.5 (default 1)",
    )
    p.add_argument(
        "target",
        metavar="CONFIG|RUN",
        help="a run folder (its config.yaml and orbax checkpoints) or a YAML config (its "
        "model.path is evaluated unless --checkpoint)",
    )
    p.add_argument(
        "overrides",
        nargs="*",
        help="key.sub=value overrides of the config, right after CONFIG|RUN (data.val=FILE, "
        "data.val_size=N, sampling.temperature=T, ...)",
    )
    p.add_argument(
        "--step",
        type=int,
        default=None,
        help="a RUN's orbax checkpoint of this step (default: its latest)",
    )
    p.add_argument(
        "--checkpoint",
        default=None,
        metavar="HF_DIR",
        help="evaluate this HF checkpoint folder instead (jarl export's, or the run's RUN/hf); "
        "its tokenizer unless model.tokenizer is set",
    )
    p.add_argument(
        "--n",
        type=int,
        default=1,
        help="samples per prompt: 1 is greedy; more are sampled at the rollout temperature",
    )
    p.add_argument(
        "--out",
        default=None,
        help="the JSON file to write (default: RUN/eval/step_<N>.json, <HF_DIR name>.json "
        "for --checkpoint, base.json for a config's model, with _n<N> before .json for --n N>1; "
        "a config's RUN is its trainer.run_dir)",
    )
    p.set_defaults(func=_eval)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jarl",
        description="jax_agent_rl: agentic reinforcement learning of language models in JAX.",
    )
    cache = parser.add_mutually_exclusive_group()
    cache.add_argument(
        "--compile-cache",
        metavar="DIR",
        type=Path,
        default=compile_cache.default_folder(),
        help="keep compiled XLA programs in DIR for the next run of the same programs, which "
        "then loads them instead of compiling (default: %(default)s; JAX_COMPILATION_CACHE_DIR, "
        "when set, wins); give it before the command: jarl --compile-cache DIR train ...",
    )
    cache.add_argument(
        "--no-compile-cache",
        dest="compile_cache",
        action="store_const",
        const=None,
        help="compile every program afresh and keep none",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "demo",
        help="train a small model to use a calculator tool (SFT, then GRPO), on the CPU",
        description="Makes a synthetic multi-step arithmetic task, a tokenizer and a small model "
        "here, warm-starts it on imperfect demonstrations, then trains it with GRPO over "
        "multi-turn calculator rollouts and reports held-out success before and after. "
        "Overrides (key.sub=value) apply to configs/demo_calculator_cpu.yaml "
        "(--model tiny-moe: configs/moe_calculator_cpu.yaml; --task compaction: "
        "configs/demo_compaction_cpu.yaml; --lora: to both of its phases, "
        "the RL phase's config being configs/demo_calculator_lora_cpu.yaml).",
    )
    p.add_argument("--run-dir", help="where to write the run (default: runs/demo-<time>)")
    p.add_argument(
        "--model",
        choices=["tiny", "tiny-moe"],
        default="tiny",
        help="tiny: a Qwen2-layout model of ~0.85M parameters; tiny-moe: a Qwen3-MoE of its "
        "size (8 experts, 2 per token)",
    )
    p.add_argument(
        "--task",
        choices=["calculator", "compaction"],
        default="calculator",
        help="calculator: sums, products and chains of both; compaction: three-call chains "
        "whose episodes do not fit the context unless the agent summarises it, RL alone "
        "(configs/demo_compaction_cpu.yaml) from the committed SFT warm start "
        "tests/train/warm_starts/tiny-compaction (docs/agents.md)",
    )
    p.add_argument(
        "--lora",
        action="store_true",
        help="RL trains rank-16 LoRA adapters on the SFT policy (its base frozen, only the "
        "adapters pushed to the engine); SFT still trains every weight of the random-init model "
        "(run-dir/sft), as a real run's base would come pretrained",
    )
    p.add_argument("overrides", nargs="*", help="key.sub=value overrides of the demo config")
    p.set_defaults(func=_demo)

    p = sub.add_parser(
        "train",
        help="run (or resume) RL training from a YAML config",
        description="Trains as the config says: optional SFT warm start, then GRPO / PPO / DAPO "
        "/ Dr.GRPO over agent rollouts on the configured backend, with evaluation, orbax "
        "checkpoints, metrics (JSONL + TensorBoard), traces and plots in trainer.run_dir. A "
        "rerun with the same run_dir resumes from its last complete checkpoint. Before "
        "anything runs, the config and everything it names are loaded and checked (the "
        "model's config.json, tokenizer and chat template, the first rows of each data file, "
        "the tools, reward and parser, the mesh); every problem is one line, exit code 2. "
        "Relative paths are relative to the current directory (the run folder's config.yaml "
        "holds them absolute); pkg://<package>/<path> names a file shipped inside an "
        "installed package (the default tools.config is one). No checkpoint at hand? "
        "jarl checkpoint make --out ckpt, then model.path=ckpt.",
    )
    p.add_argument("config", help="YAML config (see configs/)")
    p.add_argument("overrides", nargs="*", help="key.sub=value overrides, applied in order")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="load and check the config and everything it names, then stop: nothing is "
        "trained, compiled or written",
    )
    g = p.add_argument_group(
        "multi-process runs",
        "Every host runs the same command; the processes form one mesh over all their "
        "devices (jax.distributed). Each rolls out its share of a step's prompts on its own "
        "devices; process 0 writes metrics, traces, plots and the export; all write the "
        "checkpoints, so trainer.run_dir must be a folder every host sees. If a process dies, "
        "the others stop naming it; rerun on every host to resume. See docs/tpu.md.",
    )
    g.add_argument(
        "--distributed",
        action="store_true",
        help="join the processes JAX finds in the environment: a TPU VM slice, or a SLURM job "
        "step (`srun jarl train ... --distributed`)",
    )
    g.add_argument(
        "--coordinator",
        default=None,
        metavar="HOST:PORT",
        help="process 0's address, where it serves the coordination service (CUDA nodes, CPU)",
    )
    g.add_argument("--num-processes", type=int, default=1, help="processes in the run")
    g.add_argument("--process-id", type=int, default=0, help="this process's id, 0 .. N-1")
    g.add_argument(
        "--heartbeat-timeout",
        type=int,
        default=100,
        metavar="SECONDS",
        help="a process silent this long counts as dead, and the run stops",
    )
    p.set_defaults(func=_train)

    p = sub.add_parser(
        "export",
        help="export a run's policy as an HF checkpoint folder",
        description="Writes the policy of a saved orbax checkpoint of RUN (the latest unless "
        "--step) as safetensors, config.json, generation_config.json (stops at the end of a "
        "turn, samples as the rollouts did) and the run's tokenizer files, for transformers "
        "and vLLM. Reads the run's config.yaml (its paths are absolute: any directory will do); "
        "builds no trainer.",
    )
    p.add_argument("run_dir", help="a run folder")
    p.add_argument("--step", type=int, default=None, help="which checkpoint (default: the latest)")
    p.add_argument("--out", default=None, help="where to write (default: RUN/hf-step-<step>)")
    p.add_argument(
        "--merge",
        action="store_true",
        help="a LoRA run (model.lora): write its adapters merged into the base weights as a "
        "plain HF checkpoint (default: an HF PEFT adapter folder, adapter_config.json + "
        "adapter_model.safetensors)",
    )
    p.set_defaults(func=_export)

    _add_eval(sub)

    p = sub.add_parser(
        "traces",
        help="show a run's rollout traces in the terminal",
        description="Renders trajectories from RUN/traces.jsonl: model tokens (trained, mask 1) "
        "and tool/template tokens (mask 0) in different colours, with reward and stop reason.",
    )
    p.add_argument("run_dir", help="a run folder")
    p.add_argument("--step", type=int, default=None, help="which RL step (default: the last)")
    p.add_argument("--limit", type=int, default=4, help="trajectories to show")
    p.add_argument("--logprobs", action="store_true", help="colour model tokens by probability")
    p.add_argument(
        "--mlflow",
        action="store_true",
        help="print the command that serves the run's MLflow traces (RUN/mlflow.db, written "
        "with trainer.trace_backend=mlflow) in the MLflow UI",
    )
    p.set_defaults(func=_traces)

    add_view_parser(sub)

    p = sub.add_parser(
        "config",
        help="print a resolved run config",
        description="Loads a YAML config, applies dotted overrides (model.dtype=bfloat16) and "
        "prints the result; an unknown key or a bad value is an error naming it. Required keys "
        "not set yet (model.path, data.train) are shown as ??? and listed at the end: "
        "`jarl train` needs them.",
    )
    p.add_argument("config", nargs="?", help="YAML file (optional: defaults only)")
    p.add_argument("overrides", nargs="*", help="key.sub=value overrides, applied in order")
    p.set_defaults(func=_config)

    add_checkpoint_parsers(sub)
    add_plan_parser(sub)
    add_serve_tools(sub)
    return parser


HYDRA_FLAGS = ("--config-path", "--config-name", "--config-dir", "-cp", "-cn", "-cd")


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    working_directory_importable()
    hydra = [a for a in argv if a.split("=", 1)[0] in HYDRA_FLAGS]
    if hydra:  # pasted from a verl run script, where argparse would print its whole usage
        return _refuse(
            [
                f"{hydra[0]}: Hydra's flag (verl's config files); jarl takes a jarl config file "
                "first, then verl's or jarl's key=value overrides: jarl train CONFIG key=value "
                "... (docs/verl.md)"
            ]
        )
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # argparse ends a command's overrides at its first flag: `train CONFIG --dry-run a=b` left
    # a=b unrecognized; key=value words after a flag are overrides too, in the order given
    takes = isinstance(getattr(args, "overrides", None), list)
    if extra and takes and all("=" in e and not e.startswith("-") for e in extra):
        args.overrides += extra
        extra = []
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    compile_cache.enable(args.compile_cache)
    return int(args.func(args))
