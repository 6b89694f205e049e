"""Sampled sequences (`rl.sequence.TrainSequence`) -> learner rows: the only place token lists
become a learner batch.

A sequence is ``prompt_ids + response_ids``. A row holds one sequence, right-padded (packing
off, and SFT), or several one after another (`pack_rows`: first-fit decreasing into rows of
``learner.row_tokens``), each with its own segment id and positions restarting at 0, so
attention never crosses from one to the next; ``sequence`` names each token's sequence for
the per-sequence terms (GRPO groups, sequence-mean losses, GAE, the last token's reward).
A step's sequences are split into its mini-batches first and each mini-batch packed on its
own (`step_batch`), so a mini-batch is the same set of sequences however rows fall. With
tree packing (`rl.tree`) the rows hold sequences that share a prefix, and the batch carries
the forward's rows besides, where each shared position is computed once.

Everything per token is stored at the position that *predicts* it: ``targets[t] =
tokens[t + 1]`` within a sequence, and ``mask[t]`` is 1 when that target is a model-sampled
token (the trajectory's loss mask), so the logits at ``t`` score ``targets[t]`` with no
further shifting anywhere. Nothing is re-tokenized. So are a MoE policy's sampled experts
(`TrainSequence.expert_ids`): ``expert_ids[t]`` are those of the position ``t`` the sampler
computed ``targets[t]`` from, -1 (`NO_EXPERTS`: the learner routes itself) where the target
was not sampled (prompt, tool and padding positions).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jax_agent_rl.models.decoder import ATTN_BLOCK
from jax_agent_rl.models.moe import NO_EXPERTS
from jax_agent_rl.rl.sequence import TrainSequence
from jax_agent_rl.rl.tree import TreeRows, tree_rows, units, widened

Array = Any  # np.ndarray on the host, jax.Array on the devices


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainBatch:
    """[R, T] rows of whole sequences, one or several packed per row; per-token fields are
    aligned with ``targets`` (see module doc). Inputs only: what the learner derives from
    them (old-policy and reference logprobs, values, advantages) it computes itself."""

    tokens: Array  # int32, the model's input
    positions: Array  # int32, restarting at 0 in every sequence
    segment_ids: Array  # int32, 1, 2, ... for the row's sequences, 0 on padding
    sequence: Array  # int32, the batch-wide index of each token's sequence (0 on padding)
    targets: Array  # int32, tokens shifted left by one (within a sequence)
    mask: Array  # float32, 1 where the target is a sampled token
    rollout_logp: Array  # float32, the sampler's logprob of each target
    # no sequence is longer (static: attention reads this many keys back at most)
    window: int = dataclasses.field(default=0, metadata=dict(static=True))
    # [R, T, sparse layers, k] ints: the sampler's experts for each target (routing replay),
    # NO_EXPERTS where it sampled none; None when no trajectory carries any (a dense policy)
    expert_ids: Array = None
    # the rows the forward runs on when the sequences share positions (`rl.tree`); None: these
    tree: TreeRows | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.tokens.shape)

    def rows(self, index: np.ndarray | slice) -> TrainBatch:
        """A subset of rows (host arrays)."""
        return jax.tree.map(lambda x: np.asarray(x)[index], self)


def turn_spans(loss_mask: Sequence[int]) -> list[tuple[int, int]]:
    """``[start, end)`` of each model turn: each maximal run of sampled tokens (mask 1). The
    loop samples a turn in one run (a continued inline block included) and follows it with
    template or tool tokens (mask 0), so runs and turns are the same."""
    spans: list[tuple[int, int]] = []
    for i, m in enumerate(loss_mask):
        if m and spans and spans[-1][1] == i:
            spans[-1] = (spans[-1][0], i + 1)
        elif m:
            spans.append((i, i + 1))
    return spans


def per_turn_samples(seq: TrainSequence) -> list[TrainSequence]:
    """``seq`` as one training sample per model turn (``algorithm.turn_mode=per_turn``):
    sample ``k``'s prompt is the token-exact prefix up to turn ``k`` (``prompt_ids`` and the
    response before it), its response that turn's tokens only, with their logprobs and
    versions; uid ``<uid>#<k>``, group and reward the episode's. An episode without a model
    token stays one sample."""
    samples = []
    for k, (a, b) in enumerate(turn_spans(seq.loss_mask)):
        samples.append(
            TrainSequence(
                uid=f"{seq.uid}#{k}",
                group_id=seq.group_id,
                prompt_ids=[*seq.prompt_ids, *seq.response_ids[:a]],
                response_ids=seq.response_ids[a:b],
                loss_mask=seq.loss_mask[a:b],
                rollout_logprobs=seq.rollout_logprobs[a:b],
                token_versions=seq.token_versions[a:b],
                kv_versions=seq.kv_versions[a:b],
                expert_ids=None if seq.expert_ids is None else seq.expert_ids[a:b],
                reward=seq.reward,
            )
        )
    return samples or [seq]


def padded_length(n: int, bucket: int) -> int:
    """The smallest ``bucket * 2**k`` holding ``n`` tokens: a run whose sequences reach
    ``max_len`` meets at most ``log2(max_len / bucket) + 1`` lengths, so its training step
    compiles that many times at most (each compile costs far more than the <= 2x padding)."""
    blocks = max(1, -(-n // bucket))
    return bucket * (1 << (blocks - 1).bit_length())


def sequence_length(traj: TrainSequence) -> int:
    return len(traj.prompt_ids) + len(traj.response_ids)


def longest_sequence(trajectories: Sequence[TrainSequence]) -> int:
    return max((sequence_length(t) for t in trajectories), default=1)


Layout = list[list[int]]  # the sequences of each row, by index


def one_per_row(n: int) -> Layout:
    """Packing off: sequence ``i`` alone in row ``i``."""
    return [[i] for i in range(n)]


def pack_rows(lengths: Sequence[int], row_tokens: int) -> Layout:
    """Sequences into rows of ``row_tokens`` tokens, first-fit decreasing: longest first, each
    into the first row with room, or a new row. A sequence longer than a row gets a row of its
    own. FFD uses at most
    ``11/9 OPT + 6/9`` rows (Dosa 2007); on many short sequences it fills all but the last."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    rows: Layout = []
    free: list[int] = []
    for i in order:
        n = lengths[i]
        row = next((r for r, room in enumerate(free) if room >= n), None)
        if row is None:
            rows.append([i])
            free.append(max(row_tokens - n, 0))
        else:
            rows[row].append(i)
            free[row] -= n
    return rows


def row_fill(layout: Layout, lengths: Sequence[int]) -> int:
    """Tokens in the fullest row."""
    return max((sum(lengths[i] for i in row) for row in layout), default=1)


def balanced_slots(
    layout: Layout, lengths: Sequence[int], micro_batches: int, per_micro: int
) -> Layout:
    """``layout``'s rows placed in ``micro_batches * per_micro`` slots (micro-batch after
    micro-batch; empty slots are padding rows) so that the micro-batches' token counts are
    balanced: rows, fullest first, dealt to the micro-batches in snake order."""
    if len(layout) > micro_batches * per_micro:
        raise ValueError(f"{len(layout)} rows do not fit {micro_batches} x {per_micro} slots")
    order = sorted(range(len(layout)), key=lambda r: -sum(lengths[i] for i in layout[r]))
    slots: list[list[list[int]]] = [[] for _ in range(micro_batches)]
    for k, r in enumerate(order):
        lap, j = divmod(k, micro_batches)
        slots[j if lap % 2 == 0 else micro_batches - 1 - j].append(layout[r])
    out: Layout = []
    for micro in slots:
        out += micro + [[] for _ in range(per_micro - len(micro))]
    return out


def make_batch(
    trajectories: Sequence[TrainSequence],
    bucket: int,
    rows: int | None = None,
    longest: int | None = None,
    layout: Layout | None = None,
    first_sequence: int = 0,
    window: int | None = None,
) -> TrainBatch:
    """The sequences as a `TrainBatch`: row ``r`` holds the sequences ``layout[r]`` one
    after another (default `one_per_row`), then ``rows - len(layout)`` rows of padding (mask
    0; a batch can so be filled to a divisible size). Rows are ``padded_length(longest,
    bucket)`` long, ``longest`` defaulting to the fullest row's tokens (processes whose rows
    form one batch pass the largest of all). Sequence ``i`` is ``first_sequence + i``
    batch-wide (each process numbers its sequences in a range of its own). ``window``: a
    bound on the sequences' lengths for attention (default: the longest's, rounded up to
    `ATTN_BLOCK` * 2**k to bound compiles; processes pass the same value)."""
    layout = one_per_row(len(trajectories)) if layout is None else layout
    lengths = [sequence_length(t) for t in trajectories]
    B = len(layout) if rows is None else rows
    if len(layout) > B:
        raise ValueError(f"{len(layout)} rows of sequences do not fit {B} rows")
    own = row_fill(layout, lengths)
    if longest is not None and longest < own:
        raise ValueError(f"longest={longest} is shorter than a row of {own} tokens")
    T = padded_length(longest or own, bucket)
    tokens = np.zeros((B, T), np.int32)
    positions = np.zeros((B, T), np.int32)
    segment_ids = np.zeros((B, T), np.int32)
    sequence = np.zeros((B, T), np.int32)
    targets = np.zeros((B, T), np.int32)
    mask = np.zeros((B, T), np.float32)
    rollout_logp = np.zeros((B, T), np.float32)
    experts = batch_expert_ids(trajectories, B, T)
    for b, row in enumerate(layout):
        at = 0
        for segment, i in enumerate(row, 1):
            traj = trajectories[i]
            seq = np.asarray([*traj.prompt_ids, *traj.response_ids], np.int32)
            P, n = len(traj.prompt_ids), len(seq)
            span = slice(at, at + n)
            tokens[b, span] = seq
            positions[b, span] = np.arange(n)
            segment_ids[b, span] = segment
            sequence[b, span] = first_sequence + i
            targets[b, at : at + n - 1] = seq[1:]
            # response token i sits at sequence position P + i and is predicted from P + i - 1
            mask[b, at + P - 1 : at + n - 1] = traj.loss_mask
            rollout_logp[b, at + P - 1 : at + n - 1] = traj.rollout_logprobs
            if experts is not None and traj.expert_ids is not None:
                experts[b, at + P - 1 : at + n - 1] = traj.expert_ids
            at += n
    if window is None:
        window = padded_length(longest_sequence(trajectories), ATTN_BLOCK)
    return TrainBatch(
        tokens,
        positions,
        segment_ids,
        sequence,
        targets,
        mask,
        rollout_logp,
        min(window, T),
        experts,
    )


def batch_expert_ids(trajectories: Sequence[TrainSequence], B: int, T: int) -> np.ndarray | None:
    """[B, T, sparse layers, k] of `NO_EXPERTS`, the dtype and sizes of the trajectories'
    expert ids, or None if none carries any. Raises ValueError naming a trajectory whose ids
    are not one row per response token of the same sparse layers and k as the others'."""
    carrying = [t for t in trajectories if t.expert_ids is not None]
    if not carrying:
        return None
    first = carrying[0].expert_ids
    assert first is not None
    for traj in carrying:
        ids = traj.expert_ids
        assert ids is not None
        want = (len(traj.response_ids), *first.shape[1:])
        if ids.ndim != 3 or ids.shape != want or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(
                f"trajectory {traj.uid!r}: expert_ids of shape {ids.shape} ({ids.dtype}); "
                f"expected ints of (response tokens, sparse layers, k) = {want}"
            )
    return np.full((B, T, *first.shape[1:]), NO_EXPERTS, first.dtype)


def mini_batch_layouts(
    lengths: Sequence[int], mini_batches: int, row_tokens: int | None
) -> list[Layout]:
    """The rows of each mini-batch: the sequences split into ``mini_batches`` consecutive
    chunks (sizes differing by one at most; a mini-batch is a set of sequences, as in verl),
    each packed into rows of ``row_tokens`` (`pack_rows`), or with None one per row."""
    chunks = np.array_split(np.arange(len(lengths)), mini_batches)
    layouts = []
    for chunk in chunks:
        ids = [int(i) for i in chunk]
        local = (
            one_per_row(len(ids))
            if row_tokens is None
            else pack_rows([lengths[i] for i in ids], row_tokens)
        )
        layouts.append([[ids[j] for j in row] for row in local])
    return layouts


def tree_layouts(
    seqs: Sequence[np.ndarray],
    experts: Sequence[np.ndarray | None],
    mini_batches: int,
    row_tokens: int,
) -> list[Layout]:
    """`mini_batch_layouts` for tree packing (`sequence_arrays`): each mini-batch's sequences
    grouped into runs sharing a prefix (`tree.units`) and the runs packed into rows
    (first-fit decreasing) by the positions their tree computes, at most ``row_tokens``."""
    layouts = []
    for chunk in np.array_split(np.arange(len(seqs)), mini_batches):
        runs, sizes = units(seqs, experts, [int(i) for i in chunk], row_tokens)
        layouts.append([[i for u in row for i in runs[u]] for row in pack_rows(sizes, row_tokens)])
    return layouts


def sequence_arrays(
    trajectories: Sequence[TrainSequence],
) -> tuple[list[np.ndarray], list[np.ndarray | None]]:
    """Each trajectory's tokens, and its experts at each position ([n, sparse layers, k],
    `NO_EXPERTS` off the sampled tokens; None for all if none carries any)."""
    seqs = [np.asarray([*t.prompt_ids, *t.response_ids], np.int32) for t in trajectories]
    carrying = batch_expert_ids(trajectories, 1, 1)
    experts: list[np.ndarray | None] = []
    for t, seq in zip(trajectories, seqs, strict=True):
        if carrying is None:
            experts.append(None)
            continue
        e = np.full((len(seq), *carrying.shape[2:]), NO_EXPERTS, carrying.dtype)
        if t.expert_ids is not None:
            e[len(t.prompt_ids) - 1 : len(seq) - 1] = t.expert_ids
        experts.append(e)
    return seqs, experts


@dataclasses.dataclass
class Sequences:
    """One process's per-sequence outcomes for a step, [S] each (padding sequences after the
    real ones: reward 0, a group of their own, mini-batch K)."""

    rewards: np.ndarray  # float32, the (shaped) outcome reward
    groups: np.ndarray  # int32, GRPO group (numbered from ``process_index * S``)
    weights: np.ndarray  # float32, the share of its episode a sequence is
    minis: np.ndarray  # int32, the mini-batch the sequence is trained in
    # float32, the step-level advantage of each (GiGPO, Tree-GRPO: rl/steps.py), or None
    step_advantages: np.ndarray | None = None


def sequence_outcomes(
    rewards: Sequence[float] | np.ndarray,
    group_ids: Sequence[str],
    weights: Sequence[float] | np.ndarray,
    layouts: Sequence[Layout],
    size: int,
    first: int = 0,
    step_advantages: Sequence[float] | np.ndarray | None = None,
) -> Sequences:
    """`Sequences` of ``size`` entries for the sequences of ``layouts``; group indices start at
    ``first`` (each process numbers its groups in a range of its own)."""
    n = len(rewards)
    if n > size:
        raise ValueError(f"{n} sequences do not fit {size}")
    names = {g: i + first for i, g in enumerate(dict.fromkeys(group_ids))}
    groups = np.full(size, len(names) + first, np.int32)
    groups[:n] = [names[g] for g in group_ids]
    padded = np.zeros(size, np.float32)
    padded[:n] = rewards
    w = np.ones(size, np.float32)
    w[:n] = weights
    minis = np.full(size, len(layouts), np.int32)
    for k, layout in enumerate(layouts):
        for row in layout:
            minis[row] = k
    steps = None
    if step_advantages is not None:
        steps = np.zeros(size, np.float32)
        steps[:n] = step_advantages
    return Sequences(padded, groups, w, minis, steps)


def pow2(n: int) -> int:
    """The smallest power of two >= n (>= 1): sizes that bound a step's compiles."""
    return 1 << max(n - 1, 0).bit_length()


def step_batch(
    trajectories: Sequence[TrainSequence],
    rewards: Sequence[float] | np.ndarray,
    group_ids: Sequence[str],
    weights: Sequence[float] | np.ndarray,
    *,
    mini_batches: int,
    row_tokens: int | None,
    bucket: int,
    rows_per_micro: int,
    min_sequences: int = 1,
    agree: Callable[[list[int]], list[int]] = lambda values: values,
    part: int = 0,
    tree: bool = False,
    step_advantages: Sequence[float] | np.ndarray | None = None,
) -> tuple[TrainBatch, Sequences, int]:
    """One process's share of an RL step's batch: each mini-batch's sequences packed into
    rows of ``row_tokens`` (None: one per row, padded to the longest rounded up to ``bucket *
    2**k``) and dealt to micro-batches of ``rows_per_micro`` rows; returns the rows
    (`TrainBatch` [K * cap * rows_per_micro, T]), the sequences' outcomes and the count of
    real micro-batches per mini-batch (of ``cap`` slots, a power of two).

    ``tree`` (with ``row_tokens``): rows hold sequences sharing a prefix (`tree_layouts`), at
    most ``row_tokens`` positions of their tree each; the batch carries the tree rows
    (`TrainBatch.tree`, as long as the fullest, rounded as rows are) and its own rows, as
    long as their sequences laid out one after another need, are where the losses are taken.

    ``agree``: the element-wise maximum of a list of sizes over every process (identity for
    one); every process then lays out the same shapes. ``part``: this process's index (its
    sequences are numbered from ``part * S``, S the agreed sequence slots, at least
    ``min_sequences``). ``step_advantages``: each sequence's step-level advantage (GiGPO,
    Tree-GRPO), carried in the outcomes."""
    lengths = [sequence_length(t) for t in trajectories]
    longest, most = agree([longest_sequence(trajectories), len(trajectories)])
    # a trajectory longer than row_tokens makes the step's rows the bucket holding it, and
    # the others are packed into rows that long too (as full as rows of row_tokens)
    row_length = None if row_tokens is None else padded_length(longest, row_tokens)
    if tree and row_length is not None:
        seqs, experts = sequence_arrays(trajectories)
        layouts = tree_layouts(seqs, experts, mini_batches, row_length)
    else:
        layouts = mini_batch_layouts(lengths, mini_batches, row_length)
    most_rows, fill = agree(
        [max(len(x) for x in layouts), max(row_fill(x, lengths) for x in layouts)]
    )
    real = max(1, -(-most_rows // rows_per_micro))
    cap = pow2(real)
    size = pow2(max(most, min_sequences))
    slots = [
        row
        for x in layouts
        for row in balanced_slots(x, lengths, real, rows_per_micro)
        + [[]] * ((cap - real) * rows_per_micro)
    ]
    batch = make_batch(
        trajectories,
        row_tokens or bucket,
        rows=len(slots),
        longest=fill,
        layout=slots,
        first_sequence=part * size,
        window=padded_length(longest, ATTN_BLOCK),
    )
    if tree and row_length is not None:  # the tree rows of the same layout
        rows = tree_rows(seqs, experts, slots, batch.shape[1])
        (positions,) = agree([rows.shape[1]])
        batch = dataclasses.replace(
            batch, tree=widened(rows, padded_length(positions, row_tokens or bucket))
        )
    outcomes = sequence_outcomes(
        rewards,
        group_ids,
        weights,
        layouts,
        size,
        first=part * size,
        step_advantages=step_advantages,
    )
    return batch, outcomes, real
