"""jarl-gpu-backend: the serving side of jax_agent_rl's vLLM rollout backend, installed into
the vLLM environment (``.venv-vllm``, by ``scripts/setup.sh vllm``).

- `worker`: one vLLM engine process, vLLM's v1 ``AsyncLLM`` behind a pipe, and the worker
  extension that loads pushed weights. The backend (`jax_agent_rl.backends.vllm`, in the
  trainer's environment) runs it as ``python -m jarl_gpu_backend.worker CONFIG_JSON``.

The engine process speaks the message framing and weight layout of
`jax_agent_rl.backends.vllm.wire` and runs under `jax_agent_rl.backends.worker`'s ``main``:
both sides share those two modules (standard library and numpy only), found on the path the
backend gives the process (``PYTHONPATH``, the repository root). This file imports nothing.
"""
