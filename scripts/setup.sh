#!/usr/bin/env bash
# Creates or refreshes .venv with the pinned stack of requirements/lock.txt. Idempotent: a stamp
# holds the hash of the inputs, so a second run with nothing changed returns at once.
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3}
stamp=.venv/.setup-stamp
want=$(cat requirements/lock.txt pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [[ -f $stamp && "$(cat "$stamp")" == "$want" ]]; then
  exit 0
fi

"$python" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' \
  || { echo "setup: Python 3.11 is required ($python is $("$python" --version))" >&2; exit 1; }
[[ -x .venv/bin/python ]] || "$python" -m venv .venv
echo "setup: installing the pinned environment into .venv (first run takes a few minutes)"
.venv/bin/python -m pip install --quiet --disable-pip-version-check -r requirements/lock.txt
.venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
# torchvision/torchaudio/torchcodec from PyPI break `import torch` beside the CPU wheel.
for pkg in torchvision torchaudio torchcodec; do
  if .venv/bin/python -m pip show --quiet "$pkg" 2>/dev/null; then
    .venv/bin/python -m pip uninstall --quiet -y "$pkg"
  fi
done
.venv/bin/python -c 'import jax, torch, transformers, jax_agent_rl' \
  || { echo "setup: the environment does not import; see the errors above" >&2; exit 1; }
echo "$want" > "$stamp"
echo "setup: .venv is ready"
