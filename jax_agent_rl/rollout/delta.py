"""Delta weight pushes: after an update, send the serving weights that changed, not all of them.

At RL learning rates most weights, rounded to the serving dtype (bf16), come out of a step
bit for bit as they went in. `DeltaPusher` keeps the last weights it pushed, in the engine's
serving layout (`Policy.serving_layout`: one more copy of the served weights on the learner's
devices, on one of them: `_on_one_device`), and sends a `WeightDelta` in place of the next
ones: for each serving leaf that changed, its changed elements (int32 flat indices and their
values), its changed blocks of `BLOCK` consecutive elements (block indices and the blocks), or
a bit per element saying which changed and the changed values in order, whichever is fewer
bytes, or the whole leaf when that is fewer still; a leaf that did not change is not sent.
Index and value lists are padded to a power of two (`bucket`, so that the programs that make
and apply them compile a bounded number of times; the padding is counted in the bytes sent);
a pad repeats an entry.

A push is whole (the declared weights, as without deltas) when it is the first, every
``full_every``-th push (``engine.push.full_every``), or when the delta would be no smaller.

"Changed" compares bit patterns (``-0.0`` and ``0.0`` differ), so a delta applied in place
(`apply_delta`: each leaf's elements set by a scatter into its own buffer) leaves the engine's
weights bitwise those of the whole push it replaces, the learner's cast to the serving dtype.
A delta names the version it applies on (``base``): an engine serving another refuses it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_agent_rl.cluster import device_turns
from jax_agent_rl.models import ModelConfig, Policy
from jax_agent_rl.models.lora import LayerAdapters
from jax_agent_rl.models.policy import policy_of
from jax_agent_rl.protocol import RolloutBackend

BLOCK = 64  # elements of one block of a blocks-encoded leaf
INDEX_BYTES = 4  # int32 indices

LeafKind = Literal["elements", "blocks", "mask", "whole"]


@dataclasses.dataclass(frozen=True)
class LeafDelta:
    """One serving leaf's change: ``elements`` (``index`` [n] flat indices, ``values`` [n]),
    ``blocks`` (``index`` [n] block numbers, ``values`` [n, BLOCK]; the last block's elements
    past the leaf's end are dropped), ``mask`` (``index`` the changed elements' bits, packed
    [ceil(size / 8)] uint8; ``values`` [>= changed] theirs in flat order) or ``whole``
    (``values`` the new leaf, ``index`` None)."""

    kind: LeafKind
    shape: tuple[int, ...]
    dtype: Any
    index: Any
    values: Any

    @property
    def nbytes(self) -> int:
        return int(self.values.nbytes) + (0 if self.index is None else int(self.index.nbytes))


@dataclasses.dataclass(frozen=True)
class WeightDelta:
    """The change from the weights served as version ``base`` to the next ones: one entry per
    leaf of the serving layout (``treedef``), None where the leaf did not change."""

    base: int
    treedef: Any
    leaves: tuple[LeafDelta | None, ...]

    @property
    def nbytes(self) -> int:
        return sum(d.nbytes for d in self.leaves if d is not None)


def on_host(delta: WeightDelta) -> WeightDelta:
    """``delta`` with its indices and values copied to host memory (numpy): what travels to
    another process or node (a Ray replica applies it as it is)."""
    leaves = [None if d is None else (d.index, d.values) for d in delta.leaves]
    host = jax.device_get(leaves)
    return dataclasses.replace(
        delta,
        leaves=tuple(
            None if d is None else dataclasses.replace(d, index=h[0], values=h[1])
            for d, h in zip(delta.leaves, host, strict=True)
        ),
    )


def push_bytes(params: Any) -> int:
    """The bytes a push of ``params`` (whole weights, adapters or a `WeightDelta`) moves."""
    if isinstance(params, WeightDelta):
        return params.nbytes
    return sum(int(x.nbytes) for x in jax.tree.leaves(params))


def bucket(n: int) -> int:
    """The padded length of ``n`` >= 1 indices: the next power of two (a leaf's programs then
    compile once per octave of its change count, not once per count)."""
    return 1 << (n - 1).bit_length()


def _bits(x: jax.Array) -> jax.Array:
    """``x``'s bit patterns (unsigned ints of its width); non-float arrays as they are."""
    if not jnp.issubdtype(x.dtype, jnp.floating):
        return x
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]
    return jax.lax.bitcast_convert_type(x, unsigned)


def _changed(old: jax.Array, new: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Flat masks of ``new``'s changed elements [n] and changed blocks [ceil(n / BLOCK)]."""
    flat = (_bits(old) != _bits(new)).reshape(-1)
    blocks = jnp.pad(flat, (0, -flat.size % BLOCK)).reshape(-1, BLOCK).any(axis=1)
    return flat, blocks


@jax.jit
def _counts(old: list[jax.Array], new: list[jax.Array]) -> list[tuple[jax.Array, jax.Array]]:
    """Per leaf: how many elements and how many blocks changed."""
    out = []
    for o, n in zip(old, new, strict=True):
        flat, blocks = _changed(o, n)
        out.append((flat.sum(dtype=jnp.int32), blocks.sum(dtype=jnp.int32)))
    return out


def _first_true(mask: jax.Array, size: int) -> jax.Array:
    """The indices [size] of ``mask``'s true entries, padded by repeating the first."""
    (idx,) = jnp.nonzero(mask, size=size, fill_value=-1)
    return jnp.where(idx < 0, idx[0], idx).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("size",))
def _elements(old: jax.Array, new: jax.Array, size: int) -> tuple[jax.Array, jax.Array]:
    idx = _first_true(_changed(old, new)[0], size)
    return idx, new.reshape(-1)[idx]


@functools.partial(jax.jit, static_argnames=("size",))
def _blocks(old: jax.Array, new: jax.Array, size: int) -> tuple[jax.Array, jax.Array]:
    idx = _first_true(_changed(old, new)[1], size)
    flat = new.reshape(-1)
    return idx, jnp.pad(flat, (0, -flat.size % BLOCK)).reshape(-1, BLOCK)[idx]


def _on_one_device(x: jax.Array) -> jax.Array:
    """``x`` whole on the first of its devices: the programs that compare and encode then run
    no collectives (programs of collectives launched back to back can deadlock XLA's CPU
    runtime: `device_turns`). The kept base then sits on that device, a copy of the served
    weights; encoding each shard where it lives is what a learner over many chips wants."""
    first = min(x.devices(), key=lambda d: d.id)
    return (
        x if len(x.devices()) == 1 else jax.device_put(x, jax.sharding.SingleDeviceSharding(first))
    )


@functools.partial(jax.jit, static_argnames=("size",))
def _masked(old: jax.Array, new: jax.Array, size: int) -> tuple[jax.Array, jax.Array]:
    flat = _changed(old, new)[0]
    return jnp.packbits(flat), new.reshape(-1)[_first_true(flat, size)]


def encode_leaf(old: jax.Array, new: jax.Array, changed: int, blocks: int) -> LeafDelta | None:
    """The fewest-bytes encoding of ``new`` against ``old`` (``changed`` elements and
    ``blocks`` blocks differ: `_counts`); None if nothing changed."""
    if changed == 0:
        return None
    item = new.dtype.itemsize
    sizes: dict[LeafKind, int] = {
        "elements": bucket(changed) * (INDEX_BYTES + item),
        "blocks": bucket(blocks) * (INDEX_BYTES + BLOCK * item),
        "mask": -(-new.size // 8) + bucket(changed) * item,
        "whole": new.size * item,
    }
    kind = min(sizes, key=sizes.__getitem__)
    shape, dtype = tuple(new.shape), new.dtype
    if kind == "whole":
        return LeafDelta("whole", shape, dtype, None, new)
    encode = {"elements": _elements, "blocks": _blocks, "mask": _masked}[kind]
    idx, values = encode(old, new, size=bucket(blocks if kind == "blocks" else changed))
    return LeafDelta(kind, shape, dtype, idx, values)


def _replicated_like(x: Any, leaf: jax.Array) -> jax.Array:
    """``x`` on ``leaf``'s devices, whole on each (a delta's indices and values)."""
    sharding = leaf.sharding
    if isinstance(sharding, NamedSharding):
        sharding = NamedSharding(sharding.mesh, P())
    return jax.device_put(x, sharding)


@functools.partial(jax.jit, static_argnames=("block",), donate_argnums=(0,))
def _scatter(leaf: jax.Array, idx: jax.Array, values: jax.Array, block: int) -> jax.Array:
    """``leaf`` with the flat elements ``idx`` (``block`` > 1: the blocks ``idx`` of ``block``
    elements) set to ``values``, in its own buffer. Multi-dimensional indices (no reshape of
    ``leaf``, so a sharded leaf stays sharded); an element past the end (a last block's tail)
    has a leading index past the first axis, and is dropped."""
    if block > 1:
        idx = (idx[:, None] * block + jnp.arange(block, dtype=jnp.int32)).reshape(-1)
        values = values.reshape(-1)
    coords = []
    for stride in np.cumprod((*leaf.shape[1:], 1)[::-1])[::-1]:
        coords.append(idx // int(stride))
        idx = idx % int(stride)
    return leaf.at[tuple(coords)].set(values, mode="drop")


@functools.partial(jax.jit, static_argnames=("count", "size"))
def _mask_indices(bits: jax.Array, count: int, size: int) -> jax.Array:
    """The flat indices [size] a ``mask`` leaf's packed ``bits`` set (of ``count`` elements),
    padded as `_masked` pads its values."""
    return _first_true(jnp.unpackbits(bits, count=count).astype(bool), size)


def apply_delta(served: Any, delta: WeightDelta, version: int) -> Any:
    """``served`` (an engine's weights, in its serving layout, serving ``version``) with
    ``delta`` applied, each changed leaf in place (its buffer donated: ``served`` is not to be
    read after). Everything is checked before any leaf is touched: a `ValueError` names a
    delta on another version or a leaf of another shape or dtype, and ``served`` is intact."""
    if delta.base != version:
        raise ValueError(
            f"a delta push on weight version {delta.base} to an engine serving version "
            f"{version}: push the whole weights"
        )
    leaves, treedef = jax.tree.flatten(served)
    if treedef != delta.treedef:
        raise ValueError(f"a delta push of tree {delta.treedef} to an engine serving {treedef}")
    for i, (leaf, d) in enumerate(zip(leaves, delta.leaves, strict=True)):
        if d is not None and (d.shape != tuple(leaf.shape) or d.dtype != leaf.dtype):
            raise ValueError(
                f"a delta push's leaf {i} is {d.dtype}{list(d.shape)}; the engine serves "
                f"{leaf.dtype}{list(leaf.shape)} there"
            )
    out = []
    for leaf, d in zip(leaves, delta.leaves, strict=True):
        if d is None:
            out.append(leaf)
        elif d.kind == "whole":
            out.append(jax.device_put(d.values, leaf.sharding))
        elif d.kind == "mask":  # set through the indices its bits name
            bits, values = (_replicated_like(x, leaf) for x in (d.index, d.values))
            idx = _mask_indices(bits, count=leaf.size, size=values.shape[0])
            out.append(_scatter(leaf, idx, values, block=1))
        else:
            idx, values = (_replicated_like(x, leaf) for x in (d.index, d.values))
            out.append(_scatter(leaf, idx, values, block=BLOCK if d.kind == "blocks" else 1))
    return jax.tree.unflatten(treedef, out)


class DeltaPusher:
    """Pushes a run's weights to its rollout backend, as deltas where the backend takes them
    (`Capabilities.delta_push`; module docstring). ``full_every``: a whole push every this many
    pushes (1: every push whole). Keeps the last pushed weights in ``model``'s serving layout
    (a policy's, or a bare config's decoder family's)."""

    def __init__(self, model: ModelConfig | Policy, full_every: int) -> None:
        if full_every < 1:
            raise ValueError(f"full_every={full_every}: a whole push every N >= 1 pushes")
        self.full_every = full_every
        self._layout = jax.jit(policy_of(model).serving_layout)
        self._base: tuple[int, list[jax.Array]] | None = None  # (version, serving leaves)
        self._since_full = 0
        self.last: Any = None  # what the last push sent (`push_bytes` measures it)

    def encode(self, params: Any) -> tuple[Any, list[jax.Array] | None]:
        """What a push of ``params`` sends (``params`` itself or a `WeightDelta`), and the
        serving leaves to keep as the next base (None: keep none, adapters are pushed whole)."""
        if isinstance(params, LayerAdapters) or self.full_every == 1:
            return params, None
        leaves, treedef = jax.tree.flatten(self._layout(params))
        new = [_on_one_device(x) for x in leaves]
        if self._base is None or self._since_full + 1 >= self.full_every:
            return params, new
        version, old = self._base
        counts = jax.device_get(_counts(old, new))
        delta = WeightDelta(
            version,
            treedef,
            tuple(
                encode_leaf(o, n, int(c), int(b))
                for o, n, (c, b) in zip(old, new, counts, strict=True)
            ),
        )
        if delta.nbytes >= push_bytes(params):
            return params, new
        return delta, new

    def _encode_on_turn(self, params: Any) -> tuple[Any, list[jax.Array] | None]:
        with device_turns.TURN:  # the devices may be shared with an engine's thread
            sent, base = self.encode(params)
            made = (
                [(d.index, d.values) for d in sent.leaves if d is not None]
                if isinstance(sent, WeightDelta)
                else sent
            )
            jax.block_until_ready((base, made))
            return sent, base

    async def push(self, backend: RolloutBackend, params: Any, version: int) -> None:
        """Pushes ``params`` (the whole trained weights, as `Learner.pushed_params` makes them)
        to ``backend`` as ``version``: whole or a delta on the last push. The base moves only
        once the backend took it (a failed push leaves the next one whole)."""
        sent, base = await asyncio.to_thread(self._encode_on_turn, params)
        self.last, self._base = sent, None
        await backend.update_weights(sent, version)
        self.took(sent, base, version)

    def took(self, sent: Any, base: list[jax.Array] | None, version: int) -> None:
        """Records that the backend serves ``sent`` (`encode`'s, with its ``base``) as
        ``version``: the next delta is on it."""
        self._base = None if base is None else (version, base)
        self._since_full = self._since_full + 1 if isinstance(sent, WeightDelta) else 0


def refuse_delta(params: Any, where: str) -> None:
    """A `ValueError` if ``params`` is a `WeightDelta`, for ``where``: a backend that takes
    whole weights only (`Capabilities.delta_push` false)."""
    if isinstance(params, WeightDelta):
        raise ValueError(
            f"a delta push (WeightDelta) to {where}, which takes whole weights only "
            "(Capabilities.delta_push is false): push the whole weights"
        )
