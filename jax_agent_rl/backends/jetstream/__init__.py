"""The JetStream rollout backend: this project's engine served by JetStream's orchestrator and
gRPC server, in a process of its own, behind the `RolloutBackend` protocol.

Its halves run under different interpreters, so this package imports nothing itself:

- `client` (the project's venv): `JetStreamBackend`, which starts and stops the server process,
  speaks JetStream's gRPC API and pushes weights;
- `server` (``.venv-jetstream``, with JetStream and its TensorFlow): the server process;
- `engine` and `compat` (``.venv-jetstream``): our `Engine` behind JetStream's ``Engine``
  interface, and the shims JetStream 0.2.2 needs on current JAX (JetStream's license notice:
  third_party/jetstream/).
"""
