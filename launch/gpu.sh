#!/usr/bin/env bash
# Trains on a CUDA node: the JAX learner on the first GPUs, one vLLM engine per remaining GPU.
#
#   launch/gpu.sh [--gpus N] [--learner-gpus L] [--ray ADDRESS] [--dry-run] CONFIG [key=value ...]
#
#   --gpus N          GPUs on the node (default: what nvidia-smi lists)
#   --learner-gpus L  GPUs for the learner (default: N / 2); the other N - L each run one vLLM
#                     engine (rollout.replicas = N - L, rollout.vllm_devices = their ids)
#   --ray ADDRESS     submit the same command as a job to a running Ray cluster (`ray job
#                     submit`), whose head node runs it with the GPUs it was started with
#   --dry-run         print the plan and the commands, run nothing
#
# Environments: .venv (JAX with CUDA: `pip install "jax[cuda12]==<the locked jax>"` into it)
# and a vLLM CUDA build for the engines: VLLM_PYTHON=/path/to/venv/bin/python (default
# .venv-vllm/bin/python; `scripts/setup.sh vllm` builds the CPU build there, so on a CUDA node
# install `vllm` itself into a venv and point VLLM_PYTHON at it). Weights reach the engines
# through /dev/shm (see docs/vllm.md for the CUDA IPC / NCCL path).
set -euo pipefail
cd "$(dirname "$0")/.."

gpus="" learner="" ray="" dry=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --gpus) gpus=$2; shift 2 ;;
    --learner-gpus) learner=$2; shift 2 ;;
    --ray) ray=$2; shift 2 ;;
    --dry-run) dry=1; shift ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    -*) echo "gpu.sh: unknown option $1" >&2; exit 2 ;;
    *) break ;;
  esac
done
[[ $# -ge 1 ]] || { echo "gpu.sh: a CONFIG is required (see --help)" >&2; exit 2; }
config=$1; shift

if [[ -z $gpus ]]; then
  command -v nvidia-smi >/dev/null \
    || { echo "gpu.sh: no nvidia-smi here; pass --gpus N (with --dry-run to plan elsewhere)" >&2; exit 2; }
  gpus=$(nvidia-smi --list-gpus | wc -l)
fi
learner=${learner:-$((gpus / 2))}
replicas=$((gpus - learner))
if (( learner < 1 || replicas < 1 )); then
  echo "gpu.sh: $gpus GPUs cannot hold $learner learner GPUs and at least one vLLM engine" >&2
  exit 2
fi
learner_ids=$(seq -s, 0 $((learner - 1)))
engine_ids=$(seq -s, "$learner" $((gpus - 1)))
vllm_python=${VLLM_PYTHON:-$PWD/.venv-vllm/bin/python}

train=(env "CUDA_VISIBLE_DEVICES=$learner_ids" JAX_PLATFORMS=cuda .venv/bin/python -m jax_agent_rl.cli
  train "$config" rollout.backend=vllm "rollout.replicas=$replicas"
  "rollout.vllm_devices=$engine_ids" "rollout.vllm_python=$vllm_python"
  "mesh.data=$learner" "$@")
if [[ -n $ray ]]; then
  run=(ray job submit --address "$ray" --working-dir . -- "${train[@]}")
else
  run=("${train[@]}")
fi

echo "plan: $gpus GPUs; learner on GPUs $learner_ids (mesh.data=$learner);"
echo "      $replicas vLLM engine(s) on GPUs $engine_ids, interpreter $vllm_python"
echo "run:  ${run[*]}"
if (( dry )); then
  exit 0
fi
[[ -x $vllm_python ]] || { echo "gpu.sh: no vLLM interpreter at $vllm_python (set VLLM_PYTHON)" >&2; exit 2; }
exec "${run[@]}"
