"""Compiling a run's programs for a TPU slice and reading the result: `plan_run` compiles each
program (`jax_agent_rl.plan.programs`) and reads its HBM per chip (`memory_analysis`), its
FLOPs and HBM bytes with every loop's trip count and its Pallas kernels counted (`hlo.count` of
its compiled text) and from them a roofline estimate of its time; `Plan.lines` is the report
``jarl plan`` prints.

The estimate is a roofline per op, summed: each op (fusion, kernel, collective, copy) takes
max(its FLOPs / the chip's peak, its HBM bytes / the chip's bandwidth), and the ops run one
after another. It is what the program costs if every op ran at the better of its two bounds
and nothing overlapped (async copies and collectives do overlap compute on a TPU: their time
is counted as if not); it misses the collectives' ICI bandwidth and latency, host work and the
rollout's pace. MFU is the model's FLOPs (analytic, no remat recompute) over that time at peak.

The whole run's peak per chip: the learner's resident state (the RL update's arguments: the
train state and the step's batch) plus the engine's (the decode call's arguments: the serving
weights and the KV pool) plus the largest temporaries and fresh outputs of any one program
(the programs run one at a time, and the state they donate is reused in place).

A LoRA run's plan is shown beside the same run training every weight (`beside`), both compiled.
"""

from __future__ import annotations

import dataclasses
import math
import re
import threading
import time
from typing import Any

import jax

from jax_agent_rl.config import JarlConfig, check_ranges
from jax_agent_rl.models import ModelConfig
from jax_agent_rl.plan import hlo
from jax_agent_rl.plan.programs import Program, WeightTraffic, run_programs
from jax_agent_rl.plan.topology import GiB, Topology


@dataclasses.dataclass(frozen=True)
class Compiled:
    """One program compiled (or not: ``error``): its bytes per chip and cost figures."""

    name: str
    workload: str
    error: str | None = None
    compile_s: float = 0.0
    arguments: int = 0
    outputs: int = 0
    temps: int = 0
    aliased: int = 0
    argument_total: int = 0  # the arguments' bytes over every chip together
    flops: float = 0.0  # analytic, the configured workload's, per device
    model_flops: float = 0.0
    compiler_flops: float = 0.0  # XLA's cost analysis: each loop body once, kernels as nothing
    compiler_bytes: float = 0.0
    counted_flops: float = 0.0  # `hlo.count`'s: loops' trip counts applied, kernels counted
    counted_bytes: float = 0.0
    top_bytes: tuple[hlo.Op, ...] = ()  # the ops moving the most HBM bytes
    top_flops: tuple[hlo.Op, ...] = ()
    collectives: tuple[hlo.Op, ...] = ()  # every collective of the program
    uncounted_loops: int = 0  # loops whose trip count neither XLA nor the program knows
    mesh_findings: tuple[str, ...] = ()  # collectives the mesh does not imply (`mesh_findings`)
    predicted_s: float = 0.0
    mfu: float | None = None
    kernels: tuple[str, ...] = ()  # the Pallas (Mosaic) kernels the program runs
    trained: int = 0  # a training step's: the parameters its optimizer updates
    optimizer: int = 0  # ... and its optimizer state's bytes per chip

    replaces: int = 0  # resident bytes its outputs take the place of, freed before it runs

    @property
    def extra(self) -> int:
        """What the program needs beyond the resident state: temporaries and fresh outputs,
        less what it replaces (the weight push: the engine's old weights, dropped first)."""
        return self.temps + self.outputs - self.aliased - self.replaces

    @property
    def total(self) -> int:
        return self.arguments + self.extra

    @property
    def needs(self) -> tuple[float, bool] | None:
        """What a program the compiler found out of memory needs per chip, and whether that
        is all of it (XLA:TPU's "Used 20.1G of 15.7G hbm") or a floor (its "HLO temporaries
        (23.5G) exceeds available HBM": those plus the arguments); None if it did not say."""
        if self.error is None:
            return None
        if used := _OOM.search(self.error):
            return float(used.group(1)) * _UNIT[used.group(2)], True
        if temps := _OOM_TEMPS.search(self.error):
            return self.arguments + float(temps.group(1)) * _UNIT[temps.group(2)], False
        return None


_OOM = re.compile(r"Used ([\d.]+)([KMGT]) of ([\d.]+)([KMGT]) hbm")
_OOM_TEMPS = re.compile(r"HLO temporaries \(([\d.]+)([KMGT])\) exceeds")
# a Mosaic kernel in compiled HLO: `%paged_attention.1 = (...) custom-call(...),
# custom_call_target="tpu_custom_call"`, the instruction named after the kernel
_KERNEL = re.compile(r"%([A-Za-z_]\w*?)(?:\.\d+)? = .*custom_call_target=\"tpu_custom_call\"")


TOP = 5  # the ops `jarl plan` lists by bytes and by FLOPs
GATHERS_PER_PASS = 2.0  # `mesh_findings`: the weights' bytes a pass may gather, at most
MiB = 2**20


def mesh_findings(counted: hlo.Count, weights: WeightTraffic | None) -> list[str]:
    """What a training step's collectives do that its mesh does not imply, one line each
    (none: FSDP all-gathers of the weights and reductions of their gradients, tensor
    all-reduces of activations). Found:

    - an all-to-all (a layout the mesh does not call for, the batch re-split mid-program);
    - a collective-permute inside a loop (one outside, on a few per-sequence numbers, is the
      batch's bookkeeping);
    - all-gathers moving more than `GATHERS_PER_PASS` times the weights' bytes per pass over
      a micro-batch (`WeightTraffic`): a weight gathered whole at every step of a loop inside
      the pass (the vocabulary head's chunks once did: 6.3 times);
    - a copy of at least half the largest stacked weight made at every micro-batch: a layout
      copy of the weights (the prefetches of one layer's slice are far smaller; a copy made
      once per optimizer step, outside the micro-batch loop, is not one).

    Weight gradients reduced by an all-reduce over fsdp and then sliced (XLA does so where a
    reduce-scatter would move half the bytes) pass: the reduction is the mesh's."""
    if weights is None:
        return []
    out = []
    ops = counted.collectives
    if n := sum(o.kind in ("all-to-all", "ragged-all-to-all") for o in ops):
        where = next(o.where for o in ops if o.kind.endswith("all-to-all"))
        out.append(f"{n} all-to-all(s), the first at {where or 'an unnamed op'}")
    if permutes := [o for o in ops if o.kind == "collective-permute" and o.trips > 1]:
        out.append(f"{len(permutes)} collective-permute(s) inside loops, e.g. {permutes[0].where}")
    gathered = sum(hlo.array_bytes(o.shape) * o.trips for o in ops if o.kind == "all-gather")
    per_pass = gathered / max(weights.passes, 1) / max(weights.gathered, 1)
    if per_pass > GATHERS_PER_PASS:
        top = max((o for o in ops if o.kind == "all-gather"), key=lambda o: o.bytes)
        out.append(
            f"all-gathers move {per_pass:.1f} times the weights' bytes per pass over a "
            f"micro-batch (at most {GATHERS_PER_PASS:g}); the most: {_array(top.shape)} "
            f"x{top.trips} at {top.where}"
        )
    copies = [
        o
        for o in counted.ops
        if o.kind in ("copy", "copy-start", "transpose")
        and o.trips >= weights.micro_batches
        and o.bytes / o.trips >= weights.stacked / 2 > 0
    ]
    if copies:
        c = max(copies, key=lambda o: o.bytes)
        out.append(
            f"{len(copies)} copies of a stacked weight's size at every micro-batch, the "
            f"largest {_array(c.shape)} x{c.trips}"
        )
    return out


def kernels(text: str) -> tuple[str, ...]:
    """The Pallas kernels compiled HLO text runs, by name, each once, in order."""
    return tuple(dict.fromkeys(_KERNEL.findall(text)))


def _compile(program: Program, topology: Topology, timeout_s: float | None) -> Compiled:
    """Lowers and compiles ``program`` (for at most ``timeout_s`` seconds), then reads it; a
    program whose arguments alone exceed a chip's HBM is not compiled."""
    leaves = jax.tree.leaves(program.args)
    arguments = sum(
        math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
        for x in leaves
        if x.sharding is not None
    )
    total = sum(math.prod(x.shape) * x.dtype.itemsize for x in leaves)
    if arguments > topology.chip.hbm_bytes:
        return Compiled(
            program.name,
            program.workload,
            error=f"its arguments alone need {_g(arguments)} per chip",
            arguments=arguments,
            argument_total=total,
            trained=program.trained,
            optimizer=program.optimizer,
        )
    box: dict[str, Any] = {}

    def work() -> None:
        try:
            box["compiled"] = program.fn.lower(*program.args, **program.static).compile()
        except Exception as e:  # a compiler error is a finding, reported on its line
            text = str(e).strip()
            box["error"] = f"{type(e).__name__}: {(text.splitlines() or [''])[0]}"
            used = _OOM.search(text)  # XLA:TPU's "Ran out of memory ... Used 20.1G of 15.7G hbm"
            if used and used.group(0) not in box["error"]:
                box["error"] += f" ({used.group(0)})"

    t0 = time.perf_counter()
    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    thread.join(timeout_s)
    seconds = time.perf_counter() - t0
    base = Compiled(
        program.name,
        program.workload,
        compile_s=seconds,
        arguments=arguments,  # the compiler's figure replaces it once compiled
        argument_total=total,
        flops=program.flops,
        trained=program.trained,
        optimizer=program.optimizer,
    )
    if thread.is_alive():
        return dataclasses.replace(base, error=f"did not compile within {timeout_s:.0f} s")
    if "error" in box:
        return dataclasses.replace(base, error=box["error"])
    compiled = box["compiled"]
    memory = compiled.memory_analysis()
    cost = compiled.cost_analysis() or {}
    chip = topology.chip
    text = compiled.as_text()
    counted = hlo.count(text, program.trips, program.kernels)
    predicted = counted.seconds(chip.peak_flops, chip.hbm_bandwidth)
    mfu = program.model_flops / (predicted * chip.peak_flops) if program.flops else None
    return dataclasses.replace(
        base,
        arguments=memory.argument_size_in_bytes,
        outputs=memory.output_size_in_bytes,
        temps=memory.temp_size_in_bytes,
        aliased=memory.alias_size_in_bytes,
        model_flops=program.model_flops,
        compiler_flops=max(float(cost.get("flops", 0.0)), 0.0),
        compiler_bytes=max(float(cost.get("bytes accessed", 0.0)), 0.0),
        counted_flops=counted.flops,
        counted_bytes=counted.bytes,
        top_bytes=tuple(counted.top("bytes", TOP)),
        top_flops=tuple(counted.top("flops", TOP)),
        collectives=counted.collectives,
        uncounted_loops=sum(loop.source == "unknown" for loop in counted.loops),
        mesh_findings=tuple(mesh_findings(counted, program.weights)),
        predicted_s=predicted,
        mfu=mfu,
        kernels=kernels(text),
        # the engine drops its weights before it builds the new (`EmbeddedBackend`)
        replaces=memory.output_size_in_bytes if program.replaces else 0,
    )


@dataclasses.dataclass(frozen=True)
class Plan:
    """A run's programs compiled for ``topology`` on ``mesh`` (data, fsdp, tensor)."""

    topology: Topology
    mesh: tuple[int, int, int]
    programs: list[Compiled]

    @property
    def compiled(self) -> bool:
        return all(p.error is None for p in self.programs)

    def _named(self, name: str) -> Compiled | None:
        return next((p for p in self.programs if p.name == name and p.error is None), None)

    @property
    def resident(self) -> list[tuple[str, int]]:
        """What stays on each chip between programs: the learner's state and step batch, the
        engine's weights and KV pool."""
        parts = []
        for part, name in (
            ("learner state + batch", "rl_update"),
            ("engine weights + KV", "step"),
        ):
            p = self._named(name)
            if p is not None:
                parts.append((f"{part} ({name}'s arguments)", p.arguments))
        return parts

    @property
    def peak(self) -> tuple[int, Compiled | None]:
        """The run's peak bytes per chip and the program whose extra sets it."""
        resident = sum(b for _, b in self.resident)
        done = [p for p in self.programs if p.error is None]
        top = max(done, key=lambda p: p.extra, default=None)
        return resident + (top.extra if top else 0), top

    def verdict(self) -> tuple[bool, str]:
        """(fits, the one line that says so)."""
        hbm = self.topology.chip.hbm_bytes
        for p in self.programs:
            if p.error is None:
                continue
            if p.arguments > hbm:
                return False, _over(p.name, p.arguments, hbm)
            if (needs := p.needs) is not None:
                return False, _over(p.name, needs[0], hbm, exact=needs[1])
            return False, f"does not fit: {p.name} did not compile ({p.error})"
        peak, top = self.peak
        if peak > hbm:  # the run's peak: its resident state and the largest program's extra
            resident = sum(b for _, b in self.resident)
            at = f" (resident {resident / GiB:.1f}" + (
                f" + {top.name}'s temporaries and outputs {top.extra / GiB:.1f})" if top else ")"
            )
            return False, _over("the run", peak, hbm) + at
        return True, (
            f"fits: {peak / GiB:.1f} GiB per chip of {hbm / GiB:.0f} on {self.topology.name} "
            f"(mesh data={self.mesh[0]} fsdp={self.mesh[1]} tensor={self.mesh[2]})"
        )

    def record(self) -> dict[str, Any]:
        """The plan as JSON-ready values (``jarl plan --json``)."""
        fits, verdict = self.verdict()
        rl = self._named("rl_update")
        return {
            "topology": self.topology.name,
            "mesh": dict(zip(("data", "fsdp", "tensor"), self.mesh, strict=True)),
            "compiled": self.compiled,
            "fits": fits,
            "verdict": verdict,
            # the run's peak: None unless every program compiled (else it would sum a part)
            "hbm_per_chip_gib": self.peak[0] / GiB if self.compiled else None,
            "compile_s": sum(p.compile_s for p in self.programs),
            "predicted_mfu": None if rl is None else rl.mfu,
            "programs": [
                {
                    "name": p.name,
                    "compiled": p.error is None,
                    "error": p.error,
                    "compile_s": p.compile_s,
                    "hbm_per_chip_gib": p.total / GiB,
                    "arguments_gib": p.arguments / GiB,
                    "temporaries_gib": p.temps / GiB,
                    "outputs_gib": p.outputs / GiB,
                    "aliased_gib": p.aliased / GiB,
                    "flops_per_device": p.flops,
                    "counted_flops": p.counted_flops,
                    "counted_bytes": p.counted_bytes,
                    "compiler_flops": p.compiler_flops,
                    "compiler_bytes": p.compiler_bytes,
                    "uncounted_loops": p.uncounted_loops,
                    "top_bytes": [_op(o, p.counted_bytes, "bytes") for o in p.top_bytes],
                    "top_flops": [_op(o, p.counted_flops, "flops") for o in p.top_flops],
                    "collectives": _collectives(p.collectives),
                    "mesh_findings": list(p.mesh_findings),
                    "predicted_s": p.predicted_s,
                    "predicted_mfu": p.mfu,
                    "pallas_kernels": list(p.kernels),
                    "trained_params": p.trained,
                    "optimizer_gib": p.optimizer / GiB,
                }
                for p in self.programs
            ],
        }

    def lines(self) -> list[str]:
        """The report: per program, then the run's peak (its sum made explicit)."""
        chip = self.topology.chip
        hbm = chip.hbm_bytes / GiB
        d, f, t = self.mesh
        out = [
            f"{self.topology.name}: {self.topology.chips} chips, {hbm:.0f} GiB HBM and "
            f"{chip.peak_flops / 1e12:.0f} TFLOP/s bf16 each; mesh data={d} fsdp={f} tensor={t}"
        ]
        for p in self.programs:
            out.append(f"{p.name}: {p.workload}")
            if p.error is not None:
                out.append(f"  not compiled ({p.compile_s:.1f} s): {p.error}")
                continue
            out.append(
                f"  compiled in {p.compile_s:.1f} s; HBM per chip: arguments {_g(p.arguments)} "
                f"+ temporaries {_g(p.temps)} + outputs {_g(p.outputs)} - donated/aliased "
                f"{_g(p.aliased)} = {_g(p.total)} of {hbm:.0f} GiB"
            )
            out.append(
                f"  counted per chip, loop trip counts applied: {p.counted_flops:.3g} matmul "
                f"FLOPs (the model's, analytic: {p.flops:.3g}), {_g(p.counted_bytes)} of HBM "
                f"read and written; estimate {p.predicted_s * 1e3:.1f} ms"
                + (f", MFU {p.mfu:.0%}" if p.mfu is not None else "")
            )
            if p.uncounted_loops:
                out.append(f"  {p.uncounted_loops} loop(s) of unknown trip count, counted once")
            out += [f"  collectives: {finding}" for finding in p.mesh_findings]
            out += _tops(p)
            if p.kernels:
                out.append(f"  Pallas kernels: {', '.join(p.kernels)}")
            if p.trained:
                out.append(
                    f"  trains {p.trained:,} parameters; their AdamW state: "
                    f"{_size(p.optimizer)} per chip"
                )
        peak, top = self.peak
        if top is not None:
            parts = " + ".join(f"{name} {_g(b)}" for name, b in self.resident)
            out.append(
                f"run peak per chip: {parts} + the largest program's temporaries and outputs "
                f"({top.name}) {_g(top.extra)} = {_g(peak)} of {hbm:.0f} GiB"
            )
        return out


_UNIT = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


_PLUMBING = frozenset({"while", "body", "closed_call", "cond", ""})


# the programs whose temporaries grow with the learner's rows, and those whose grow with the
# engine's KV cache or slots (`least_peak`)
ROW_PROGRAMS = frozenset({"rl_update", "sft_step"})
KV_PROGRAMS = frozenset({"step", "decode"})


def least_peak(plan: Plan, row_cut: int, kv_cut: int) -> float:
    """A floor under the peak per chip of ``plan``'s run with the learner's rows divided by
    ``row_cut`` and the engine's KV cache (or slots) by ``kv_cut``: the learner's state stays
    (rows change only its step's batch, a few MB), the engine's arguments (weights and KV)
    shrink at most ``kv_cut``-fold, and each program's temporaries and outputs at most by its
    knob's cut (activations are linear in tokens; gathered weights do not shrink). A setting
    whose floor is over the chip's HBM cannot fit and need not be compiled. A program that
    did not compile counts by its arguments alone: what an out-of-memory compile says it
    needs does not scale (XLA:TPU said 32 GiB for a decode that took 11 at half its cache)."""
    extra: list[float] = []
    learner = engine = 0.0
    for p in plan.programs:
        if p.error is None:
            cut = row_cut if p.name in ROW_PROGRAMS else kv_cut if p.name in KV_PROGRAMS else 1
            extra.append(p.extra / cut)
        if p.name == "rl_update":
            learner = p.arguments
        elif p.name == "step":
            engine = p.arguments / kv_cut
    return learner + engine + max(extra, default=0.0)


def _where(op: hlo.Op) -> str:
    """An op's JAX op, shortened: its scopes without the jit wrapper and the loops' plumbing
    (``all_micro_batches/checkpoint/mlp/nd,df->nf/dot_general``)."""
    parts = [s for s in op.where.split("/") if s not in _PLUMBING and not s.startswith("jit(")]
    return "/".join(parts[-6:]) or op.name


def _tops(p: Compiled) -> list[str]:
    """The ops moving the most bytes and running the most FLOPs, a line each."""
    out = []
    for key, ops, total in (
        ("bytes", p.top_bytes, p.counted_bytes),
        ("FLOPs", p.top_flops, p.counted_flops),
    ):
        if not ops:
            continue
        out.append(f"  most {key}:")
        for o in ops:
            value = o.bytes if key == "bytes" else o.flops
            amount = _g(value) if key == "bytes" else f"{value:.3g}"
            out.append(
                f"    {amount} ({value / total:.0%}) {o.kind} x{o.trips} "
                f"{_array(o.shape)} {_where(o)}"
            )
    return out


def _array(shape: str) -> str:
    """An HLO type without its layouts (the first three arrays of a tuple)."""
    parts = [f"{t}[{','.join(map(str, d))}]" for t, d in hlo.arrays(shape)]
    return (
        parts[0]
        if len(parts) == 1
        else "(" + ", ".join(parts[:3]) + (", ...)" if len(parts) > 3 else ")")
    )


def _op(o: hlo.Op, total: float, key: str) -> dict[str, Any]:
    value = o.bytes if key == "bytes" else o.flops
    return {
        "name": o.name,
        "kind": o.kind,
        "bytes": o.bytes,
        "flops": o.flops,
        "share": value / total if total else 0.0,
        "trips": o.trips,
        "shape": _array(o.shape),
        "where": o.where,
    }


def _collectives(ops: tuple[hlo.Op, ...]) -> list[dict[str, Any]]:
    """Each collective instruction: kind, result, trips, bytes and where (JSON)."""
    return [
        {
            "kind": o.kind,
            "shape": _array(o.shape),
            "trips": o.trips,
            "bytes": o.bytes,
            "where": o.where,
        }
        for o in ops
    ]


def _g(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def _size(n: float) -> str:
    """``n`` bytes in GiB, or in MiB below one GiB (a small model's, an adapter's)."""
    return _g(n) if n >= GiB else f"{n / 2**20:.2f} MiB"


def _over(name: str, need: float, hbm: int, exact: bool = True) -> str:
    return (
        f"does not fit: {name} needs {'' if exact else 'at least '}{need / GiB:.1f} GiB per "
        f"chip of {hbm / GiB:.0f} (over by {'' if exact else 'at least '}"
        f"{(need - hbm) / GiB:.1f})"
    )


def plan_run(
    cfg: JarlConfig,
    model: ModelConfig,
    topology: Topology,
    tokens: int | None = None,
    timeout_s: float | None = None,
    on_program: Any = None,
    reuse: dict[tuple, Compiled] | None = None,
) -> Plan:
    """Compiles every program of ``cfg``'s run for ``topology`` (a `ValueError` if the mesh
    does not cover its chips or the model does not split over it). ``on_program(compiled)``
    hears of each as it is done. ``reuse``, kept between calls that change only some programs
    (a search over settings): a program already compiled with the same `program_key` is taken
    from it, not compiled again."""
    _, programs = run_programs(cfg, model, topology, tokens)
    done = []
    for program in programs:
        key = program_key(program)
        if reuse is not None and key in reuse:
            done.append(reuse[key])
        else:
            done.append(_compile(program, topology, timeout_s))
            if reuse is not None:
                reuse[key] = done[-1]
        if on_program is not None:
            on_program(done[-1])
    m = cfg.mesh
    return Plan(topology, (m.data, m.fsdp, m.tensor), done)


def program_key(program: Program) -> tuple:
    """What makes a compiled program the same as another of a run's: its name and workload, its
    FLOPs, every argument's shape, dtype and layout (its spec over its mesh's shape), and its
    static arguments (the settings a
    plan's search changes show in these; the function itself is made anew for every plan)."""

    def leaf(x: Any) -> tuple:
        if x.sharding is None:
            return (tuple(x.shape), str(x.dtype), None, None)
        # the spec names axes; the mesh's shape says how many ways each splits (fsdp 4 and
        # data 2 x fsdp 2 share every spec)
        axes = tuple(getattr(x.sharding, "mesh", {}) and x.sharding.mesh.shape.items())
        return (tuple(x.shape), str(x.dtype), str(x.sharding.spec), axes)

    args = tuple(leaf(x) for x in jax.tree.leaves(program.args))
    static = tuple(sorted((k, repr(v)) for k, v in program.static.items()))
    return (program.name, program.workload, program.flops, args, static)


def other_meshes(cfg: JarlConfig, chips: int) -> list[JarlConfig]:
    """``cfg`` with each other (data, fsdp, tensor) factorization of ``chips`` that passes the
    config's checks (`check_ranges`), least tensor and data parallelism first."""
    out = []
    for tensor in (t for t in range(1, chips + 1) if chips % t == 0):
        for data in (d for d in range(1, chips // tensor + 1) if chips // tensor % d == 0):
            mesh = dataclasses.replace(
                cfg.mesh, data=data, fsdp=chips // tensor // data, tensor=tensor
            )
            if mesh == cfg.mesh:
                continue
            other = dataclasses.replace(cfg, mesh=mesh)
            if not check_ranges(other):
                out.append(other)
    return out


def full_parameter(cfg: JarlConfig) -> JarlConfig:
    """``cfg``'s run training every weight: ``model.lora`` off (rank 0), the rest the same."""
    lora = dataclasses.replace(cfg.model.lora, rank=0)
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, lora=lora))


def beside(lora: Plan, full: Plan) -> list[str]:
    """A LoRA run's plan beside the same run's training every weight (`full_parameter`),
    both compiled: HBM per chip of each program and the run's peak, the parameters the RL
    update trains and their AdamW state per chip, and the full run's verdict."""
    hbm = lora.topology.chip.hbm_bytes

    def cell(p: Compiled | None) -> str:
        if p is None:
            return "-"
        if p.error is None:
            return _size(p.total)
        if p.arguments > hbm:
            return f"over: its arguments alone {_g(p.arguments)}"
        if (needs := p.needs) is not None:
            return f"over: {'' if needs[1] else 'at least '}{_g(needs[0])}"
        return "not compiled"

    def named(plan: Plan, name: str) -> Compiled | None:
        return next((p for p in plan.programs if p.name == name), None)

    def peak(plan: Plan) -> str:
        return _size(plan.peak[0]) if plan.compiled else "-"

    def row(label: str, a: str, b: str) -> str:
        return f"  {label:<24}{a:<16}{b}"

    rl, rl_full = named(lora, "rl_update"), named(full, "rl_update")
    out = [
        f"LoRA beside training every weight (model.lora.rank=0), both compiled for "
        f"{lora.topology.name}:",
        row("HBM per chip", "LoRA", "every weight"),
    ]
    out += [row(p.name, cell(p), cell(named(full, p.name))) for p in lora.programs]
    out.append(row("run peak", peak(lora), peak(full)))
    if rl is not None and rl_full is not None:
        out.append(row("trained parameters", f"{rl.trained:,}", f"{rl_full.trained:,}"))
        out.append(row("AdamW state per chip", _size(rl.optimizer), _size(rl_full.optimizer)))
    out.append(f"  every weight: {full.verdict()[1]}")
    return out
