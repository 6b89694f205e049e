"""Tree packing: the positions sequences share computed once (``learner.tree_packing``).

Sequences of a step often begin alike: a GRPO group's n responses follow one prompt, a
conversation's per-turn samples each hold the whole conversation before their turn (sample
``k`` is a prefix of sample ``k + 1``), tree rollouts branch off a common trunk. Position
``p`` of sequence ``a`` is computed exactly as position ``p`` of ``b`` when both hold the
same tokens ``0 .. p`` (and, for a MoE policy replaying its sampler's routing, the same
experts there); it also scores the same target when both hold the same token ``p + 1`` (or
both end at ``p``). `shared` counts such leading positions, found by token equality alone.

A row of sequences sorted lexicographically is a trie walked depth first: each sequence
adds the positions it does not share with the one before it (`slots`), so a prefix comes
once, before all its continuations, and the longest shared prefix of a sequence with any
earlier one is the one with its predecessor. Each slot keeps its position in its sequence
(rotary positions continue from the prefix), its token and target, and its ``reach``: one
past the last slot of the last sequence that holds it. A query reads a key iff ``key <=
query < reach[key]`` (`models.decoder.attention`): each continuation reads its prefix and
itself, never a sibling branch, and a prefix's activations get the gradient of every
continuation. The last shared token is not shared when the targets differ: each
continuation recomputes it (one position per branch), so every slot has one target.

The losses see none of this: the step's loss rows stay the separately packed layout
(`batch.make_batch`), and `TreeRows.index` maps each of their positions to the slot that
computes it, so the per-token logprobs, entropies and values of the tree forward are
gathered into that layout and everything after (advantages, GAE, KL, aggregation, metrics)
is what it is with each sequence alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jax_agent_rl.models.moe import NO_EXPERTS

Array = Any  # np.ndarray on the host, jax.Array on the devices

# sequences sharing fewer positions than this are not kept together in a row for it (a chat
# template's first tokens are not worth constraining the packing; within a row any shared
# prefix is still computed once)
MIN_SHARED = 32


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TreeRows:
    """The forward's rows [B, U] of a `TrainBatch` whose sequences share positions: row ``b``
    holds the slots of the loss row ``b``'s sequences (module doc)."""

    tokens: Array  # int32
    positions: Array  # int32, the slot's position in its sequences
    reach: Array  # int32, the slots that read this one end before this (0: padding)
    targets: Array  # int32, the token the slot scores (0 after a sequence's last)
    count: Array  # float32, how many sequences hold the slot (0 on padding)
    index: Array  # int32 [B, T]: the slot computing each position of the loss rows
    expert_ids: Array = None  # [B, U, sparse layers, k] as `TrainBatch.expert_ids`, or None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.tokens.shape)


def shared(a: np.ndarray, b: np.ndarray, ea: np.ndarray | None, eb: np.ndarray | None) -> int:
    """How many leading positions sequences ``a`` and ``b`` (token ids) compute alike and
    score the same target at: all of them for equal sequences, else one less than their
    common prefix; with per-position experts ``ea``, ``eb`` ([n, sparse layers, k]) cut
    before the first position whose experts differ."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    common = int(differ[0]) if differ.size else n
    same = common if len(a) == len(b) == common else max(common - 1, 0)
    if ea is not None and eb is not None and same:
        apart = np.flatnonzero((ea[:same] != eb[:same]).reshape(same, -1).any(-1))
        same = int(apart[0]) if apart.size else same
    return same


def lexicographic(seqs: Sequence[np.ndarray], ids: Sequence[int]) -> list[int]:
    """``ids`` sorted by their sequences' tokens, lexicographically (a prefix first)."""
    return sorted(ids, key=lambda i: (seqs[i].astype(">u4").tobytes(), i))


def units(
    seqs: Sequence[np.ndarray],
    experts: Sequence[np.ndarray | None],
    ids: Sequence[int],
    row_tokens: int,
) -> tuple[list[list[int]], list[int]]:
    """``ids`` as runs of lexicographically adjacent sequences sharing at least `MIN_SHARED`
    positions, each run's slots fitting ``row_tokens`` (a longer sequence: a run of its own),
    and each run's slots: the items rows are packed from."""
    runs: list[list[int]] = []
    sizes: list[int] = []
    prev = None
    for i in lexicographic(seqs, ids):
        n = len(seqs[i])
        common = 0 if prev is None else shared(seqs[prev], seqs[i], experts[prev], experts[i])
        if runs and common >= MIN_SHARED and sizes[-1] + n - common <= row_tokens:
            runs[-1].append(i)
            sizes[-1] += n - common
        else:
            runs.append([i])
            sizes.append(n)
        prev = i
    return runs, sizes


def slots(
    seqs: Sequence[np.ndarray], experts: Sequence[np.ndarray | None], row: Sequence[int]
) -> tuple[list[int], dict[int, np.ndarray], np.ndarray]:
    """The trie of one row's sequences: their order (lexicographic), each one's slot of every
    position ([n] ints), and each slot's reach."""
    order = lexicographic(seqs, row)
    where: dict[int, np.ndarray] = {}
    common = [0] * len(order)
    ends = [0] * len(order)
    at = 0
    for j, i in enumerate(order):
        n = len(seqs[i])
        if j:
            prev = order[j - 1]
            common[j] = shared(seqs[prev], seqs[i], experts[prev], experts[i])
        own = np.empty(n, np.int64)
        own[: common[j]] = where[order[j - 1]][: common[j]] if j else own[:0]
        own[common[j] :] = at + np.arange(n - common[j])
        where[i] = own
        at += n - common[j]
        ends[j] = at
    reach = np.zeros(at, np.int64)
    for j, i in enumerate(order):
        start = ends[j] - (len(seqs[i]) - common[j])
        reach[start : ends[j]] = ends[j]
        held = len(seqs[i])  # the later sequences holding this one's positions below `held`
        for m in range(j + 1, len(order)):
            held = min(held, common[m])
            if held <= common[j]:
                break
            reach[start : start + held - common[j]] = ends[m]
    return order, where, reach


def tree_rows(
    seqs: Sequence[np.ndarray],
    experts: Sequence[np.ndarray | None],
    layout: Sequence[Sequence[int]],
    T: int,
    U: int | None = None,
) -> TreeRows:
    """`TreeRows` of ``layout`` (each row's sequences, as the loss rows lay them out one
    after another in rows of ``T``), ``U`` slots a row (default: the fullest row's; an
    empty row has one padding slot).
    ``experts``: each sequence's experts per position (`NO_EXPERTS` where none was sampled),
    or all None."""
    tries = [slots(seqs, experts, row) for row in layout]
    U = max((len(r) for _, _, r in tries), default=1) if U is None else U
    B = len(layout)
    tokens, positions, reach, targets, index = (np.zeros((B, n), np.int32) for n in (U,) * 4 + (T,))
    count = np.zeros((B, U), np.float32)
    carrying = next((e for e in experts if e is not None), None)
    expert_ids = None
    if carrying is not None:
        expert_ids = np.full((B, U, *carrying.shape[1:]), NO_EXPERTS, carrying.dtype)
    for b, (row, (order, where, r)) in enumerate(zip(layout, tries, strict=True)):
        if len(r) > U:
            raise ValueError(f"a row of {len(r)} slots does not fit {U}")
        reach[b, : len(r)] = r
        for i in order:
            seq, own = seqs[i], where[i]
            tokens[b, own] = seq
            positions[b, own] = np.arange(len(seq))
            targets[b, own[:-1]] = seq[1:]
            count[b, own] += 1
            if expert_ids is not None and experts[i] is not None:
                expert_ids[b, own] = experts[i]
        at = 0
        for i in row:  # the loss row's order (`batch.make_batch`)
            index[b, at : at + len(seqs[i])] = where[i]
            at += len(seqs[i])
    return TreeRows(tokens, positions, reach, targets, count, index, expert_ids)


def widened(rows: TreeRows, U: int) -> TreeRows:
    """``rows`` with padding slots up to ``U`` a row."""
    pad = U - rows.shape[1]
    if pad < 0:
        raise ValueError(f"rows of {rows.shape[1]} slots do not fit {U}")

    def widen(x: np.ndarray) -> np.ndarray:
        return np.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))

    return dataclasses.replace(
        rows,
        **{
            f: widen(getattr(rows, f)) for f in ("tokens", "positions", "reach", "targets", "count")
        },
        expert_ids=None if rows.expert_ids is None else widen(rows.expert_ids),
    )
