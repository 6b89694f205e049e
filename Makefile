# The project's commands. Each one sets up .venv first (idempotent, pinned; see scripts/setup.sh).
PY := .venv/bin/python
export JAX_PLATFORMS ?= cpu
# test processes: each takes whole test files (module fixtures are built once), and the
# session's memorised models are trained once and shared (tests/conftest.py)
TEST_WORKERS ?= 2

.PHONY: setup demo test-envs test lint bench clean

setup:
	@bash scripts/setup.sh

demo: setup  ## the main job on the embedded defaults
	$(PY) -m jax_agent_rl.cli demo

test-envs: setup  ## what the suite needs beside .venv: the vLLM and JetStream backends' tests run their engines under .venv-vllm, .venv-jetstream; verl parity tests import the real verl from .verl-ref; the view's tests open it in headless chromium; the TPU plan's tests compile for TPU topologies with the locked libtpu
	@bash scripts/setup.sh vllm
	@bash scripts/setup.sh jetstream
	@bash scripts/setup.sh verl-ref
	@bash scripts/setup.sh chromium
	@bash scripts/setup.sh tpu-plan

test: test-envs  ## the whole suite
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

lint: setup  ## ruff (lint + format check) and mypy
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy

bench: setup  ## benchmarks; each ends by printing one JSON line of its figures
	@bash scripts/setup.sh vllm
	@bash scripts/setup.sh jetstream
	$(PY) bench/decode.py --backends embedded,jetstream,vllm
	$(PY) bench/forward.py
	$(PY) bench/tools.py
	$(PY) bench/rollout.py --backends embedded,vllm
	$(PY) bench/weight_push.py
	$(PY) bench/async.py
	$(PY) bench/learner.py --workload uniform
	$(PY) bench/learner.py --workload long_tail
	$(PY) bench/traces.py

clean:
	rm -rf .venv .venv-vllm .venv-jetstream .verl-ref .uv .pytest_cache .mypy_cache .ruff_cache .cache
