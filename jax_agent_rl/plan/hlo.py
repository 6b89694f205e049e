"""What a compiled program computes and moves, read from its optimized HLO text
(``compiled.as_text()``), with every loop's trip count applied: `count` walks the program
from its entry computation, and each op it meets costs

- **FLOPs**: 2 per multiply-add of each ``dot`` and ``convolution``, inside fusions too (what
  the matrix units do; elementwise work, exp and the like, is not counted);
- **bytes**: what the op reads from and writes to HBM: its operands and its result, as XLA's
  cost analysis counts a fusion's (an operand the fusion only slices, ``dynamic-slice`` /
  ``slice`` / ``gather``, counts the slices it reads; a result written in place by a
  ``dynamic-update-slice``, its update; the buffer updated, nothing);
- **loops**: a ``while`` body's ops count once per iteration: the trip count XLA found
  (``known_trip_count`` in its backend config) or, for a loop whose count only the device
  knows (the learner's loops over the real micro-batches), the one its caller gives by the
  loop's named scope (``trips``; a loop neither knows counts once, and is listed as such);
  a ``conditional`` costs its dearest branch; ``call``, async wrappers: their computations;
- **Pallas kernels** (``tpu_custom_call``: XLA's cost analysis counts them as nothing): the
  kernel's own cost estimate when it carries one, else the caller's analytic count
  (``kernels``, by kernel name and operand shapes), else their operands and results' bytes;
- **collectives** (all-gather, reduce-scatter, all-reduce, all-to-all, collective-permute):
  their operands and results as HBM bytes, and listed apart (`Count.collectives`), each with
  its trip count, for a reader (and a test) to see what the mesh makes the program send.

What it misses: the ops' own time beyond the roofline (a fusion's compute-bound elementwise
work, a kernel's VMEM reuse or re-reads), the overlap of collectives with compute, and the
bytes a buffer kept in on-chip memory saves (memory-space assignment's prefetches count as
copies, the buffers they place as HBM reads).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

# bits per element of each HLO element type
_BITS = {
    "pred": 8,
    "s2": 2,
    "u2": 2,
    "s4": 4,
    "u4": 4,
    "s8": 8,
    "u8": 8,
    "s16": 16,
    "u16": 16,
    "s32": 32,
    "u32": 32,
    "s64": 64,
    "u64": 64,
    "bf16": 16,
    "f16": 16,
    "f32": 32,
    "f64": 64,
    "c64": 64,
    "c128": 128,
    "token": 0,
}
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\](\{[^}]*\})?")
COLLECTIVES = (
    "all-gather",
    "reduce-scatter",
    "all-reduce",
    "all-to-all",
    "ragged-all-to-all",
    "collective-permute",
    "collective-broadcast",
)
# no work of their own: structure and aliases (an async op's "-done" half: counted at its start)
_FREE = frozenset(
    {
        "parameter",
        "constant",
        "get-tuple-element",
        "tuple",
        "bitcast",
        "after-all",
        "add-dependency",
        "partition-id",
        "replica-id",
        "opt-barrier",
        "domain",
        "async-update",
    }
)
_SLICES = frozenset({"dynamic-slice", "slice", "gather"})
# custom calls that only name a layout or reserve a buffer
_NO_WORK_TARGETS = frozenset({"AllocateBuffer", "Sharding", "SPMDFullToShardShape"})


def arrays(shape: str, hbm: bool = False) -> list[tuple[str, tuple[int, ...]]]:
    """The (element type, dimensions) of each array in an HLO type (an array, or a tuple);
    with ``hbm``, of those in HBM only (not of another memory space: an ``S(n)`` in the
    layout, on-chip memory where memory-space assignment placed the buffer)."""
    out = []
    for dtype, dims, layout in _ARRAY.findall(shape):
        if dtype not in _BITS or (hbm and re.search(r"S\([1-9]\d*\)", layout)):
            continue
        out.append((dtype, tuple(int(d.lstrip("<=")) for d in dims.split(",") if d)))
    return out


def nbytes(shape: str) -> int:
    """Bytes of the arrays of an HLO type that live in HBM."""
    return sum(math.prod(d) * _BITS[t] // 8 for t, d in arrays(shape, hbm=True))


def array_bytes(shape: str) -> int:
    """Bytes of every array of an HLO type, in whatever memory."""
    return sum(math.prod(d) * _BITS[t] // 8 for t, d in arrays(shape))


def elements(shape: str) -> list[str]:
    """A tuple type's elements (an array type: itself)."""
    return _split(shape[1:-1]) if shape.startswith("(") else [shape]


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One HLO instruction: ``%name = shape opcode(operands), attrs``."""

    name: str
    shape: str
    opcode: str
    operands: tuple[str, ...]
    attrs: str
    root: bool = False
    number: int | None = None  # a parameter's: its place among its computation's
    raw: str = ""  # the text between the opcode's parentheses

    def attr(self, key: str) -> str | None:
        """The value of ``key=...`` among the attributes (a name, ``{...}`` or a word)."""
        m = re.search(rf"(?:^|[ ,]){re.escape(key)}=", self.attrs)
        if m is None:
            return None
        rest = self.attrs[m.end() :]
        if rest[:1] in "{([":
            return rest[: _balanced(rest, 0) + 1]
        return re.split(r"[,\s]", rest, maxsplit=1)[0]

    def called(self, key: str) -> list[str]:
        """The computations an attribute names (``body=%b``, ``branch_computations={%a, %b}``)."""
        value = self.attr(key)
        return [] if value is None else re.findall(r"%?([\w.\-]+)", value.strip("{}"))

    @property
    def backend_config(self) -> dict[str, Any]:
        value = self.attr("backend_config")
        if value is None or not value.startswith("{"):
            return {}
        try:
            out = json.loads(value)
        except json.JSONDecodeError:
            return {}
        return out if isinstance(out, dict) else {}

    @property
    def where(self) -> str:
        """The JAX op the instruction comes from (its metadata's ``op_name``), or ''."""
        m = re.search(r'op_name="([^"]*)"', self.attrs)
        return m.group(1) if m else ""


def _balanced(text: str, i: int) -> int:
    """The index of the bracket closing the one at ``text[i]`` (any of ( [ {, nested)."""
    depth, quoted = 0, False
    for j in range(i, len(text)):
        c = text[j]
        if c == '"' and text[j - 1] != "\\":
            quoted = not quoted
        elif quoted:
            continue
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                return j
    raise ValueError(f"unbalanced HLO text: {text[i : i + 80]!r}")


def _split(text: str) -> list[str]:
    """``text`` split at its top-level commas."""
    parts, depth, start = [], 0, 0
    for j, c in enumerate(text):
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c == "," and depth == 0:
            parts.append(text[start:j])
            start = j + 1
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


_HEAD = re.compile(r"\s*(ROOT\s+)?%([\w.\-]+)\s*=\s*")
_COMPUTATION = re.compile(r"^(ENTRY\s+)?%([\w.\-]+)\s*\(")


def _instruction(line: str) -> Instruction | None:
    head = _HEAD.match(line)
    if head is None:
        return None
    i = head.end()
    if line[i] == "(":  # a tuple type
        end = _balanced(line, i) + 1
    else:
        m = re.compile(r"[a-z][a-z0-9]*\[[^\]]*\]").match(line, i)
        if m is None:
            return None
        end = m.end()
        if end < len(line) and line[end] == "{":
            end = _balanced(line, end) + 1
    shape = line[i:end]
    op = re.compile(r"\s*([a-z][\w\-]*)\(").match(line, end)
    if op is None:
        return None
    open_ = op.end() - 1
    close = _balanced(line, open_)
    operands = tuple(
        m.group(1)
        for p in _split(line[open_ + 1 : close])
        if (m := re.search(r"%([\w.\-]+)\s*$", p))
    )
    attrs = line[close + 1 :].lstrip(", ")
    inside = line[open_ + 1 : close].strip()
    number = int(inside) if op.group(1) == "parameter" and inside.isdigit() else None
    return Instruction(
        head.group(2), shape, op.group(1), operands, attrs, bool(head.group(1)), number, inside
    )


@dataclasses.dataclass(frozen=True)
class Module:
    """A compiled HLO module: its computations' instructions in order, and its entry's name."""

    computations: dict[str, list[Instruction]]
    entry: str

    @classmethod
    def parse(cls, text: str) -> Module:
        computations: dict[str, list[Instruction]] = {}
        entry, current = "", None
        lines: list[str] = []

        def flush() -> None:
            ins = _instruction(" ".join(lines)) if lines else None
            if ins is not None and current is not None:
                computations[current].append(ins)
            lines.clear()

        for line in text.splitlines():
            if current is None:
                m = _COMPUTATION.match(line)
                if m and line.rstrip().endswith("{"):
                    current = m.group(2)
                    computations[current] = []
                    entry = current if m.group(1) else entry
                continue
            # `}` (or `}, execution_thread=...`) ends a computation; an instruction may run on
            # over several lines (a kernel's metadata holds newlines)
            if line.rstrip() == "}" or line.startswith("}, execution_thread="):
                flush()
                current = None
            elif _HEAD.match(line) and line.startswith(" "):
                flush()
                lines.append(line)
            elif lines:
                lines.append(line)
        if not entry:
            raise ValueError("no ENTRY computation in the HLO text")
        return cls(computations, entry)

    def named(self) -> dict[str, Instruction]:
        return {i.name: i for body in self.computations.values() for i in body}


@dataclasses.dataclass(frozen=True)
class Op:
    """One op of the program, its cost over the whole run of it (``trips`` times)."""

    name: str
    kind: str  # the opcode; a fusion's "fusion"; a kernel's "kernel <name>"
    flops: float
    bytes: float
    trips: int
    where: str  # the JAX op it comes from (metadata), '' if none
    shape: str  # its result's type


@dataclasses.dataclass(frozen=True)
class Loop:
    """A ``while`` of the program: how many times it ran, and whether XLA knew that
    (``known``), the caller gave it by its named scope (``given``), or neither (once)."""

    name: str
    trips: int
    source: str  # "known", "given" or "unknown"
    where: str


@dataclasses.dataclass(frozen=True)
class Count:
    """A program's FLOPs and HBM bytes with its loops' trip counts applied (the module
    docstring says what each counts), and its ops, loops and collectives."""

    flops: float
    bytes: float
    ops: tuple[Op, ...]
    loops: tuple[Loop, ...]

    @property
    def collectives(self) -> tuple[Op, ...]:
        return tuple(o for o in self.ops if o.kind in COLLECTIVES)

    @property
    def kernels(self) -> tuple[Op, ...]:
        return tuple(o for o in self.ops if o.kind.startswith("kernel "))

    def seconds(self, peak_flops: float, bandwidth: float) -> float:
        """A roofline per op, summed: each op takes max(FLOPs / ``peak_flops``, bytes /
        ``bandwidth``), one after another."""
        return sum(max(o.flops / peak_flops, o.bytes / bandwidth) for o in self.ops)

    def top(self, key: str, n: int) -> list[Op]:
        """The ``n`` ops with the most ``key`` ("flops" or "bytes"), none of zero."""
        ranked = sorted(self.ops, key=lambda o: getattr(o, key), reverse=True)
        return [o for o in ranked[:n] if getattr(o, key) > 0]


# a kernel's (FLOPs, bytes) from its name, its operands' types and its result's; None: not known
KernelCost = Callable[[str, list[str], str], tuple[float, float] | None]


def count(
    text: str,
    trips: Mapping[str, int] | None = None,
    kernels: KernelCost | None = None,
) -> Count:
    """The compiled HLO ``text``'s `Count`. ``trips``: named scope -> the trip count of a loop
    XLA could not count whose JAX op is that scope's (``.../<scope>/while``); ``kernels``:
    the analytic cost of a Pallas kernel carrying no cost estimate."""
    module = Module.parse(text)
    return _Counter(module, dict(trips or {}), kernels).run()


class _Counter:
    def __init__(self, module: Module, trips: dict[str, int], kernels: KernelCost | None):
        self.module = module
        self.trips = trips
        self.kernels = kernels
        self.named = module.named()
        self.users: dict[str, dict[str, list[Instruction]]] = {}  # computation -> name -> users
        self.ops: list[Op] = []
        self.loops: list[Loop] = []

    def run(self) -> Count:
        self.walk(self.module.entry, 1, self.ops, self.loops)
        flops = sum(o.flops for o in self.ops)
        return Count(flops, sum(o.bytes for o in self.ops), tuple(self.ops), tuple(self.loops))

    def shape(self, name: str) -> str:
        ins = self.named.get(name)
        return "" if ins is None else ins.shape

    def walk(self, computation: str, trips: int, ops: list[Op], loops: list[Loop]) -> None:
        for ins in self.module.computations.get(computation, []):
            code = ins.opcode
            if code in _FREE:
                continue
            if code == "while":
                n, source = self.trip_count(ins)
                loops.append(Loop(ins.name, trips * n, source, ins.where))
                for key in ("body", "condition"):
                    for c in ins.called(key):
                        self.walk(c, trips * n, ops, loops)
            elif code == "conditional":
                branches = ins.called("branch_computations") or [
                    *ins.called("true_computation"),
                    *ins.called("false_computation"),
                ]
                costs = []
                for c in branches:
                    branch_ops: list[Op] = []
                    branch_loops: list[Loop] = []
                    self.walk(c, trips, branch_ops, branch_loops)
                    costs.append((sum(o.bytes for o in branch_ops), branch_ops, branch_loops))
                if costs:
                    _, dearest, dearest_loops = max(costs, key=lambda c: c[0])
                    ops += dearest
                    loops += dearest_loops
            elif code in ("call", "async-start"):
                for c in ins.called("to_apply") or ins.called("calls"):
                    self.walk(c, trips, ops, loops)
            elif (op := self.op(ins, trips)) is not None:
                ops.append(op)

    def trip_count(self, ins: Instruction) -> tuple[int, str]:
        known = ins.backend_config.get("known_trip_count", {}).get("n")
        if known is not None:
            return int(known), "known"
        bound = self.constant_bound(ins)
        if bound is not None:
            return bound, "known"
        where = ins.where
        for scope, n in self.trips.items():
            if f"/{scope}/while" in where or where.startswith(f"{scope}/while"):
                return n, "given"
        return 1, "unknown"

    def constant_bound(self, ins: Instruction) -> int | None:
        """A loop's trip count when its condition is ``i < N``, ``i`` the first element of
        its state and ``N`` a constant (a scan's, a fori_loop's of static bounds), starting
        from a constant (0 if not one)."""
        cond = ins.called("condition")
        body = self.module.computations.get(cond[0], []) if cond else []
        root = next((i for i in body if i.root), None)
        operands = root.operands if root is not None else ()
        if root is not None and root.opcode == "fusion":  # the compare, fused (XLA:CPU)
            fused = self.module.computations.get((root.called("calls") or [""])[0], [])
            inner = next((i for i in fused if i.root), None)
            params = {p.name: p.number for p in fused if p.number is not None}
            if inner is None or any(params.get(o) is None for o in inner.operands):
                return None
            operands = tuple(root.operands[params[o] or 0] for o in inner.operands)
            root = inner
        if root is None or root.opcode != "compare" or "direction=LT" not in root.attrs:
            return None
        counter, limit = (self.named.get(o) for o in operands)
        if (
            counter is None
            or limit is None
            or counter.opcode != "get-tuple-element"
            or counter.attr("index") != "0"
            or limit.opcode != "constant"
        ):
            return None
        start = 0
        init = self.named.get(ins.operands[0]) if ins.operands else None
        if init is not None and init.opcode == "tuple" and init.operands:
            first = self.named.get(init.operands[0])
            if first is not None and first.opcode == "constant":
                start = _scalar(first) or 0
        end = _scalar(limit)
        return None if end is None else max(end - start, 0)

    def op(self, ins: Instruction, trips: int) -> Op | None:
        code, kind = ins.opcode, ins.opcode
        flops = 0.0
        if code.endswith("-done"):  # the end of an async op, counted at its start
            return None
        if code == "fusion":
            return self.fusion_op(ins, trips)
        if code.endswith("-start"):  # its result's first element is its operands'
            parts = elements(ins.shape)
            written = parts[1:] if ins.shape.startswith("(") and len(parts) > 1 else parts
            moved = float(sum(nbytes(p) for p in written))
            if code == "slice-start":  # reads what it slices, wherever it puts it
                moved += sum(array_bytes(p) for p in written[:1])
            else:
                moved += sum(nbytes(self.shape(o)) for o in ins.operands)
            kind = _collective(code) or code
        elif code == "custom-call":
            target = (ins.attr("custom_call_target") or "").strip('"')
            if target == "tpu_custom_call":
                kind = f"kernel {_kernel_name(ins.name)}"
                flops, moved = self.kernel_cost(ins)
            elif target in _NO_WORK_TARGETS:
                moved = 0
            else:
                moved = self.plain_bytes(ins)
        else:
            flops = self.matmul_flops(ins)
            moved = self.plain_bytes(ins)
            kind = _collective(code) or code
        return Op(ins.name, kind, flops * trips, moved * trips, trips, ins.where, ins.shape)

    def fusion_op(self, ins: Instruction, trips: int) -> Op | None:
        """A fusion's cost; one holding a collective (an async collective's start, or a
        collective fused with compute) is that collective's, an async one's end nothing."""
        fused = (ins.called("calls") or [""])[0]
        body = self.module.computations.get(fused, [])
        flops = self.fused_flops(fused)  # a collective may be fused with a matmul
        collective = next((i for i in body if _collective(i.opcode)), None)
        if collective is None:
            moved = self.fusion_bytes(ins, fused)
            return Op(ins.name, "fusion", flops * trips, moved * trips, trips, ins.where, ins.shape)
        root = next((i for i in body if i.root), None)
        target = (root.attr("custom_call_target") or "").strip('"') if root else ""
        if target == "AsyncCollectiveDone":
            return None
        if target == "AsyncCollectiveStart":
            moved = float(nbytes(collective.shape)) + sum(
                nbytes(self.shape(o)) for o in collective.operands
            )
        else:
            moved = self.fusion_bytes(ins, fused)
        kind = _collective(collective.opcode)
        return Op(
            ins.name, kind, flops * trips, moved * trips, trips, collective.where, collective.shape
        )

    def matmul_flops(self, ins: Instruction) -> float:
        if ins.opcode == "dot":
            lhs = arrays(self.shape(ins.operands[0]))
            contracting = ins.attr("lhs_contracting_dims") or "{}"
            dims = [int(d) for d in contracting.strip("{}").split(",") if d.strip()]
            if not lhs:
                return 0.0
            k = math.prod(lhs[0][1][d] for d in dims)
            return 2.0 * _elements(ins.shape) * k
        if ins.opcode == "convolution":
            return self.convolution_flops(ins)
        return 0.0

    def convolution_flops(self, ins: Instruction) -> float:
        """2 x batch x output features x input features (per group) x, for each spatial
        dimension, the (output, window) position pairs that land on the input rather than on
        its padding (XLA writes some matmuls as convolutions over a padded window)."""
        labels = re.fullmatch(r"(\w+)_(\w+)->(\w+)", ins.attr("dim_labels") or "")
        operands = [arrays(self.shape(o)) for o in ins.operands[:2]]
        lhs_shape, rhs_shape = (a[0][1] if a else () for a in operands)
        out = arrays(ins.shape)
        if labels is None or not out or not lhs_shape or not rhs_shape:
            return 0.0
        lhs_l, rhs_l, out_l = labels.groups()
        out_shape = out[0][1]
        if (len(lhs_l), len(rhs_l), len(out_l)) != (len(lhs_shape), len(rhs_shape), len(out_shape)):
            return 0.0
        window = _window(ins.attr("window") or "")
        total = 2.0 * out_shape[out_l.index("b")] * out_shape[out_l.index("f")]
        total *= rhs_shape[rhs_l.index("i")]
        for n, d in enumerate(sorted(c for c in rhs_l if c.isdigit())):
            total *= _window_pairs(
                out_shape[out_l.index(d)],
                rhs_shape[rhs_l.index(d)],
                lhs_shape[lhs_l.index(d)],
                *(window.get(k, [1 - (k == "pad_lo")] * (n + 1))[n] for k in _WINDOW_KEYS),
            )
        return total

    def fused_flops(self, computation: str) -> float:
        total = 0.0
        for ins in self.module.computations.get(computation, []):
            if ins.opcode in ("fusion", "call"):
                total += sum(
                    self.fused_flops(c) for c in ins.called("calls") + ins.called("to_apply")
                )
            else:
                total += self.matmul_flops(ins)
        return total

    def users_of(self, computation: str) -> dict[str, list[Instruction]]:
        if computation not in self.users:
            users: dict[str, list[Instruction]] = {}
            for ins in self.module.computations.get(computation, []):
                for o in ins.operands:
                    users.setdefault(o, []).append(ins)
            self.users[computation] = users
        return self.users[computation]

    def fusion_bytes(self, ins: Instruction, fused: str) -> float:
        body = self.module.computations.get(fused, [])
        params = {p.number: p.name for p in body if p.number is not None}
        users = self.users_of(fused)
        root = next((i for i in body if i.root), None)
        in_place = {r.operands[0] for r in self._roots(root) if r.opcode == "dynamic-update-slice"}
        read = 0.0
        for i, operand in enumerate(ins.operands):
            param = params.get(i)
            full = nbytes(self.shape(operand))
            if param is None:
                read += full
                continue
            uses = list(self._through_bitcasts(param, users))
            sliced = self.sliced(fused, param)
            if sliced is not None:  # what it slices, from where the operand lives
                read += sliced if full else 0
            elif param in in_place or (
                uses
                and all(u.opcode == "dynamic-update-slice" and u.operands[0] == p for p, u in uses)
            ):
                continue  # the buffer a dynamic-update-slice writes into, in place
            else:
                read += full
        written = 0.0
        for r in self._roots(root):
            if r.opcode == "dynamic-update-slice":
                written += nbytes(self.shape(r.operands[1]))
            else:
                written += nbytes(r.shape)
        return read + written

    def sliced(self, computation: str, param: str) -> float | None:
        """The bytes a fused computation reads of its parameter ``param`` when it only slices
        it (directly, through bitcasts, or inside a fusion nested in it), else None."""
        uses = list(self._through_bitcasts(param, self.users_of(computation)))
        if not uses:
            return None
        total = 0.0
        for value, user in uses:
            if user.opcode in _SLICES and user.operands[0] == value:
                total += array_bytes(user.shape)
                continue
            nested = user.called("calls") if user.opcode == "fusion" else []
            body = self.module.computations.get(nested[0], []) if nested else []
            inner = [
                p.name
                for p in body
                if p.number is not None
                and p.number < len(user.operands)
                and user.operands[p.number] == value
            ]
            if not inner:
                return None
            for name in inner:
                part = self.sliced(nested[0], name)
                if part is None:
                    return None
                total += part
        return total

    def _through_bitcasts(
        self, name: str, users: dict[str, list[Instruction]]
    ) -> Iterator[tuple[str, Instruction]]:
        """The users of ``name`` (as pairs of the value used and its user), looking through
        bitcasts."""
        for u in users.get(name, []):
            if u.opcode == "bitcast":
                yield from self._through_bitcasts(u.name, users)
            else:
                yield name, u

    def _roots(self, root: Instruction | None) -> list[Instruction]:
        """A fusion's outputs: its root, or a tuple root's elements (looking through
        bitcasts)."""
        if root is None:
            return []
        if root.opcode == "tuple":
            return [r for o in root.operands for r in self._roots(self.named.get(o))]
        if root.opcode == "bitcast" and root.operands:
            inner = self.named.get(root.operands[0])
            if inner is not None and inner.opcode == "dynamic-update-slice":
                return [inner]
        return [root]

    def plain_bytes(self, ins: Instruction) -> float:
        """An unfused op's operands and result (a slice reads what it slices; an in-place
        dynamic-update-slice writes its update and reads it)."""
        if ins.opcode in _SLICES:
            return 2.0 * nbytes(ins.shape) + sum(nbytes(self.shape(o)) for o in ins.operands[1:])
        if ins.opcode == "dynamic-update-slice":
            return 2.0 * nbytes(self.shape(ins.operands[1]))
        return float(nbytes(ins.shape) + sum(nbytes(self.shape(o)) for o in ins.operands))

    def kernel_cost(self, ins: Instruction) -> tuple[float, float]:
        estimate = ins.backend_config.get("custom_call_config", {})
        estimate = ins.backend_config.get("cost_estimate") or (
            estimate.get("cost_estimate") if isinstance(estimate, dict) else None
        )
        if isinstance(estimate, dict) and "flops" in estimate:
            return float(estimate["flops"]), float(estimate.get("bytes_accessed", 0))
        operands = [self.shape(o) for o in ins.operands]
        if self.kernels is not None:
            known = self.kernels(_kernel_name(ins.name), operands, ins.shape)
            if known is not None:
                return known
        return 0.0, float(sum(nbytes(s) for s in operands) + nbytes(ins.shape))


_WINDOW_KEYS = ("stride", "pad_lo", "lhs_dilate", "rhs_dilate")  # `_window_pairs`'s order


def _window(text: str) -> dict[str, list[int]]:
    """A convolution's ``window={size=3x3 stride=1x1 pad=0_0x1_1 lhs_dilate=... }``."""
    out: dict[str, list[int]] = {}
    for key, value in re.findall(r"(\w+)=([\d_x\-]+)", text):
        parts = value.split("x")
        if key == "pad":
            out["pad_lo"] = [int(p.split("_")[0]) for p in parts]
        elif key in ("size", "stride", "lhs_dilate", "rhs_dilate"):
            out[key] = [int(p) for p in parts]
    return out


def _window_pairs(
    out: int, kernel: int, size: int, stride: int, pad_lo: int, lhs_dilate: int, rhs_dilate: int
) -> int:
    """The (output position, window position) pairs of one spatial dimension that read the
    input, not its padding or the holes of its dilation."""
    if out * kernel > 1 << 20:  # a real convolution's: every pair (padding is a fringe)
        return out * kernel
    pairs = 0
    for o in range(out):
        for k in range(kernel):
            at = o * stride - pad_lo + k * rhs_dilate
            if at >= 0 and at % lhs_dilate == 0 and at // lhs_dilate < size:
                pairs += 1
    return pairs


def _collective(opcode: str) -> str:
    """The collective an opcode is (its async start's too), or ''."""
    return next((c for c in COLLECTIVES if opcode in (c, f"{c}-start")), "")


def _scalar(constant: Instruction) -> int | None:
    """The integer a scalar ``constant(N)`` holds, else None."""
    m = re.search(r"constant\((-?\d+)\)", f"{constant.opcode}({constant.raw})")
    return int(m.group(1)) if m else None


def _kernel_name(name: str) -> str:
    """A Pallas kernel's name from its instruction's (``splash_mha_fwd.3``)."""
    return re.sub(r"(\.\d+)+$", "", name)


def _elements(shape: str) -> int:
    return sum(math.prod(d) for _, d in arrays(shape))
