"""Hostile config and checkpoint inputs: each is refused before anything runs with exactly one
line on stderr naming the key or the problem, and exit code 2; never a traceback, never
OmegaConf's or json's internals. Run through the command line's `main` in-process (one case in
a subprocess, to see what a user's terminal shows).

Also refused so: a config override OmegaConf's reader refuses though the check's parser took
it (a duplicate key, a recursive alias, a tag with no constructor, a lone surrogate's
``"\\ud83d"``), an override whose YAML tag the reader constructs but OmegaConf cannot hold as
a value (``model.path=!!timestamp 2001-12-14``, ``!!set {a}``, inside a list or a mapping
too), and an interpolation naming no key or itself (``data.reward=${foo}``, in an override or
in the file): ``jarl train`` ended in a YAML or OmegaConf traceback (36 lines, exit status 1).
Each is a `ConfigError` line naming the key.

A ``reasoning_gym:`` spec's option nested past the recursion limit is an error naming the spec
(``jarl train`` printed a RecursionError's traceback), and the bound on an option's size holds
for the numbers inside its lists and mappings too; an interaction config nested as deep is a
ConfigError.

Settings read by nothing, and keys that moved:

- ``jarl train CONFIG --dry-run key=value``: argparse ended the overrides at the flag and
  refused the rest as "unrecognized arguments"; key=value words after a flag are overrides.
- A setting of ``engine.vllm`` or ``engine.jetstream`` beside another ``engine.backend``, or
  of ``engine.ray`` (but tool_servers, refused) with ``engine.ray.address`` empty, was read by
  nothing, with no word (``engine.vllm.replicas=3`` or ``engine.ray.replicas=4``: one embedded
  engine ran here); the pre-run check notes each.
- A config's bare ``rollout:`` (every line under it commented out, ``rollout: {}``, or the
  override ``rollout=...``) was refused as an unknown key, naming none of the sections its
  keys moved to; it names engine, group and sampling now, as ``rollout.n`` names group.n.
- ``jarl eval RUN`` and ``jarl export RUN`` of a run made before that split refused its
  config.yaml's old key ("config key 'rollout.backend' is now 'engine.backend'") naming no
  file, where the user had named only the folder; a problem of the run's file names it (an
  override's does not). An interpolation of a moved key (``${rollout.temperature}``) said
  only that the key was not found; it names the key's new one."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from jax_agent_rl.cli import main
from jax_agent_rl.cli.commands import build_parser
from jax_agent_rl.compat.verl.interaction import load_interactions
from jax_agent_rl.config import (
    ConfigError,
    EngineSection,
    load_config,
    preview_config,
    to_yaml,
)
from jax_agent_rl.config.rollout import JetStreamSection, RaySection, VLLMSection
from jax_agent_rl.data import reasoning_gym
from jax_agent_rl.data.reasoning_gym import ReasoningGymError
from jax_agent_rl.models.hf_local import TINY
from jax_agent_rl.rollout.registry import unread_sections
from jax_agent_rl.train.check import check_run
from jax_agent_rl.train.evaluation import eval_target
from jax_agent_rl.train.export import export_run

DEEP = 200
# a billion strings from 9 lines of aliases, each list naming the one before ten times
ALIAS_BOMB = "env:\n  config:\n    x:\n      a0: &a0 [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"      a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]\n" for i in range(1, 9)
)


def _refused(argv: list[str], named: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert out == ""
    assert len(lines) == 1, err
    assert lines[0].startswith("jarl: ") and named in lines[0], lines[0]


# -- run configs: (YAML file contents or None, overrides, what the line names) -------------

CONFIGS = {
    "wrong type": (None, ["group.n=four"], "group.n='four': expected a whole number"),
    "float for int": (None, ["group.n=1.5"], "group.n='1.5': expected a whole number"),
    "bool": (None, ["trainer.resume=maybe"], "trainer.resume='maybe': expected true or false"),
    "enum": (None, ["algorithm.kl_kind=k9"], "algorithm.kl_kind='k9': expected one of ['k1'"),
    "optional number": (None, ["algorithm.clip_c=x"], "clip_c='x': expected a number or null"),
    "list for string": (None, ["model.path=[1,2]"], "model.path='[1, 2]': expected a string"),
    "list in a mapping": (
        None,
        ["data.rewards_by_source={a: [1]}"],
        "data.rewards_by_source.a='[1]': expected a string",
    ),
    # OmegaConf raised "Cannot merge incompatible container types", a traceback naming no key
    "mapping for a list": (None, ["agent.stop={a: 1}"], "agent.stop=\"{'a': 1}\": expected a list"),
    "mapping for a list in a file": (
        "agent:\n  stop: {a: 1}\n",
        [],
        "agent.stop=\"{'a': 1}\": expected a list",
    ),
    "list for a mapping": (None, ["env.classes=[1,2]"], "env.classes='[1, 2]': expected a mapping"),
    "scalar section": ("model: 5\n", [], "model='5': expected a section"),
    "scalar override of a section": (
        None,
        ["engine.ray=3"],
        "engine.ray='3': expected a section",
    ),
    "unknown key": (None, ["model.dtpye=float32"], "unknown config key 'model.dtpye'; allowed"),
    "unknown nested key": (f"{'a.' * 300}b: 1\n", [], "unknown config key"),
    "YAML syntax": ("model: [1\n", [], "invalid YAML at line 2, column 1"),
    "YAML tab indent": ("model:\n\tpath: x\n", [], "invalid YAML at line 2, column 1"),
    "override YAML syntax": (None, ["data.train=["], "override data.train: invalid YAML"),
    "top-level list": ("- model\n- data\n", [], "holds a list at its top level"),
    "top-level scalar": ("42\n", [], "holds a scalar at its top level"),
    "top-level null": ("~\n", [], "holds a scalar at its top level"),
    "two documents": ("a: 1\n---\nb: 2\n", [], "a second YAML document at line 2"),
    # past Python's int-from-text limit (YAML's loader raised a bare ValueError)
    "5000-digit override": (
        None,
        ["group.n=" + "9" * 5000],
        "override group.n: a whole number of 5000 digits: too long",
    ),
    "5000-digit verl override": (
        None,
        ["actor_rollout_ref.rollout.n=-" + "9" * 5000],
        "override actor_rollout_ref.rollout.n: a whole number of 5000 digits",
    ),
    "5000-digit value in a file": (
        "group:\n  n: " + "9" * 5000 + "\n",
        [],
        "a whole number of 5000 digits at line 2: too long",
    ),
    # an int past a float's range: the range check raised OverflowError (a traceback)
    "310-digit override": (
        None,
        ["trainer.steps=1" + "0" * 309],
        "trainer.steps=10000000000000000000... (310 digits): expected a finite number >= 0",
    ),
    "a float's inf": (None, ["optim.lr=1e309"], "optim.lr=inf: expected a finite number > 0"),
    # each value naming the one before 3,000 times: 9 million resolutions (OmegaConf resolves
    # each use anew), 13.8 s at 10^5 characters, past 100 s at 10^6
    "interpolation bomb": (
        f"model:\n  path: '{'${data.val}' * 3000}'\n"
        f"data:\n  train: t.jsonl\n  val: '{'${data.train}' * 3000}'\n",
        [],
        "model.path: its interpolations resolve to 63000000 characters in 9003001 resolutions",
    ),
    "duplicate key": ("model:\n  path: a\n  path: b\n", [], "found duplicate key path"),
    "binary garbage": (b"\x89PNG\r\n\x1a\n\x00\x00\xff\xd8", [], "is not UTF-8 text: byte 0x89"),
    "latin-1": ("model:\n  path: caf\xe9\n".encode("latin-1"), [], "byte 0xe9 at offset 18"),
    "NUL character": ("model:\n  path: a\x00b\n", [], "character '\\x00' at offset 16"),
    "deep block mapping": (
        "".join("  " * i + "a:\n" for i in range(DEEP)) + "  " * DEEP + "b: 1\n",
        [],
        "nested deeper than 32 levels at line 33",
    ),
    "deep flow list": ("a: " + "[" * DEEP + "]" * DEEP + "\n", [], "nested deeper than 32"),
    "deep override": (
        None,
        ["env.config.x=" + "{a: " * DEEP + "1" + "}" * DEEP],
        "override env.config.x: nested deeper than 32 levels",
    ),
    "deep override key": (None, ["a." * 3000 + "b=1"], "nested deeper than 32 levels"),
    "empty key part": (None, ["model..path=x"], "'model..path' is not a dotted key"),
    "empty key": (None, ["=x"], "'' is not a dotted key"),
    "alias bomb": (ALIAS_BOMB, [], "more than 10000 YAML nodes (keys and values, aliases"),
    # 6000 keys, no alias: told it was an alias bomb (OmegaConf's message)
    "many keys": (
        "env:\n  config:\n" + "".join(f"    k{i}: {i}\n" for i in range(6000)),
        [],
        "more than 10000 YAML nodes",
    ),
    # a resolver's fan-out escaped the bound on resolving (2.1 KB: past 90 s); resolver calls
    # nested 200 deep ran OmegaConf's grammar out of the stack (a RecursionError traceback)
    "select bomb": (
        "model:\n  path: '${oc.select:data.train,z}${oc.select:data.train,z}'\n",
        [],
        "'${oc.select:data.train,z}${oc.select:dat' at line 2: a config reads "
        "${section.key} and ${oc.env:NAME} (or ${oc.env:NAME,default}) interpolations only",
    ),
    "nested resolvers": (
        None,
        ["model.path=" + "${f:" * 200 + "x" + "}" * 200],
        "override model.path: '${f:${f:",
    ),
    "resolver in an env default": (None, ["model.path=${oc.env:NOPE,${data.train}}"], "only"),
    # 5.8 MB of 100k keys ran for minutes before any answer
    "a file past 1 MiB": ("# " + "x" * (1 << 20) + "\n", [], "bytes: a config is at most"),
    "an override past 1 MiB": (None, ["model.path=" + "x" * (1 << 20)], "at most 1048576"),
    "missing file": (None, [], "does not exist"),
    "out of range": (None, ["sampling.top_p=0"], "sampling.top_p=0.0: expected in (0, 1]"),
    # in every text: each turn would end at its first token (before: accepted, and every
    # request of the run refused once it sampled)
    "empty stop string": (None, ["agent.stop=[</search>, '']"], "agent.stop[1]='': an empty"),
}


@pytest.mark.parametrize("case", sorted(CONFIGS))
@pytest.mark.parametrize("command", ["config", "train"])
def test_a_bad_config_is_one_line(
    case: str, command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text, overrides, named = CONFIGS[case]
    config = tmp_path / "run.yaml"
    if isinstance(text, str):
        config.write_text(text)
    elif isinstance(text, bytes):
        config.write_bytes(text)
    elif case != "missing file":
        config.write_text("model:\n  path: /ckpt\ndata:\n  train: t.jsonl\n")
    argv = [command, str(config), *overrides]
    _refused(argv + (["--dry-run"] if command == "train" else []), named, capsys)


@pytest.mark.parametrize("default", [False, True], ids=["set", "default"])
def test_an_environment_variable_named_many_times_is_counted_at_its_size(
    default: bool, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: Any
) -> None:
    """``${oc.env:NAME}`` counted as its own 13 characters: a 100 kB variable named 100 times
    by a value that another value names 100 times took 5.7 GB and 34 s before a MemoryError."""
    big = "A" * 100_000
    if default:
        monkeypatch.delenv("JARL_TEST_BIG", raising=False)
        env = f"${{oc.env:JARL_TEST_BIG,{big}}}"
    else:
        monkeypatch.setenv("JARL_TEST_BIG", big)
        env = "${oc.env:JARL_TEST_BIG}"
    config = tmp_path / "run.yaml"
    config.write_text(
        f"model:\n  path: '{'${data.val}' * 100}'\n"
        f"data:\n  train: t.jsonl\n  val: '{env * (1 if default else 100)}'\n"
    )
    key = "model.path" if default else "data.val"  # (itself 10^7 characters, counted first)
    _refused(["config", str(config)], f"{key}: its interpolations resolve to 10000000 ", capsys)


def test_unset_required_keys_are_one_line_for_train(capsys: pytest.CaptureFixture[str]) -> None:
    root = Path(__file__).resolve().parents[2]
    argv = ["train", str(root / "configs" / "gsm8k_tools_qwen2.5.yaml"), "--dry-run"]
    _refused(argv, "required config keys not set: ['data.train', 'model.path']", capsys)


def test_a_terminal_sees_one_line_and_no_traceback(tmp_path: Path) -> None:
    config = tmp_path / "deep.yaml"
    config.write_text("a: " + "[" * 5000 + "]" * 5000 + "\n")  # past the interpreter's stack
    done = subprocess.run(
        [sys.executable, "-m", "jax_agent_rl.cli", "config", str(config)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == f"jarl: config file {config}: nested deeper than 32 levels at line 1\n"


# -- checkpoint config.json: (what replaces it, what the line names) ------------------------

BASE = {**TINY["qwen2"], "head_dim": 16}


LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def _patched(**fields: object) -> str:
    return json.dumps({k: v for k, v in {**BASE, **fields}.items() if v is not None})


CHECKPOINTS = {
    "zero heads": (_patched(num_attention_heads=0), "num_attention_heads=0 is not a size"),
    "negative layers": (_patched(num_hidden_layers=-2), "num_hidden_layers (num_layers)=-2"),
    "zero kv heads": (_patched(num_key_value_heads=0), "num_key_value_heads (num_kv_heads)=0"),
    "bool kv heads": (_patched(num_key_value_heads=True), "(num_kv_heads)=True is not a size"),
    "bool hidden": (_patched(hidden_size=True), "hidden_size=True is not a size"),
    "float vocab": (_patched(vocab_size=256.0), "vocab_size=256.0 is not a size"),
    "huge vocab": (_patched(vocab_size=10**12), "vocab_size=1000000000000 is not a size"),
    "huge intermediate": (_patched(intermediate_size=2**40), "intermediate_size=1099511627776"),
    "huge int": ('{"vocab_size": ' + "9" * 5000 + "}", "is not valid JSON: Exceeds the limit"),
    "heads not dividing hidden": (
        _patched(num_attention_heads=3, head_dim=None),
        "hidden_size=64 is not a multiple of num_attention_heads=3",
    ),
    "kv heads not dividing heads": (
        _patched(num_key_value_heads=3),
        "num_attention_heads=4 is not a multiple of num_key_value_heads=3",
    ),
    "NaN eps": (_patched(rms_norm_eps=float("nan")), "rms_norm_eps=nan: expected a finite"),
    "denormal eps": (_patched(rms_norm_eps=1e-320), "rms_norm_eps=1e-320: expected a finite"),
    "negative theta": (_patched(rope_theta=-1.0), "rope_theta=-1.0: expected a finite number"),
    "theta below one": (
        _patched(rope_theta=0.5),
        "rope_theta=0.5: expected a finite number above 1",
    ),
    "infinite theta": (_patched(rope_theta=1e400), "rope_theta=inf"),
    "string theta": (_patched(rope_theta="1e4"), "rope_theta='1e4'"),
    "int for bool": (_patched(tie_word_embeddings=1), "tie_word_embeddings=1: expected true or"),
    "rope scaling a list": (_patched(rope_scaling=[1]), "rope_scaling=[1]: expected a JSON object"),
    "rope extra field": (
        _patched(rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.5}),
        "fields ['partial_rotary_factor'] are not supported with rope_type 'default'",
    ),
    # junk RoPE scaling, named as config.json spells it (older checkpoints: rope_scaling)
    "rope scaling of an unknown type": (
        _patched(rope_scaling={"type": "dynamic", "factor": 2.0}),
        "rope_scaling.rope_type='dynamic' is not supported (only 'default', 'llama3')",
    ),
    "rope scaling with a zero factor": (
        _patched(rope_scaling={**LLAMA3, "factor": 0}),
        "rope_scaling.factor=0: expected a finite number above 0",
    ),
    "rope scaling with a text factor": (
        _patched(rope_scaling={**LLAMA3, "factor": "8"}),
        "rope_scaling.factor='8': expected a finite number above 0",
    ),
    "rope scaling with a list type": (
        _patched(rope_scaling={**LLAMA3, "rope_type": ["llama3"], "type": ["llama3"]}),
        "rope_scaling.rope_type=['llama3'] is not supported",
    ),
    "rope scaling of two types": (
        _patched(rope_scaling={**LLAMA3, "type": "linear"}),
        "rope_scaling.rope_type='llama3' and rope_scaling.type='linear' disagree",
    ),
    "rope scaling beside other rope parameters": (
        _patched(rope_parameters={"rope_type": "default", "rope_theta": 1e4}, rope_scaling=LLAMA3),
        "rope_parameters and rope_scaling disagree on ['factor', 'high_freq_factor'",
    ),
    "rope theta given twice": (
        _patched(rope_theta=5e5, rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
        "rope_theta=500000.0 and rope_parameters.rope_theta=10000.0 disagree",
    ),
    "layer types a number": (_patched(layer_types=5), "layer_types=5: only a list of"),
    "model type a list": (_patched(model_type=["qwen2"]), "model_type=['qwen2'] is not supported"),
    "a list": ("[1, 2]", "expected a JSON object of config fields, got the list [1, 2]"),
    "a string": ('"qwen2"', "got the str 'qwen2'"),
    "null": ("null", "got the NoneType None"),
    "not JSON": ("{model_type: qwen2}", "is not valid JSON: Expecting property name"),
    "empty": ("", "is not valid JSON: Expecting value"),
    "undecodable": (b"\xff\xfe{\x00}", "is not UTF-8 text: byte 0xff at offset 0"),
    "deep JSON": ("[" * 100_000 + "]" * 100_000, "is JSON nested too deeply"),
    "missing": (None, "no config.json in checkpoint folder"),
}


@pytest.mark.parametrize("case", sorted(CHECKPOINTS))
def test_a_bad_checkpoint_config_is_one_line(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    content, named = CHECKPOINTS[case]
    config = tmp_path / "config.json"
    if isinstance(content, bytes):
        config.write_bytes(content)
    elif content is not None:
        config.write_text(content)
    _refused(["inspect", str(tmp_path)], named, capsys)


def test_inspecting_a_file_says_a_checkpoint_is_a_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A file (a FIFO, a safetensors file) given to ``jarl inspect``: "[Errno 20] Not a
    directory: '.../config.json'"."""
    file = tmp_path / "model.safetensors"
    file.write_bytes(b"x")
    _refused(["inspect", str(file)], f"{file} is not a folder: expected an HF checkpoint", capsys)


@pytest.mark.parametrize("case", ["zero kv heads", "a list", "deep JSON"])
def test_train_checks_the_checkpoint_config_first(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``jarl train --dry-run`` refuses the checkpoint in one line, the data being fine."""
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text(CHECKPOINTS[case][0])
    row = {"prompt": [{"role": "user", "content": "2+3?"}], "reward_model": {"ground_truth": "5"}}
    (tmp_path / "t.jsonl").write_text(json.dumps(row) + "\n")
    config = tmp_path / "run.yaml"
    config.write_text(
        f"model:\n  path: {tmp_path / 'ckpt'}\ndata:\n  train: {tmp_path / 't.jsonl'}\n"
    )
    _refused(["train", str(config), "--dry-run"], CHECKPOINTS[case][1], capsys)


@pytest.mark.parametrize(
    ("spec", "named"),
    [
        ("size=1000000000000&seed=0", "size=1000000000000 is over 100000 rows"),
        ("size=4&seed=0&max_terms=200000", "option max_terms=200000 is over 10000"),
    ],
)
def test_reasoning_gym_options_are_bounded_at_check_time(spec: str, named: str) -> None:
    """A reasoning-gym spec with a size or a task option that would run for ever or overflow
    the stack is one problem of the config check, naming the key and the option."""
    from jax_agent_rl.cli.demo import DEMO_CONFIG
    from jax_agent_rl.config import load_config

    override = f"data.train=reasoning_gym:basic_arithmetic?{spec}"
    problems = check_run(load_config(DEMO_CONFIG, ["model.path=/nowhere", override]))
    mine = [p for p in problems if p.startswith("data.train: reasoning_gym:")]
    assert len(mine) == 1 and named in mine[0], problems


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--coordinator", "host0"], "--coordinator='host0': expected HOST:PORT"),
        (["--coordinator", "host0:"], "--coordinator='host0:': expected HOST:PORT"),
        (["--coordinator", "host0:99999999"], "port in [1, 65535]"),
        (["--coordinator", "host0:0"], "port in [1, 65535]"),
        (["--coordinator", "host0:1", "--heartbeat-timeout", "-1"], "--heartbeat-timeout=-1"),
    ],
)
def test_a_process_group_flag_that_cannot_work_is_one_line(
    flags: list[str], named: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A coordinator address without a port (a traceback out of jax.distributed: IndexError),
    a port outside TCP's, or a heartbeat timeout below a second was accepted by the pre-run
    check (--dry-run said ok), and the run then failed, or waited, inside JAX."""
    config = tmp_path / "run.yaml"
    config.write_text("model:\n  path: /ckpt\ndata:\n  train: t.jsonl\n")
    group = ["--num-processes", "2", "--process-id", "0", *flags]
    _refused(["train", str(config), *group, "--dry-run"], named, capsys)


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("-1", "is not in (0, 1e+06]"),
        ("0", "is not in (0, 1e+06]"),
        ("nan", "is not a finite number"),
        ("1e309", "is not a finite number"),  # a float's inf (before: "is not > 0")
        ("1e300", "is not in (0, 1e+06]"),  # before: the wait for the compiler overflowed
    ],
)
def test_a_plan_compile_timeout_below_a_moment_or_past_a_wait_s_range_is_refused(
    value: str, problem: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: taken, and every program was reported 'did not compile within -1 s'."""
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(
            ["plan", "c.yaml", "--topology", "v5e-4", "--compile-timeout", value]
        )
    assert exit_.value.code == 2
    assert f"argument --compile-timeout: {value} {problem}" in capsys.readouterr().err


def test_a_plan_json_file_that_cannot_be_written_is_refused_first(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The plan is written once every program has compiled (minutes): a --json file in a
    folder that is not there was a traceback after all of them (FileNotFoundError)."""
    config = tmp_path / "run.yaml"
    config.write_text("model:\n  path: /ckpt\ndata:\n  train: t.jsonl\n")
    out = tmp_path / "none" / "plan.json"
    argv = ["plan", str(config), "--topology", "v5e-4", "--json", str(out)]
    _refused(argv, f"--json {out}: its folder does not exist", capsys)


def test_a_plan_json_fifo_is_refused_first(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--json`` naming a FIFO: the plan was made, then its write blocked for ever (no reader);
    a folder or a device fails it. Only a regular file (or none yet) is taken."""
    config = tmp_path / "run.yaml"
    config.write_text("model:\n  path: /ckpt\ndata:\n  train: t.jsonl\n")
    out = tmp_path / "plan.json"
    os.mkfifo(out)
    argv = ["plan", str(config), "--topology", "v5e-4", "--json", str(out)]
    _refused(argv, f"--json {out}: not a regular file", capsys)


@pytest.mark.parametrize(
    ("make", "problem"),
    [
        (
            lambda d: (d / "plan.json").symlink_to(d / "gone" / "plan.json"),
            "cannot be written: No such file",
        ),
        (
            lambda d: (d / "plan.json").symlink_to(d / "plan.json"),
            "cannot be written: Too many levels of symbolic links",
        ),
        (lambda _: None, "name a file to write"),
    ],
    ids=["dangling link", "link loop", "empty"],
)
def test_a_plan_json_path_no_file_can_be_made_at_is_refused_first(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], make: Any, problem: str
) -> None:
    """A dangling link, a link loop (or /proc/plan.json) passed the check, and the write after
    minutes of compiling ended in a traceback, exit 1 ("does not fit"); ``--json ""`` wrote
    nothing, silently."""
    config = tmp_path / "run.yaml"
    config.write_text("model:\n  path: /ckpt\ndata:\n  train: t.jsonl\n")
    make(tmp_path)
    out = "" if problem.startswith("name") else str(tmp_path / "plan.json")
    argv = ["plan", str(config), "--topology", "v5e-4", "--json", out]
    _refused(argv, f"--json {out}: {problem}", capsys)


def test_evaluating_an_adapter_folder_says_how(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``jarl eval --checkpoint`` of the adapter folder ``jarl export`` writes for a LoRA run
    was refused as "no config.json in checkpoint folder", with no word on what to do."""
    adapter = tmp_path / "hf-step-2"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8}')
    row = {"prompt": [{"role": "user", "content": "2+3?"}], "reward_model": {"ground_truth": "5"}}
    (tmp_path / "v.jsonl").write_text(json.dumps(row) + "\n")
    config = tmp_path / "run.yaml"
    val = tmp_path / "v.jsonl"
    config.write_text(f"model:\n  path: /ckpt\ndata:\n  train: t.jsonl\n  val: {val}\n")
    argv = ["eval", str(config), "--checkpoint", str(adapter)]
    _refused(argv, "is a LoRA adapter folder (adapter_config.json), not a checkpoint: ", capsys)


@pytest.mark.parametrize(
    ("override", "problem"),
    [
        ("agent.stop={a: 1, a: 2}", "found duplicate key a"),
        ("data.rewards_by_source={a: x, a: y}", "found duplicate key a"),
        ("agent.stop=[&a [*a]]", "YAML recursive aliases are not supported"),
        ("agent.stop=!!python/object:os.system x", "could not determine a constructor"),
        ('agent.stop=["\\ud83d"]', "found invalid Unicode character escape code"),
    ],
)
def test_an_override_omegaconfs_reader_refuses_is_a_config_error(
    override: str, problem: str
) -> None:
    key = override.partition("=")[0]
    with pytest.raises(
        ConfigError, match=rf"^override {key}: invalid YAML at line 1, column \d+: {problem}"
    ):
        load_config(None, ["model.path=m", "data.train=t.jsonl", override])


@pytest.mark.parametrize(
    ("setting", "problem"),
    [
        ("data.reward=${foo}", "Interpolation key 'foo' not found"),
        ("trainer.run_dir=${trainer.run_dir}", "Recursive interpolation detected"),
    ],
)
def test_an_interpolation_that_resolves_to_nothing_is_a_config_error(
    tmp_path: Path, setting: str, problem: str
) -> None:
    key, _, value = setting.partition("=")
    match = rf"^config key '{key}': {problem}$"
    with pytest.raises(ConfigError, match=match):
        load_config(None, ["model.path=m", "data.train=t.jsonl", setting])
    with pytest.raises(ConfigError, match=match):
        preview_config(None, [setting])
    section, _, name = key.partition(".")
    path = tmp_path / "run.yaml"
    path.write_text(f"{section}:\n  {name}: {value}\n")
    with pytest.raises(ConfigError, match=match):
        load_config(path, ["model.path=m", "data.train=t.jsonl"])
    assert load_config(None, ["model.path=m", "data.train=t.jsonl", f"{key}=${{model.path}}"])


@pytest.mark.parametrize(
    "text",
    ["costs ${x} here", "${model.path}", "a \\${y}", "\\\\${z} and ${w}", "plain \\ $ { }"],
)
def test_a_literal_interpolation_survives_the_run_folders_config(tmp_path: Path, text: str) -> None:
    """A prompt holding ``${`` (given escaped, ``\\${x}``) was written into the run's
    config.yaml as it reads, an interpolation: resuming the run, or ``jarl eval RUN``, then
    failed on its own config ("Interpolation key 'x' not found"). Written escaped, it reads
    back as the same text, also beside backslashes."""
    escaped = re.sub(r"(\\*)\$\{", lambda m: m[1] * 2 + "\\${", text)
    required = ["model.path=m", "data.train=t.jsonl"]
    for given in (
        [f"agent.context.compact_prompt={escaped}"],
        [f"agent.context.compact_prompt={json.dumps(escaped)}"],
    ):
        cfg = load_config(None, [*required, *given])
        assert cfg.agent.context.compact_prompt == text
        run = tmp_path / "config.yaml"
        run.write_text(to_yaml(cfg))
        assert load_config(run, []) == cfg


def test_env_config_keys_holding_a_dot_survive_the_run_folders_config(tmp_path: Path) -> None:
    """A skyrl-gym environment's own config may name keys with a dot (``a.b``): from the YAML,
    or an override that escapes the dot (``a\\.b``), they stay one key, and the run's
    config.yaml reads back the same; an unescaped dot in an override nests, as everywhere."""
    path = tmp_path / "run.yaml"
    path.write_text("env:\n  config:\n    myenv:\n      a.b: 1\n      'x.y': {c.d: 2}\n")
    required = ["model.path=m", "data.train=t.jsonl"]
    cfg = load_config(path, [*required, "env.config.myenv.e\\.f=3", "env.config.other.g.h=4"])
    assert cfg.env.config == {
        "myenv": {"a.b": 1, "x.y": {"c.d": 2}, "e.f": 3},
        "other": {"g": {"h": 4}},
    }
    run = tmp_path / "config.yaml"
    run.write_text(to_yaml(cfg))
    assert load_config(run, []) == cfg


@pytest.mark.parametrize(
    ("override", "kind"),
    [
        ("model.path=!!timestamp 2001-12-14", "date"),
        ("model.path=!!set {a, b}", "set"),
        ("agent.stop=[!!timestamp 2001-12-14 10:00:00]", "datetime"),
        ("data.rewards_by_source={a: !!set {x}}", "set"),
    ],
)
def test_an_override_of_a_value_omegaconf_cannot_hold_is_a_config_error(
    override: str, kind: str
) -> None:
    key = override.partition("=")[0]
    match = rf"^override {key}: Value '{kind}' is not a supported primitive type: give a string"
    with pytest.raises(ConfigError, match=match):
        load_config(None, ["model.path=m", "data.train=t.jsonl", override])
    with pytest.raises(ConfigError, match=match):
        preview_config(None, [override])


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("[" * 3000, "nested too deep"),
        ("{a: " * 3000, "nested too deep"),
        ("[1, [2, 99999]]", "option x=99999 is over 10000"),
        ("{lo: 1, hi: 10001}", "option x=10001 is over 10000"),
    ],
)
def test_a_reasoning_gym_option_is_read_and_bounded_however_deep(value: str, problem: str) -> None:
    """An option's value nested past the recursion limit (a RecursionError out of the YAML
    reader: ``jarl train`` printed a traceback), and a number inside a list or a mapping
    (bounded only at the top level: a task loops over it as over any other), are errors
    naming the spec."""
    spec = f"reasoning_gym:basic_arithmetic?size=1&seed=0&x={value}"
    with pytest.raises(ReasoningGymError, match=re.escape(problem)):
        reasoning_gym.samples(spec, "tool_agent")


def test_an_interaction_config_nested_too_deep_is_a_config_error(tmp_path: Path) -> None:
    """``env.interaction_config`` nested past the recursion limit: a RecursionError out of
    the YAML reader (``jarl train`` printed its traceback), now a `ConfigError` naming the
    key and the file."""
    path = tmp_path / "interaction.yaml"
    path.write_text("interaction: " + "[" * 3000 + "]" * 3000 + "\n")
    with pytest.raises(ConfigError, match=r"env\.interaction_config=.*nested too deep"):
        load_interactions(str(path))


def test_overrides_after_a_flag_are_overrides(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``jarl train CONFIG --dry-run key=value`` ended in argparse's "unrecognized arguments":
    a command's overrides stopped at its first flag. The override is read now (here refused
    by name), and a word after a flag that is no override is still refused."""
    config = tmp_path / "run.yaml"
    config.write_text("trainer:\n  steps: 1\n")
    assert main(["train", str(config), "--dry-run", "trainer.stepz=2"]) == 2
    assert "unknown config key 'trainer.stepz'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", str(config), "--dry-run", "stray"])


def test_a_backend_section_no_backend_reads_is_noted() -> None:
    """``engine.vllm.replicas=3`` (or ``engine.jetstream.chips``) beside another backend
    passed the pre-run check with no word: one embedded engine ran."""
    engine = EngineSection(vllm=VLLMSection(replicas=3), jetstream=JetStreamSection(chips="0,1"))
    notes = unread_sections(engine)
    assert [n.split(" is read")[0] for n in notes] == [
        "engine.vllm.replicas=3",
        "engine.jetstream.chips='0,1'",
    ]
    on_vllm = unread_sections(dataclasses.replace(engine, backend="vllm"))
    assert [n.split(" is read")[0] for n in on_vllm] == ["engine.jetstream.chips='0,1'"]


REQUIRED = "model:\n  path: /m\ndata:\n  train: /d\n"


@pytest.mark.parametrize("section", ["rollout:\n", "rollout: {}\n", "rollout: 5\n"])
def test_the_split_rollout_section_names_where_its_keys_went(tmp_path: Path, section: str) -> None:
    (tmp_path / "run.yaml").write_text(REQUIRED + section)
    with pytest.raises(ConfigError, match=r"'rollout' split.*engine, group, sampling"):
        load_config(tmp_path / "run.yaml")


def test_an_empty_section_that_still_exists_is_not_refused_as_moved(tmp_path: Path) -> None:
    (tmp_path / "run.yaml").write_text(REQUIRED + "agent: {}\n")
    assert load_config(tmp_path / "run.yaml").group.n == 8


def test_ray_settings_without_a_cluster_are_noted() -> None:
    ray = RaySection(replicas=4, num_gpus=1.0)
    notes = unread_sections(EngineSection(ray=ray))
    assert len(notes) == 2 and all("engine.ray.address is empty" in n for n in notes), notes
    assert "engine.ray.replicas=4" in notes[0] and "engine.ray.num_gpus=1.0" in notes[1]
    on_a_cluster = dataclasses.replace(ray, address="auto")
    assert unread_sections(EngineSection(ray=on_a_cluster)) == []


def test_eval_of_a_run_with_an_old_key_names_its_config_file(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(REQUIRED + "rollout:\n  backend: embedded\n")
    with pytest.raises(ConfigError, match=r"run/config\.yaml: config key 'rollout\.backend'"):
        eval_target(str(run))
    (run / "config.yaml").write_text(REQUIRED)
    with pytest.raises(ConfigError) as refused:
        eval_target(str(run), overrides=["group.x=1"])
    assert "config.yaml" not in str(refused.value)


def test_export_of_a_run_with_an_old_key_names_its_config_file(tmp_path: Path) -> None:
    (tmp_path / "config.yaml").write_text(REQUIRED + "rollout:\n  n: 4\n")
    with pytest.raises(ConfigError, match=r"config\.yaml: config key 'rollout\.n' is now"):
        export_run(tmp_path)


def test_an_interpolation_of_a_moved_key_names_its_new_key(tmp_path: Path) -> None:
    (tmp_path / "run.yaml").write_text(
        REQUIRED + "sampling:\n  temperature: ${rollout.temperature}\n"
    )
    with pytest.raises(ConfigError, match=r"'rollout\.temperature' is now 'sampling\.temperature'"):
        load_config(tmp_path / "run.yaml")


def test_the_interpolations_a_config_reads_still_resolve(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A key of the config and an environment variable (with and without a default) go
    through the interpolation check and resolve."""
    monkeypatch.setenv("JARL_TEST_CKPT", "/ckpt/from/env")
    config = tmp_path / "run.yaml"
    config.write_text(
        "model:\n  path: ${oc.env:JARL_TEST_CKPT}\ndata:\n  train: t.jsonl\n  val: ${data.train}\n"
    )
    cfg = load_config(config, ["trainer.run_dir=${oc.env:JARL_TEST_UNSET,runs/x}"])
    assert cfg.model.path == "/ckpt/from/env" and cfg.data.val.endswith("t.jsonl")
    assert cfg.trainer.run_dir.endswith("runs/x")
