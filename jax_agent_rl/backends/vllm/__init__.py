"""The vLLM rollout backend: vLLM engines in their own processes behind the `RolloutBackend`
protocol, with weight sync from the JAX learner.

Its two halves run under different interpreters, so this package imports nothing itself:

- `backend` (the project's venv, with JAX): `VLLMBackend`, which starts, routes to and stops
  the engine processes and pushes weights;
- ``jarl_gpu_backend.worker`` (``.venv-vllm``, with vLLM and no JAX): one engine process,
  vLLM's v1 ``AsyncLLM`` behind a pipe, and the worker extension that loads pushed weights.
  It is not in this package: it is the jarl-gpu-backend distribution (``gpu_backend/``),
  which ``scripts/setup.sh vllm`` installs into the vLLM venv;
- `wire`: what both sides share, the message framing and the weight-buffer layout (standard
  library and numpy only; the engine process imports it from the repository on its path);
- `engines`: the backend's view of one engine process, and the check that an interpreter can
  run one;
- `cuda_ipc`: the CUDA push's transport, the learner's weights as one CUDA IPC handle (JAX and
  torch on the sending side, torch on the receiving one), checked by bench/cuda_push_check.py;
  the backend does not use it yet (docs/vllm.md).
"""
