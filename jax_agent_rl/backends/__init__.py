"""The external rollout backends, one home each: `vllm` (vLLM's ``AsyncLLM`` engines in
processes under ``.venv-vllm``, each running the jarl-gpu-backend distribution's engine,
``gpu_backend/``) and `jetstream` (this project's engine under JetStream's server, in a process
under ``.venv-jetstream``), and `worker`, the ``main`` every engine process runs.

Nothing else in jax_agent_rl imports this package: the registry (`jax_agent_rl.rollout.registry`)
reaches each backend through its entry point (pyproject.toml), only when a run names it. This
file imports nothing, so that an engine's interpreter (the vLLM venv has no JAX) can import
what its engine shares with the backend (`worker`, `vllm.wire`).
"""
