#!/usr/bin/env bash
# Trains on CUDA nodes: on each, the JAX learner on the first GPUs, one vLLM engine per
# remaining GPU; with --nodes, one learner process per node joined into one mesh
# (jax.distributed), each node rolling out its share of every step on its own engines.
#
#   launch/gpu.sh [--gpus N] [--learner-gpus L] [--ray ADDRESS] [--dry-run] CONFIG [key=value ...]
#   launch/gpu.sh --nodes N --node-rank R --coordinator HOST:PORT [...] CONFIG [key=value ...]
#
#   --gpus N          GPUs on the node (default: what nvidia-smi lists)
#   --learner-gpus L  GPUs for the learner (default: N / 2); the other N - L each run one vLLM
#                     engine (rollout.replicas = N - L, rollout.vllm_devices = their ids)
#   --ray ADDRESS     submit the same command as a job to a running Ray cluster (`ray job
#                     submit`), whose head node runs it with the GPUs it was started with
#   --nodes N         nodes in the run (default 1); run this script on every node, each with
#                     its --node-rank; mesh.data = learner GPUs x N
#   --node-rank R     this node's rank, 0 .. N-1 (0 serves the coordinator)
#   --coordinator A   HOST:PORT of node 0, reachable from every node (e.g. 10.0.0.2:8476)
#   --dry-run         print the plan and the commands, run nothing (with --nodes and no
#                     --node-rank: every node's command)
#
# Environments: .venv (JAX with CUDA: `pip install "jax[cuda12]==<the locked jax>"` into it)
# and a vLLM CUDA build for the engines: VLLM_PYTHON=/path/to/venv/bin/python (default
# .venv-vllm/bin/python; `scripts/setup.sh vllm` builds the CPU build there, so on a CUDA node
# install `vllm` itself into a venv and point VLLM_PYTHON at it). Weights reach the engines
# through /dev/shm (see docs/vllm.md for the CUDA IPC / NCCL path).
set -euo pipefail
cd "$(dirname "$0")/.."

gpus="" learner="" ray="" dry=0 nodes=1 rank="" coordinator=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --nodes) nodes=$2; shift 2 ;;
    --node-rank) rank=$2; shift 2 ;;
    --coordinator) coordinator=$2; shift 2 ;;
    --gpus) gpus=$2; shift 2 ;;
    --learner-gpus) learner=$2; shift 2 ;;
    --ray) ray=$2; shift 2 ;;
    --dry-run) dry=1; shift ;;
    -h|--help) sed -n '2,29p' "$0"; exit 0 ;;
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

if (( nodes > 1 )); then
  [[ -z $ray ]] || { echo "gpu.sh: --ray submits one command; --nodes runs one per node" >&2; exit 2; }
  [[ -n $coordinator ]] || { echo "gpu.sh: --nodes $nodes needs --coordinator HOST:PORT (node 0)" >&2; exit 2; }
  if [[ -z $rank ]] && (( ! dry )); then
    echo "gpu.sh: --nodes $nodes needs this node's --node-rank (0 .. $((nodes - 1)))" >&2; exit 2
  fi
  if [[ -n $rank ]] && ! (( rank >= 0 && rank < nodes )); then
    echo "gpu.sh: --node-rank $rank is not in 0 .. $((nodes - 1))" >&2; exit 2
  fi
fi

# The command of node $1 (an empty rank: a single-node run).
command_of() {
  train=(env "CUDA_VISIBLE_DEVICES=$learner_ids" JAX_PLATFORMS=cuda .venv/bin/python -m jax_agent_rl.cli
    train "$config" rollout.backend=vllm "rollout.replicas=$replicas"
    "rollout.vllm_devices=$engine_ids" "rollout.vllm_python=$vllm_python"
    "mesh.data=$((learner * nodes))" "$@")
  if [[ -n $node ]]; then
    train+=(--coordinator "$coordinator" --num-processes "$nodes" --process-id "$node")
  fi
  if [[ -n $ray ]]; then
    run=(ray job submit --address "$ray" --working-dir . -- "${train[@]}")
  else
    run=("${train[@]}")
  fi
}

over=$( (( nodes > 1 )) && echo " over $nodes nodes" || true)
echo "plan: $gpus GPUs per node; learner on GPUs $learner_ids (mesh.data=$((learner * nodes))$over);"
echo "      $replicas vLLM engine(s) per node on GPUs $engine_ids, interpreter $vllm_python"
if (( nodes > 1 )) && [[ -z $rank ]]; then  # --dry-run: every node's command
  for node in $(seq 0 $((nodes - 1))); do
    command_of "$@"
    echo "node $node: ${run[*]}"
  done
  exit 0
fi
node=$( (( nodes > 1 )) && echo "$rank" || true)
command_of "$@"
echo "run:  ${run[*]}"
if (( dry )); then
  exit 0
fi
[[ -x $vllm_python ]] || { echo "gpu.sh: no vLLM interpreter at $vllm_python (set VLLM_PYTHON)" >&2; exit 2; }
exec "${run[@]}"
