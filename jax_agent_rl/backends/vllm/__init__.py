"""The vLLM rollout backend: vLLM engines in their own processes behind the `RolloutBackend`
protocol, with weight sync from the JAX learner.

Its two halves run under different interpreters, so this package imports nothing itself:

- `backend` (the project's venv, with JAX): `VLLMBackend`, which starts, routes to and stops
  the engine processes and pushes weights;
- `worker` (``.venv-vllm``, with vLLM and no JAX): one engine process, vLLM's v1 ``AsyncLLM``
  behind a pipe, and the worker extension that loads pushed weights;
- `wire`: what both sides share, the message framing and the weight-buffer layout (standard
  library and numpy only);
- `cuda_ipc`: the CUDA push's transport, the learner's weights as one CUDA IPC handle (JAX and
  torch on the sending side, torch on the receiving one), checked by bench/cuda_push_check.py;
  the backend does not use it yet (docs/vllm.md).
"""
