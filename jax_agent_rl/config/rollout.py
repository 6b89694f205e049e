"""The rollout's sections: ``engine`` (the inference backend, its engine's memory and steps,
and each backend's own settings: ``ray``, ``vllm``, ``jetstream``), ``sampling`` (how tokens are
sampled) and ``group`` (a prompt's episodes: how many, chain or tree, which groups are kept, what
a failed episode gets)."""

from __future__ import annotations

import dataclasses
from typing import Literal

from jax_agent_rl.config.ranges import (
    COUNT,
    NATURAL,
    TIMEOUT,
    interval,
    moved_from,
    or_,
    setting,
)


@dataclasses.dataclass(frozen=True)
class RaySection:
    """Rollout replicas as Ray actors across a cluster (`jax_agent_rl.rollout.ray_pool`);
    off while ``address`` is empty. Each replica is one ``engine.backend`` engine, placed
    through a placement group of one bundle per replica."""

    # "": no Ray (the backend runs here); "auto": the cluster this machine belongs to;
    # "local": start a one-node cluster on this machine; else the head's HOST:PORT
    address: str = ""
    replicas: int = setting(2, COUNT)
    num_cpus: float = setting(1.0, NATURAL)  # per replica
    num_gpus: float = setting(0.0, NATURAL)  # per replica (a vLLM engine: its GPUs)
    resources: dict[str, float] = dataclasses.field(default_factory=dict)  # e.g. {TPU: 4}
    # how the replicas' bundles spread over the nodes (Ray's placement group strategies)
    strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "SPREAD"
    # per replica (and per tool server); one that dies more often stays down
    max_restarts: int = setting(3, NATURAL)
    # tool servers (`jarl serve-tools` of tools.config) as actors, spread over the nodes; the
    # rollout's tool calls go to them (a trajectory stays on one); 0: tools run in-process
    tool_servers: int = setting(0, NATURAL)
    tool_server_cpus: float = setting(1.0, NATURAL)  # per tool server
    # placing and starting the replicas (compiles included)
    start_timeout_s: float = setting(600.0, TIMEOUT)


@dataclasses.dataclass(frozen=True)
class VLLMSection:
    """The vllm backend's engines (``engine.backend=vllm``): vLLM processes under their own
    venv, the learner's weights pushed to them."""

    replicas: int = setting(1, COUNT, was="rollout.replicas")  # engine processes
    # the vLLM venv's interpreter; empty: the repo's .venv-vllm/bin/python
    python: str = setting("", was="rollout.vllm_python")
    # CUDA devices of the replicas, tensor_parallel_size each, in replica order ("2,3"); empty:
    # inherit
    devices: str = setting("", was="rollout.vllm_devices")
    # GPUs each engine shards the model over (vLLM's tensor_parallel_size)
    tensor_parallel_size: int = setting(1, COUNT)


@dataclasses.dataclass(frozen=True)
class JetStreamSection:
    """The jetstream backend's engine (``engine.backend=jetstream``): a JetStream server under
    its own venv."""

    # the JetStream venv's interpreter; empty: the repo's .venv-jetstream/bin/python
    python: str = setting("", was="rollout.jetstream_python")
    # TPU: the host's chips the server opens ("4,5,6,7", a rectangle of the host's grid); the
    # trainer opens the others, and each host of a slice runs its own server on these chips
    # (backends/jetstream/chips.py). On CPU the server then has this many devices. Empty: the
    # server shares the trainer's host without chips of its own (CPU only, one device)
    chips: str = ""


@dataclasses.dataclass(frozen=True)
class PushSection:
    """How the learner's weights reach the rollout backend after each update."""

    # > 1: after an update a push sends only the serving weights that changed since the last
    # push (their elements, blocks or a bit mask, whichever is fewer bytes: `rollout.delta`),
    # where the backend takes deltas (embedded, its Ray replicas; vllm writes the changed
    # elements into its kept weights file); every this many pushes (and when a delta would be
    # no smaller) the whole weights. 1 (the default): every push whole. One process only (a
    # multi-process run is refused). A delta keeps a copy of the served weights on one
    # device, which `jarl plan` does not count yet; it pays in bf16 at small learning rates
    # (a real demo run: 15.75x fewer bytes at lr 1e-6, 4.13x at 1e-5; docs/engine.md)
    full_every: int = setting(1, COUNT)
    # true: whole new weights are placed on the engine's devices (cast, laid out) while it
    # decodes under the old ones, then swapped in at the push (embedded engine): the push
    # stalls generation for the swap alone, and the engine holds its weights twice meanwhile
    # (`jarl plan` counts the copy). false: the old weights are dropped first and the new
    # ones placed in their stead (one copy; generation waits for the placing)
    staged: bool = True


@dataclasses.dataclass(frozen=True)
class EngineSection:
    """The inference backend, its engine's memory and steps, and each backend's own settings
    (``ray``, ``vllm``, ``jetstream``)."""

    backend: str = setting(
        "embedded",  # a registered backend: embedded, vllm, jetstream (rollout/registry.py)
        was="rollout.backend",
    )
    max_model_len: int = setting(1024, COUNT, was="rollout.max_model_len")  # prompt + response
    # sequences decoded together (engine slots)
    max_concurrent: int = setting(64, COUNT, was="rollout.max_concurrent")
    # The engine's settings below: a backend that cannot honour one refuses it when it is set
    # away from its default (`jarl train`'s pre-run check; rollout/registry.py `unhonoured`);
    # one a backend tunes itself (vllm: prefill_chunk, steps_per_call) is noted and left.
    # the KV cache is a pool of pages of this many positions, handed out by real length and
    # shared between sequences with a common prefix (vllm: its block_size, 8 to 128)
    page_size: int = setting(32, COUNT, was="rollout.page_size")
    # the pool's size in GiB (keys and values, all layers, over all the engine's devices; vllm:
    # each replica's); 0: enough for max_concurrent sequences of max_model_len (a dense cache's
    # memory)
    kv_cache_gib: float = setting(
        0.0, NATURAL, was=("rollout.kv_cache_gib", "rollout.vllm.kv_cache_mb")
    )
    # the most tokens of one prompt an engine call computes: a longer prompt goes on in the
    # next calls, beside the decoding rows (embedded; jetstream: its prefill call's chunk)
    prefill_chunk: int = setting(512, COUNT, was="rollout.prefill_chunk")
    # the tokens one engine step computes (embedded): every decoding slot's next token and
    # chunks of several prompts in one forward (at least max_concurrent over the data shards)
    max_step_tokens: int = setting(512, COUNT)
    # decode steps per engine call (embedded, jetstream)
    steps_per_call: int = setting(4, COUNT, was="rollout.steps_per_call")
    # a decode step computes only the slots in use (rounded up to a power of two); false:
    # always all max_concurrent, so that no number depends on how requests happened to share
    # a batch (XLA:CPU's matmuls round differently by row count; bitwise-reproducible runs,
    # slower when few slots are busy). jetstream always computes every slot, as false does;
    # vllm cannot honour false
    batch_buckets: bool = setting(True, was="rollout.batch_buckets")
    # a weight push keeps the KV of running requests and kept sessions (a trajectory's earlier
    # turns): they go on under the new weights over keys and values the old ones computed (no
    # drain, no prefill again); each sampled token records its weights' version and its KV's
    # oldest (staleness, the freshness rule and the logprob gap count the older one). Prefixes
    # shared between requests never cross versions either way. false: a push waits for
    # requests in flight, and no KV outlives the weights that computed it. The embedded engine
    # only (not on Ray replicas)
    keep_kv_on_update: bool = setting(False, was="rollout.keep_kv_on_update")
    # compile every serving program before the first rollout (each prefill bucket at each
    # number of pages it reads, a decode step at each batch bucket), so that no rollout stalls
    # on a compilation (a trace holds the GIL: every episode waits). false: each compiles when
    # first needed; a short run that reaches few of them starts sooner (embedded, jetstream;
    # vllm compiles at its own start)
    warmup: bool = True
    # an engine process that dies (vllm: each replica's; jetstream: the server) is started
    # again this many times, loads the newest weights and serves its requests in flight again
    # from their prompts (counted: rollout/replica_deaths, replica_restarts, requests_requeued);
    # past them it stays down and its requests end aborted. Ray replicas: engine.ray.max_restarts
    max_restarts: int = setting(3, NATURAL)
    ray: RaySection = dataclasses.field(
        default_factory=RaySection, metadata=moved_from("rollout.ray")
    )
    vllm: VLLMSection = dataclasses.field(
        default_factory=VLLMSection, metadata=moved_from("rollout.vllm")
    )
    jetstream: JetStreamSection = dataclasses.field(
        default_factory=JetStreamSection, metadata=moved_from("rollout.jetstream")
    )
    push: PushSection = dataclasses.field(default_factory=PushSection)


@dataclasses.dataclass(frozen=True)
class SamplingSection:
    """How the policy's tokens are sampled in rollouts."""

    temperature: float = setting(1.0, NATURAL, was="rollout.temperature")
    top_p: float = setting(1.0, interval(0, 1, lo_open=True), was="rollout.top_p")
    top_k: int = setting(-1, or_(-1, COUNT), was="rollout.top_k")  # -1: off


@dataclasses.dataclass(frozen=True)
class TreeSection:
    """A tree rollout's shape and per-prompt budget (group.strategy=tree; agent/tree.py)."""

    n_roots: int = setting(2, COUNT)  # episodes started per prompt
    # an episode that branches goes on as this many (itself and copies)
    branch: int = setting(2, COUNT)
    depth: int = setting(2, NATURAL)  # turn boundaries at which an episode branches, at most
    # per prompt, over the whole tree; 0: what group.n chain episodes could use at most
    # (n x agent.max_response_tokens model tokens, n x agent.max_turns tool calls)
    model_tokens: int = setting(0, NATURAL)
    tool_calls: int = setting(0, NATURAL)


@dataclasses.dataclass(frozen=True)
class GroupSection:
    """A prompt's group of episodes: how many, how they are sampled, which groups are kept, and
    what a failed episode gets."""

    n: int = setting(8, COUNT, was="rollout.n")  # samples per prompt (the GRPO group)
    # how a prompt's group is sampled: chain (n independent episodes) or tree (episodes
    # branching after tool observations, within a per-prompt budget: group.tree)
    strategy: Literal["chain", "tree"] = setting("chain", was="agent.strategy")
    tree: TreeSection = dataclasses.field(
        default_factory=TreeSection, metadata=moved_from("agent.tree")
    )
    # DAPO: drop groups whose rewards are all equal, refill
    dynamic_sampling: bool = setting(
        False, was=("rollout.dynamic_sampling", "algorithm.dynamic_sampling")
    )
    # extra rollouts of fresh prompts per step, at most
    max_refills: int = setting(3, NATURAL, was=("rollout.max_refills", "algorithm.max_refills"))
    # an episode whose tool service failed (stop reason tool_error: a dead tool server) is run
    # again from its prompt, up to this many times; 0: it stays failed (masked, counted)
    tool_failure_reruns: int = setting(1, NATURAL, was="rollout.tool_failure_reruns")
