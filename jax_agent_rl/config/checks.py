"""The checks every command runs on a loaded config: each number against the range declared on
its field, then the values that must fit each other, and the names of registries that import
without JAX (the tool-call parser), so that ``jarl eval`` refuses them before it loads weights.
Names checked against the other registries (backends, filters, rewards) are left to
``jarl train``'s pre-run check (`jax_agent_rl.train.check`), which loads what they name."""

from __future__ import annotations

import dataclasses
import functools
import re
import string
import typing
from collections.abc import Callable, Mapping
from typing import Any

from jax_agent_rl.config.model import EXACT_ROWS, lora_targets_problem
from jax_agent_rl.config.ranges import Rule, finite_number
from jax_agent_rl.config.sections import AlgorithmSection, JarlConfig
from jax_agent_rl.tokenization.tool_calls import PARSERS


def field_ranges(schema: type, prefix: str = "") -> dict[str, Rule]:
    """The dotted key of every field of ``schema`` (nested sections included) that declares
    its range, in declaration order, with that range."""
    ranges: dict[str, Rule] = {}
    hints = typing.get_type_hints(schema)
    for field in dataclasses.fields(schema):
        if dataclasses.is_dataclass(hints[field.name]):
            ranges |= field_ranges(hints[field.name], f"{prefix}{field.name}.")
        elif "range" in field.metadata:
            ranges[f"{prefix}{field.name}"] = field.metadata["range"]
    return ranges


def moved_keys(schema: type, prefix: str = "") -> dict[str, str]:
    """Old dotted key -> new dotted key of every field of ``schema`` that says where it was
    (nested sections included: a moved section's old key maps to its new one)."""
    moved: dict[str, str] = {}
    hints = typing.get_type_hints(schema)
    for field in dataclasses.fields(schema):
        new = f"{prefix}{field.name}"
        moved |= dict.fromkeys(field.metadata.get("was", ()), new)
        if dataclasses.is_dataclass(hints[field.name]):
            moved |= moved_keys(hints[field.name], f"{new}.")
    return moved


def moved_to(key: str, moved: dict[str, str]) -> str | None:
    """The new key of ``key`` (dotted) if it moved: itself in ``moved``, else the key under the
    new key of the longest moved section holding it; None if it did not move."""
    parts = key.split(".")
    for i in range(len(parts), 0, -1):
        new = moved.get(".".join(parts[:i]))
        if new is not None:
            return ".".join([new, *parts[i:]])
    return None


def check_ranges(cfg: JarlConfig) -> list[str]:
    """Every value outside its field's range, one line each; when all are in range, every
    value that does not fit another (`_FIT_CHECKS`)."""
    problems = []
    sections: list[tuple[str, Any]] = [("", cfg)]  # (and each policies.<name> entry's fields)
    sections += [(f"policies.{name}.", policy) for name, policy in cfg.policies.items()]
    for prefix, section in sections:
        problems += _out_of_range(prefix, section)
    if problems:
        return problems
    return [p for check in _FIT_CHECKS if (p := check(cfg)) is not None]


def _out_of_range(prefix: str, section: Any) -> list[str]:
    """Each value of ``section`` (a dataclass, its key ``prefix``) outside its field's range."""
    problems = []
    for field, rule in field_ranges(type(section)).items():
        key, value = prefix + field, functools.reduce(getattr, field.split("."), section)
        if not rule.ok(value):
            # an int past a float's range, or a float's inf or nan, is out of every range: say
            # so (a 310-digit count was told "expected >= 0")
            finite = "" if finite_number(value) else "a finite number "
            text = repr(value)
            shown = text if len(text) <= 40 else f"{text[:20]}... ({len(text)} digits)"
            problems.append(f"{key}={shown}: expected {finite}{rule.accepted}")
    return problems


def _micro_batch_over_mesh(cfg: JarlConfig) -> str | None:
    """Packing off, an RL micro-batch is ``learner.micro_batch_size`` rows split over the
    data-parallel devices; packing on, it is one row per such device whatever that setting
    (`train.learners.micro_batch_rows`), which then sizes SFT micro-batches only (`_sft_batch`)."""
    dp, micro = cfg.mesh.data * cfg.mesh.fsdp, cfg.learner.micro_batch_size
    if not cfg.learner.packing and micro % dp:
        return (
            f"learner.micro_batch_size={micro} does not split over mesh.data x mesh.fsdp = {dp} "
            f"devices: use a multiple of {dp}"
        )
    return None


def _sft_batch(cfg: JarlConfig) -> str | None:
    """SFT batches are split into micro-batches of min(sft.batch_size, micro_batch_size) rows."""
    if not cfg.sft.data or not cfg.sft.steps:
        return None
    dp, micro, batch = (
        cfg.mesh.data * cfg.mesh.fsdp,
        cfg.learner.micro_batch_size,
        cfg.sft.batch_size,
    )
    if batch % min(batch, micro) or min(batch, micro) % dp:
        return (
            f"sft.batch_size={batch} does not split into micro-batches of "
            f"learner.micro_batch_size={micro} over mesh.data x mesh.fsdp = {dp} devices: use a "
            f"multiple of {micro}, or a multiple of {dp} below {micro}"
        )
    return None


def _group_size(cfg: JarlConfig) -> str | None:
    if cfg.algorithm.adv_estimator != "gae" and cfg.group.n == 1:
        return (
            "group.n=1: a GRPO group of one sample has zero advantage, nothing is learned; "
            "use group.n >= 2 (or algorithm.adv_estimator=gae)"
        )
    return None


# which keys each policy loss / rollout mask reads: a key changed from its default under a
# choice that does not read it would be a value accepted and dropped
_LOSS_KEYS = {
    "clip_low": ("ppo",),
    "clip_high": ("ppo",),
    "clip_c": ("ppo", "dppo_tv", "dppo_kl"),
    "cispo_clip_low": ("cispo",),
    "cispo_clip_high": ("cispo",),
    "dppo_delta_low": ("dppo_tv", "dppo_kl"),
    "dppo_delta_high": ("dppo_tv", "dppo_kl"),
}
_MASK_KEYS = {
    "icepop_low": ("icepop",),
    "icepop_high": ("icepop",),
    "kpop_threshold": ("kpop",),
    "geo_mask_low": ("geometric",),
    "geo_mask_high": ("geometric",),
}


_ADV_KEYS = {
    "step_adv_coef": ("gigpo", "tree_grpo"),
    "gigpo_gamma": ("gigpo",),
}


def _loss_keys(cfg: JarlConfig) -> str | None:
    a, default = cfg.algorithm, AlgorithmSection()
    choices = (
        ("policy_loss", _LOSS_KEYS),
        ("rollout_mask", _MASK_KEYS),
        ("adv_estimator", _ADV_KEYS),
    )
    for choice, table in choices:
        chosen = getattr(a, choice)
        for key, readers in table.items():
            if getattr(a, key) != getattr(default, key) and chosen not in readers:
                return (
                    f"algorithm.{key}={getattr(a, key)} has no effect with algorithm.{choice}="
                    f"{chosen}: it is read by {choice}={' / '.join(readers)}"
                )
    return None


def _step_credit(cfg: JarlConfig) -> str | None:
    a = cfg.algorithm
    if a.adv_estimator in ("gigpo", "tree_grpo") and a.turn_mode != "per_turn":
        return (
            f"algorithm.adv_estimator={a.adv_estimator} gives each turn its own advantage: it "
            "needs algorithm.turn_mode=per_turn (one training row per model turn)"
        )
    return None


def _rollout_mask(cfg: JarlConfig) -> str | None:
    a = cfg.algorithm
    if a.rollout_mask in ("icepop", "kpop") and a.tis_cap is not None:
        return (
            f"algorithm.rollout_mask={a.rollout_mask} weights each kept token by its ratio "
            f"itself; algorithm.tis_cap={a.tis_cap} would truncate that weight: set "
            "algorithm.tis_cap=null"
        )
    for name, lo, hi in (
        ("icepop", a.icepop_low, a.icepop_high),
        ("geo_mask", a.geo_mask_low, a.geo_mask_high),
    ):
        if not lo <= 1.0 <= hi:
            return (
                f"algorithm.{name}_low={lo}, algorithm.{name}_high={hi}: the band must hold 1 "
                "(a sampler that agrees with the learner), low <= 1 <= high"
            )
    return None


def _overlong_buffer(cfg: JarlConfig) -> str | None:
    buffer, budget = cfg.data.overlong_buffer, cfg.agent.max_response_tokens
    if buffer > budget:
        return (
            f"data.overlong_buffer={buffer} is longer than agent.max_response_tokens="
            f"{budget}: use 0 (off) to {budget}"
        )
    return None


def _slots_over_mesh(cfg: JarlConfig) -> str | None:
    """The embedded engine serves on the inference mesh: slots split over data x fsdp, and a
    step's rows on each shard hold every slot of the shard."""
    dp, slots = cfg.mesh.data * cfg.mesh.fsdp, cfg.engine.max_concurrent
    if cfg.engine.backend != "embedded":
        return None
    if slots % dp:
        return (
            f"engine.max_concurrent={slots} does not split over mesh.data x mesh.fsdp = {dp} "
            f"devices (the embedded engine's decode slots): use a multiple of {dp}"
        )
    if cfg.engine.max_step_tokens < slots // dp:
        return (
            f"engine.max_step_tokens={cfg.engine.max_step_tokens} is fewer than the "
            f"{slots // dp} decode slots of a shard (engine.max_concurrent={slots} over "
            f"{dp}): an engine step computes every one of them; use at least {slots // dp}"
        )
    return None


def _vllm_devices(cfg: JarlConfig) -> str | None:
    vllm = cfg.engine.vllm
    devices = [d for d in vllm.devices.split(",") if d]
    tp = vllm.tensor_parallel_size
    if cfg.engine.backend == "vllm" and devices and len(devices) != vllm.replicas * tp:
        return (
            f"engine.vllm.devices={vllm.devices!r} names {len(devices)} devices for "
            f"engine.vllm.replicas={vllm.replicas} of engine.vllm.tensor_parallel_size={tp}: "
            f"give {tp} per replica, or none"
        )
    return None


def _tool_servers(cfg: JarlConfig) -> str | None:
    ray = cfg.engine.ray
    if ray.tool_servers and not ray.address:
        return f"engine.ray.tool_servers={ray.tool_servers} needs engine.ray.address (a cluster)"
    if ray.tool_servers and cfg.tools.server_url:
        return (
            f"engine.ray.tool_servers={ray.tool_servers} and tools.server_url="
            f"{cfg.tools.server_url!r} both say where tools run: set one"
        )
    return None


def _judge(cfg: JarlConfig) -> str | None:
    j = cfg.data.judge
    if j.backend != "policy" and not j.model_path:
        return f"data.judge.backend={j.backend!r} (a separate judge) needs data.judge.model_path"
    if j.backend == "policy" and j.model_path:
        return (
            f"data.judge.model_path={j.model_path!r} is read only by a separate judge: set "
            "data.judge.backend to a rollout backend (embedded, ...), or clear the path"
        )
    if cfg.data.judged and cfg.data.success_reward <= j.fallback:
        return (  # the reward `rewards.JUDGE`: a failed judge call would count as a success
            f"data.success_reward={cfg.data.success_reward:g} is at most data.judge.fallback="
            f"{j.fallback:g}, the reward of a failed judge call (no score, an error, a timeout): "
            "every answer that broke the judge would count as a success; raise it"
        )
    return _judge_template(j.template)


def _stop_strings(cfg: JarlConfig) -> str | None:
    """An empty stop string is in every text: each turn would end at its first token (every
    backend refuses such a request, so the run would fail only once it sampled)."""
    if "" in cfg.agent.stop:
        return (
            f"agent.stop[{cfg.agent.stop.index('')}]='': an empty stop string would end every "
            "turn at its first token; drop it"
        )
    return None


def _parser(cfg: JarlConfig) -> str | None:
    if cfg.agent.parser not in PARSERS:
        return (
            f"agent.parser={cfg.agent.parser!r} is not a registered tool-call parser: "
            f"use one of {sorted(PARSERS)}"
        )
    return None


_JUDGE_FIELDS = ("prompt", "response", "ground_truth", "score_max")
_JUDGE_NUMBER = re.compile(r"(\.\d)?[gfde]?")  # {score_max}'s formats: no width, no fill


def _judge_template(template: str) -> str | None:
    """A judge template that fills in whatever the answer: every placeholder one of
    ``_JUDGE_FIELDS``, ``{response}`` among them. (Filled in per answer, a template that does
    not fit would fail every judge call, each scored as the fallback: a run of zeros.)"""
    try:
        parts = [p for p in string.Formatter().parse(template) if p[1] is not None]
        template.format(prompt="", response="", ground_truth="", score_max=10.0)
    except (ValueError, KeyError, IndexError, AttributeError, TypeError) as e:
        return (
            f"data.judge.template cannot be filled in ({type(e).__name__}: {e}): its "
            f"placeholders are {{{'}, {'.join(_JUDGE_FIELDS)}}}, literal braces doubled"
        )
    fields = {name for _, name, _, _ in parts}
    for _, name, spec, conversion in parts:
        # a text's spec cuts it ({response:.10} drops the answer's end and its closing
        # delimiter) or pads it ({response:>2000000000}: 2 GB on every judge call)
        numeric = name == "score_max" and not conversion and _JUDGE_NUMBER.fullmatch(spec or "")
        if (spec or conversion) and not numeric:
            shown = "{" + str(name) + (f"!{conversion}" if conversion else "")
            shown += (f":{spec}" if spec else "") + "}"
            return (
                f"data.judge.template {shown} formats its text; write {{{name}}} as it is "
                "({score_max} alone may take a number's format such as :g or :.1f)"
            )
    if "response" not in fields:
        return "data.judge.template has no {response}: the judge would never see the answer"
    return None


def _keep_kv(cfg: JarlConfig) -> str | None:
    """Only the embedded engine keeps its KV over a push: every other backend (and the Ray
    pool in front of replicas) drains its requests before one."""
    r = cfg.engine
    if r.keep_kv_on_update and (r.backend != "embedded" or r.ray.address):
        where = f"engine.backend={r.backend}" + (" on Ray replicas" if r.ray.address else "")
        return (
            f"engine.keep_kv_on_update=true: {where} drains its requests before a weight push "
            "and keeps no KV over it; use engine.backend=embedded without engine.ray.address, "
            "or keep_kv_on_update=false"
        )
    return None


def _set_keys(refused: Mapping[str, object]) -> str:
    """``key=value, ...`` of the keys of ``refused`` whose values are set (truthy)."""
    return ", ".join(f"{k}={v}" for k, v in refused.items() if v)


def _exact_logprobs(cfg: JarlConfig) -> str | None:
    """Exact logprobs are the embedded engine's and the decoder's: what each other part would
    compute is not the learner's to the bit."""
    if not cfg.model.exact_logprobs:
        return None
    e = cfg.engine
    refused = {
        "engine.backend": "" if e.backend == "embedded" else e.backend,
        "engine.ray.address": e.ray.address,
        "engine.keep_kv_on_update": "true" if e.keep_kv_on_update else "",
        "model.module": cfg.model.module,
        "model.lora.rank": cfg.model.lora.rank,
    }
    if set_keys := _set_keys(refused):
        return (
            f"model.exact_logprobs=true with {set_keys}: exact logprobs are served "
            "by the embedded engine in this process, over tokens sampled "
            "under the weights they are trained with, for a checkpoint's dense decoder without "
            "adapters"
        )
    # the engine's floor of rows a program (`EXACT_ROWS`): decode slots of each data shard,
    # prefill chunks
    shards = cfg.mesh.data * cfg.mesh.fsdp
    short = {
        "engine.max_concurrent": (e.max_concurrent // shards, f" over {shards} data shards"),
        "engine.prefill_chunk": (e.prefill_chunk, ""),
        "engine.max_model_len": (e.max_model_len, ""),
    }
    for key, (rows, where) in short.items():
        if rows < EXACT_ROWS:
            value = getattr(e, key.split(".")[1])
            return (
                f"{key}={value}{where} gives {rows} rows a program: exact logprobs need at "
                f"least {EXACT_ROWS} (XLA:CPU sums fewer rows in another order; "
                "docs/algorithms.md, exact logprobs)"
            )
    return None


def _module(cfg: JarlConfig) -> str | None:
    """A custom policy (``model.module``) starts from its own init and runs on the embedded
    engine only: no HF checkpoint to load adapters onto, serve elsewhere or copy a critic of."""
    m = cfg.model
    if not m.module:
        return None
    if ":" not in m.module:
        return f"model.module={m.module!r}: expected path/to/file.py:function or module:function"
    devices = cfg.mesh.data * cfg.mesh.fsdp * cfg.mesh.tensor
    refused = {
        "model.lora.rank": m.lora.rank,
        "engine.backend": "" if cfg.engine.backend == "embedded" else cfg.engine.backend,
        "engine.ray.address": cfg.engine.ray.address,  # replicas would unpickle the module
        "algorithm.adv_estimator": "gae" if cfg.algorithm.adv_estimator == "gae" else "",
        # after an SFT warm start on a mesh of several devices, the first RL step left 2
        # devices waiting on different all-reduces (an XLA:CPU collective timeout), in one
        # process or resumed: cause not found; on one device SFT then RL trains
        "sft.steps": cfg.sft.steps if cfg.sft.data and cfg.sft.steps and devices > 1 else 0,
    }
    if set_keys := _set_keys(refused):
        return (
            f"model.module={m.module!r} (a custom policy) does not support {set_keys}: "
            "it trains with the embedded engine, without LoRA adapters, experts or a critic, "
            "and takes an SFT warm start on a mesh of one device (mesh.data=1, fsdp=1, tensor=1)"
        )
    return None


def _context(cfg: JarlConfig) -> str | None:
    c = cfg.agent.context
    if c.compact and c.compact >= cfg.engine.max_model_len:
        return (
            f"agent.context.compact={c.compact} is not below engine.max_model_len="
            f"{cfg.engine.max_model_len}: the context would end the episode before it compacts"
        )
    rewrites = c.compact or c.strip_thinking or cfg.agent.sub_agent_tool
    if rewrites and cfg.group.strategy == "tree":
        return (
            "agent.context.compact, agent.context.strip_thinking and agent.sub_agent_tool "
            "start new samples of a chain episode (tool_agent); group.strategy=tree branches "
            "episodes that only append"
        )
    return None


POLICY_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # a policy's run folder: RUN/policies/<name>


def _policies(cfg: JarlConfig) -> str | None:
    """Other policies (``policies.<name>``): a name a folder can have, a prompt that fills
    {question} and {answer} alone, what each one's own engine and learner were built and
    tested for (the embedded engine in this process, a checkpoint's dense decoder), GRPO
    groups of two verdicts or more, and warm-start batches that split as the run's."""
    for name, p in cfg.policies.items():
        key = f"policies.{name}"
        if not POLICY_NAME.fullmatch(name):
            return f"{key}: a policy's name is 1-64 letters, digits, '_' or '-' (its run folder)"
        refused = {
            "engine.backend": "" if cfg.engine.backend == "embedded" else cfg.engine.backend,
            "engine.ray.address": cfg.engine.ray.address,
            f"{key}.model.module": p.model.module,
            f"{key}.model.lora.rank": p.model.lora.rank,
            f"{key}.model.exact_logprobs": "true" if p.model.exact_logprobs else "",
        }
        if set_keys := _set_keys(refused):
            return (
                f"{key} with {set_keys}: another policy trains a checkpoint's dense decoder "
                "on its own embedded engine, in this process"
            )
        own_sft = dataclasses.replace(p.sft, data=p.sft.data or "made")  # (or made ones)
        problems = (
            _prompt_fields(key, p.prompt),
            _group_size(dataclasses.replace(cfg, group=dataclasses.replace(cfg.group, n=p.n))),
            _sft_batch(dataclasses.replace(cfg, sft=own_sft)),
        )
        for problem in problems:
            if problem is not None:  # (the run's keys, named as the policy's)
                named = problem.replace("group.n", f"{key}.n").replace("sft.", f"{key}.sft.")
                return named if named.startswith(key) else f"{key}: {named}"
    return None


MAX_VERDICT_PROMPT = 4096  # characters of a verifier's prompt, before it is filled


def _prompt_fields(key: str, prompt: str) -> str | None:
    """``prompt`` fills {question} and {answer} once each, as they are (a format spec, a
    field's attribute or a field repeated would run, or size a string, at every verdict)."""
    if len(prompt) > MAX_VERDICT_PROMPT:
        return f"{key}.prompt holds {len(prompt)} characters: at most {MAX_VERDICT_PROMPT}"
    try:
        parts = [(f, c, spec) for _, f, spec, c in string.Formatter().parse(prompt)]
    except ValueError as e:
        return f"{key}.prompt: {e} (write a literal brace twice: {{{{ }}}})"
    named = sorted(f for f, _, _ in parts if f is not None)
    plain = all(not c and not spec for f, c, spec in parts if f is not None)
    if named != ["answer", "question"] or not plain:
        return (
            f"{key}.prompt fills {named}: expected {{question}} and {{answer}}, once each "
            "and as they are (no conversion or format spec; a literal brace written twice)"
        )
    return None


_FIT_CHECKS: tuple[Callable[[JarlConfig], str | None], ...] = (
    _micro_batch_over_mesh,
    _slots_over_mesh,
    _sft_batch,
    _group_size,
    _overlong_buffer,
    _loss_keys,
    _step_credit,
    _rollout_mask,
    _vllm_devices,
    _tool_servers,
    _stop_strings,
    _parser,
    _judge,
    lambda cfg: lora_targets_problem(cfg.model.lora),
    _keep_kv,
    _exact_logprobs,
    _module,
    _context,
    _policies,
)
