#!/usr/bin/env bash
# Trains on CUDA nodes: on each, the JAX learner on the first GPUs, one vLLM engine per
# --tensor-parallel group of the remaining GPUs; with --nodes, one learner process per node joined into one mesh
# (jax.distributed), each node rolling out its share of every step on its own engines; with
# --ray, the learner on every GPU here and the vLLM engines on a Ray cluster's GPU nodes.
#
#   launch/gpu.sh [--gpus N] [--learner-gpus L] [--tensor-parallel T] [--dry-run] CONFIG [...]
#   launch/gpu.sh --ray ADDRESS --replicas R [--engine-gpus G] [--gpus N] [--dry-run] CONFIG [...]
#   launch/gpu.sh --nodes N --node-rank R --coordinator HOST:PORT [...] CONFIG [key=value ...]
#
#   --gpus N          GPUs on the node (default: what nvidia-smi lists)
#   --learner-gpus L  GPUs for the learner (default: N / 2); the other N - L run the vLLM
#                     engines, T each (engine.vllm.replicas = (N - L) / T,
#                     engine.vllm.devices = their ids, T by T in engine order)
#   --tensor-parallel T  GPUs each vLLM engine shards the model over (default 1;
#                     engine.vllm.tensor_parallel_size = T); N - L must be a multiple of T
#   --ray ADDRESS     the engines are Ray actors on the cluster at ADDRESS (HOST:PORT of its
#                     head, or auto), placed by a placement group (engine.ray.*, SPREAD over
#                     the GPU nodes); the learner takes all N GPUs here. --dry-run asks the
#                     cluster where each engine would go (a reservation, released at once)
#   --replicas R      vLLM engines on the cluster (with --ray)
#   --engine-gpus G   GPUs of each engine (with --ray; default T)
#   --nodes N         nodes in the run (default 1); run this script on every node, each with
#                     its --node-rank; mesh.data = learner GPUs x N
#   --node-rank R     this node's rank, 0 .. N-1 (0 serves the coordinator)
#   --coordinator A   HOST:PORT of node 0, reachable from every node (e.g. 10.0.0.2:8476)
#   --dry-run         print the plan and the commands, run nothing (with --nodes and no
#                     --node-rank: every node's command)
#
# Environments: .venv with the locked CUDA JAX (this script runs `scripts/setup.sh cuda` when .venv's jax
# has no CUDA plugin; --dry-run says whether it would) and a vLLM CUDA build for the engines: VLLM_PYTHON=
# /path/to/venv/bin/python (default .venv-vllm/bin/python; `scripts/setup.sh vllm` builds the CPU build there,
# so on a CUDA node install `vllm` itself into a venv, then the engine's side, `pip install --no-deps -e
# gpu_backend`, and point VLLM_PYTHON at it; with --ray, at that path on every engine node, and jax_agent_rl
# installed there too). Weights reach the engines through /dev/shm, on each engine's node (docs/vllm.md).
set -euo pipefail
cd "$(dirname "$0")/.."

gpus="" learner="" ray="" replicas="" engine_gpus="" tp=1 dry=0 nodes=1 rank="" coordinator=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --nodes) nodes=$2; shift 2 ;;
    --node-rank) rank=$2; shift 2 ;;
    --coordinator) coordinator=$2; shift 2 ;;
    --gpus) gpus=$2; shift 2 ;;
    --learner-gpus) learner=$2; shift 2 ;;
    --ray) ray=$2; shift 2 ;;
    --replicas) replicas=$2; shift 2 ;;
    --engine-gpus) engine_gpus=$2; shift 2 ;;
    --tensor-parallel) tp=$2; shift 2 ;;
    --dry-run) dry=1; shift ;;
    -h|--help) sed -n '2,35p' "$0"; exit 0 ;;
    -*) echo "gpu.sh: unknown option $1" >&2; exit 2 ;;
    *) break ;;
  esac
done
[[ $# -ge 1 ]] || { echo "gpu.sh: a CONFIG is required (see --help)" >&2; exit 2; }
config=$1; shift
[[ $tp =~ ^[1-9][0-9]*$ ]] || { echo "gpu.sh: --tensor-parallel $tp is not a positive count" >&2; exit 2; }
engine_gpus=${engine_gpus:-$tp}
if (( engine_gpus != tp )); then
  echo "gpu.sh: --engine-gpus $engine_gpus with --tensor-parallel $tp: an engine shards over all its GPUs" >&2
  exit 2
fi

if [[ -z $gpus ]]; then
  command -v nvidia-smi >/dev/null \
    || { echo "gpu.sh: no nvidia-smi here; pass --gpus N (with --dry-run to plan elsewhere)" >&2; exit 2; }
  gpus=$(nvidia-smi --list-gpus | wc -l)
fi
vllm_python=${VLLM_PYTHON:-$PWD/.venv-vllm/bin/python}
if [[ -n $ray ]]; then  # every GPU here learns; the engines are on the cluster
  [[ -n $replicas ]] || { echo "gpu.sh: --ray needs --replicas R (vLLM engines on the cluster)" >&2; exit 2; }
  [[ -z $learner ]] || { echo "gpu.sh: with --ray the learner takes all --gpus; drop --learner-gpus" >&2; exit 2; }
  learner=$gpus
else
  [[ -z $replicas ]] || { echo "gpu.sh: --replicas goes with --ray (here: --learner-gpus)" >&2; exit 2; }
  learner=${learner:-$((gpus / 2))}
  if (( gpus > learner && (gpus - learner) % tp )); then
    echo "gpu.sh: the $((gpus - learner)) engine GPUs do not split into --tensor-parallel $tp groups" >&2
    exit 2
  fi
  replicas=$(((gpus - learner) / tp))
fi
if (( learner < 1 || replicas < 1 )); then
  echo "gpu.sh: $gpus GPUs cannot hold $learner learner GPUs and at least one vLLM engine" >&2
  exit 2
fi
learner_ids=$(seq -s, 0 $((learner - 1)))
engine_ids=$( [[ -n $ray ]] || seq -s, "$learner" $((gpus - 1)))

if (( nodes > 1 )); then
  [[ -z $ray ]] || { echo "gpu.sh: --ray runs one learner; --nodes runs one per node" >&2; exit 2; }
  [[ -n $coordinator ]] || { echo "gpu.sh: --nodes $nodes needs --coordinator HOST:PORT (node 0)" >&2; exit 2; }
  if [[ -z $rank ]] && (( ! dry )); then
    echo "gpu.sh: --nodes $nodes needs this node's --node-rank (0 .. $((nodes - 1)))" >&2; exit 2
  fi
  if [[ -n $rank ]] && ! (( rank >= 0 && rank < nodes )); then
    echo "gpu.sh: --node-rank $rank is not in 0 .. $((nodes - 1))" >&2; exit 2
  fi
fi

# The command of node $node (empty: a single-node run).
command_of() {
  run=(env "CUDA_VISIBLE_DEVICES=$learner_ids" JAX_PLATFORMS=cuda .venv/bin/python -m jax_agent_rl.cli
    train "$config" engine.backend=vllm)
  if [[ -n $ray ]]; then
    run+=("engine.ray.address=$ray" "engine.ray.replicas=$replicas"
      "engine.ray.num_gpus=$engine_gpus")
  else
    run+=("engine.vllm.replicas=$replicas" "engine.vllm.devices=$engine_ids")
  fi
  run+=("engine.vllm.tensor_parallel_size=$tp")
  run+=("engine.vllm.python=$vllm_python" "mesh.data=$((learner * nodes))")
  run+=("$@")
  if [[ -n $node ]]; then
    run+=(--coordinator "$coordinator" --num-processes "$nodes" --process-id "$node")
  fi
}

cuda_jax=1
.venv/bin/python -c 'import jax_plugins.xla_cuda12' 2>/dev/null || cuda_jax=0
if (( dry && ! cuda_jax )); then
  echo "setup: scripts/setup.sh cuda (.venv has no CUDA JAX: a run installs it first)"
fi
over=$( (( nodes > 1 )) && echo " over $nodes nodes" || true)
echo "plan: $gpus GPUs per node; learner on GPUs $learner_ids (mesh.data=$((learner * nodes))$over);"
if [[ -n $ray ]]; then
  echo "      $replicas vLLM engine(s) of $engine_gpus GPU(s) each as Ray actors on $ray, interpreter $vllm_python"
  if (( dry )); then  # where the cluster would put them: Ray's own placement, released at once
    .venv/bin/python -m jax_agent_rl.rollout.ray_pool --address "$ray" --replicas "$replicas" \
      --num-gpus "$engine_gpus" --strategy SPREAD \
      || { echo "gpu.sh: the cluster at $ray cannot place the engines (above)" >&2; exit 2; }
  fi
else
  echo "      $replicas vLLM engine(s) of $tp GPU(s) each per node on GPUs $engine_ids, interpreter $vllm_python"
fi
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
(( cuda_jax )) || bash scripts/setup.sh cuda
[[ -x $vllm_python ]] || { echo "gpu.sh: no vLLM interpreter at $vllm_python (set VLLM_PYTHON)" >&2; exit 2; }
exec "${run[@]}"
