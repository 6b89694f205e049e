#!/usr/bin/env bash
# Trains on a Cloud TPU VM slice: every worker (host) runs `jarl train --distributed`, one JAX
# process each; together they form one mesh over all the slice's chips (see docs/tpu.md).
#
#   launch/tpu_pod.sh --name NAME --zone ZONE [options] CONFIG [key=value ...]
#
#   --name NAME          the TPU VM (created if it does not exist and --accelerator-type is given)
#   --zone ZONE          its zone, e.g. us-west4-a (v5e), us-east5-b (v6e)
#   --project PROJECT    the GCP project (default: gcloud's configured one)
#   --accelerator-type T create the slice as T when it does not exist: v5litepod-16, v6e-16, ...
#   --version V          the TPU VM runtime image for a new slice (default: v2-alpha-tpuv5-lite
#                        for v5e, v2-alpha-tpuv6e for v6e)
#   --spot               create the slice as Spot VMs (preemptible: rerun to resume)
#   --sync PATH          also copy PATH (a model folder, a data file) to the same path on every
#                        worker; repeatable. Better: a folder every worker mounts (see below)
#   --dir DIR            where the code goes on the workers (default: ~/jax_agent_rl)
#   --no-plan            skip step 0 (not advised: a run that does not fit fails on the slice)
#   --dry-run            print every command, run nothing
#   -h, --help           this text
#
# Steps: `jarl plan` here first (every program of the run compiled for the slice's topology,
# from --accelerator-type or the existing slice's type; the script stops, creating and using
# nothing, when the run does not fit its chips' memory; this machine needs .venv with libtpu:
# scripts/setup.sh && scripts/setup.sh tpu-plan); create or reuse the slice; copy the
# repository's tracked files (git ls-files, and the config if untracked) to every worker;
# `scripts/setup.sh tpu` on every worker (.venv with the locked jax and its libtpu; a second
# run returns at once), and `scripts/setup.sh jetstream` too when the run's engine.backend is
# jetstream (each worker's server, on the chips engine.jetstream.chips gives it; see
# docs/jetstream.md); then `jarl train CONFIG --distributed ...` started detached on all
# workers at once (--worker=all), and worker 0's log (process 0: the progress, step lines, the
# message naming a failed process) followed here until the run ends; the script exits with
# the run's code. Every worker keeps its log in ~/jarl-train-<time>.log. Ctrl-C (or SIGTERM)
# stops the run on every worker; rerunning the same command resumes from the last checkpoint.
#
# trainer.run_dir must be a folder every worker sees at the same path (Filestore/NFS; a
# gcsfuse mount with --rename-dir-limit raised): all processes write the orbax checkpoints
# there, process 0 the metrics. model.path and the data files must exist on every worker
# (shared folder or --sync).
set -euo pipefail
cd "$(dirname "$0")/.."

name="" zone="" project="" accel="" version="" spot=0 dir='~/jax_agent_rl' dry=0 plan=1
sync=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --name) name=$2; shift 2 ;;
    --zone) zone=$2; shift 2 ;;
    --project) project=$2; shift 2 ;;
    --accelerator-type) accel=$2; shift 2 ;;
    --version) version=$2; shift 2 ;;
    --spot) spot=1; shift ;;
    --sync) sync+=("$2"); shift 2 ;;
    --dir) dir=$2; shift 2 ;;
    --dry-run) dry=1; shift ;;
    --no-plan) plan=0; shift ;;
    -h|--help) sed -n '2,38p' "$0"; exit 0 ;;
    -*) echo "tpu_pod.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) break ;;
  esac
done
[[ -n $name && -n $zone ]] || { echo "tpu_pod.sh: --name and --zone are required (see --help)" >&2; exit 2; }
[[ $# -ge 1 ]] || { echo "tpu_pod.sh: a CONFIG is required (see --help)" >&2; exit 2; }
config=$1; shift
[[ -f $config ]] || { echo "tpu_pod.sh: no config file $config" >&2; exit 2; }
# the run's rollout backend: the config's, then the overrides' (the workers check the rest)
backend=$(.venv/bin/python -c 'import sys
from omegaconf import OmegaConf
dots = OmegaConf.from_dotlist([a.lstrip("+") for a in sys.argv[2:] if "=" in a])
cfg = OmegaConf.merge(OmegaConf.load(sys.argv[1]), dots)
print(OmegaConf.select(cfg, "engine.backend", default="embedded"))' "$config" "$@") \
  || { echo "tpu_pod.sh: cannot read engine.backend of $config (see above; needs .venv)" >&2; exit 2; }
if [[ -z $version && -n $accel ]]; then
  case "$accel" in
    v5litepod-*|v5e-*) version=v2-alpha-tpuv5-lite ;;
    v6e-*) version=v2-alpha-tpuv6e ;;
    *) echo "tpu_pod.sh: pass --version for accelerator type $accel" >&2; exit 2 ;;
  esac
fi

where=(--zone "$zone")
[[ -n $project ]] && where+=(--project "$project")
tpu=(gcloud compute tpus tpu-vm)

# Prints a command (an argument with spaces or shell syntax in double quotes), then runs it
# unless --dry-run.
step() {
  local shown="" a
  for a in "$@"; do
    if [[ $a =~ [[:space:]\|\&\;\<\>] ]]; then shown+="\"$a\" "; else shown+="$a "; fi
  done
  echo "+ ${shown% }"
  (( dry )) || "$@"
}
# A command on every worker of the slice.
on_all() {
  step "${tpu[@]}" ssh "$name" "${where[@]}" --worker=all --command "$1"
}

# 0. the plan: the run compiled for the slice's TPU topology here, before a slice is used
if (( plan )); then
  if [[ -z $accel ]] && (( ! dry )); then
    accel=$("${tpu[@]}" describe "$name" "${where[@]}" --format='value(acceleratorType)' 2>/dev/null || true)
  fi
  [[ -n $accel ]] || { echo "tpu_pod.sh: no slice $name found to plan for: pass --accelerator-type (or --no-plan)" >&2; exit 2; }
  topology=${accel/#v5litepod-/v5e-}  # jarl plan's spelling: v5e-16, v5p-32, v6e-8
  planned=(.venv/bin/python -m jax_agent_rl.cli plan "$config" "$@" --topology "$topology")
  if (( dry )); then
    step "${planned[@]}"
  elif ! step "${planned[@]}"; then
    echo "tpu_pod.sh: jarl plan refused the run on $accel (above); nothing was started" >&2
    exit 1
  fi
fi

# 1. the slice
if (( dry )); then
  echo "# create the slice unless '${tpu[*]} describe $name' finds it:"
  if [[ -n $accel ]]; then
    create=("${tpu[@]}" create "$name" "${where[@]}" --accelerator-type "$accel" --version "$version")
    (( spot )) && create+=(--spot)
    echo "+ ${create[*]}"
  fi
elif ! "${tpu[@]}" describe "$name" "${where[@]}" >/dev/null 2>&1; then
  [[ -n $accel ]] || { echo "tpu_pod.sh: no TPU VM $name in $zone; pass --accelerator-type to create it" >&2; exit 2; }
  create=("${tpu[@]}" create "$name" "${where[@]}" --accelerator-type "$accel" --version "$version")
  (( spot )) && create+=(--spot)
  step "${create[@]}"
fi

# 2. the code (tracked files, uncommitted edits included), the config if git does not track
# it, the run's scripts (.jarl/), and the --sync paths
stamp=$(date +%Y%m%d-%H%M%S)
log="\$HOME/jarl-train-$stamp.log"  # expanded on the workers
run_config=$config
git ls-files --error-unmatch "$config" >/dev/null 2>&1 || run_config=.jarl/$(basename "$config")
bundle=${TMPDIR:-/tmp}/jax_agent_rl-$$.tar
stage=$(mktemp -d)
trap 'rm -rf "$stage" "$bundle" "$bundle.gz"' EXIT
mkdir -p "$stage/.jarl"
[[ $run_config == "$config" ]] || cp "$config" "$stage/$run_config"
# every worker runs .jarl/run.sh detached (a dropped ssh does not stop the run): the train
# command, its output to the log, its exit code beside it
cat > "$stage/.jarl/run.sh" <<SCRIPT
#!/usr/bin/env bash
cd "\$(dirname "\$0")/.."
echo \$\$ > "$log.pid"
.venv/bin/python -m jax_agent_rl.cli train $(printf '%q ' "$run_config" "$@")--distributed >> "$log" 2>&1
echo \$? > "$log.rc"
SCRIPT
# worker 0 follows its log (process 0's) until the run ends, then exits with the run's code
cat > "$stage/.jarl/follow.sh" <<SCRIPT
#!/usr/bin/env bash
until [ -f "$log.pid" ]; do sleep 1; done
tail -n +1 -F --pid="\$(cat "$log.pid")" "$log" 2>/dev/null
exit "\$(cat "$log.rc" 2>/dev/null || echo 1)"
SCRIPT
if (( dry )); then
  echo "+ git ls-files -z | tar --null -cf $bundle -T - && tar -rf $bundle .jarl && gzip $bundle"
  for file in "$stage"/.jarl/*; do
    echo "# .jarl/$(basename "$file"):"
    sed 's/^/#   /' "$file"
  done
else
  git ls-files -z | tar --null -cf "$bundle" -T -
  tar -rf "$bundle" -C "$stage" .jarl
  gzip -f "$bundle"
fi
step "${tpu[@]}" scp "$bundle.gz" "$name:/tmp/jax_agent_rl.tgz" "${where[@]}" --worker=all
on_all "mkdir -p $dir && tar -xzf /tmp/jax_agent_rl.tgz -C $dir"
for path in "${sync[@]}"; do
  abs=$(realpath -m "$path")
  [[ -e $abs ]] || (( dry )) || { echo "tpu_pod.sh: --sync $path does not exist" >&2; exit 2; }
  on_all "mkdir -p $(printf '%q' "$(dirname "$abs")")"
  step "${tpu[@]}" scp --recurse "$abs" "$name:$(dirname "$abs")/" "${where[@]}" --worker=all
done

# 3. the environment on every worker
# (TPU VM images ship Ubuntu 22.04 with Python 3.10: the project needs 3.11; bubblewrap is the
# python tool's sandbox; apt waits for a fresh VM's unattended upgrades to release its lock)
apt="sudo apt-get -o DPkg::Lock::Timeout=600"
on_all "command -v python3.11 >/dev/null && command -v bwrap >/dev/null || ($apt update -qq && $apt install -y -qq python3.11 python3.11-venv bubblewrap)"
on_all "cd $dir && PYTHON=python3.11 bash scripts/setup.sh tpu"
if [[ $backend == jetstream ]]; then  # each worker's JetStream server: its venv, with libtpu
  on_all "cd $dir && PYTHON=python3.11 bash scripts/setup.sh jetstream"
fi

# 4. the run: started on every worker at once, worker 0's log followed here; Ctrl-C or
# SIGTERM stop it on every worker
on_all "cd $dir && setsid nohup bash .jarl/run.sh > /dev/null 2>&1 < /dev/null &"
stop() {
  echo "tpu_pod.sh: stopping the run on every worker" >&2
  on_all "pkill -INT -f 'jax_agent_rl.cli train' || true"
  exit 130
}
trap stop INT TERM
follow=("${tpu[@]}" ssh "$name" "${where[@]}" --worker=0 --command "bash $dir/.jarl/follow.sh")
echo "+ ${follow[*]}"
(( dry )) && exit 0
"${follow[@]}" &
wait $!  # in the background, so that a signal runs the trap at once
