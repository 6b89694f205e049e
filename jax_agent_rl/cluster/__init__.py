"""The hosts and devices of a run: the JAX processes of a multi-controller run
(`distributed`), the Ray cluster that rollout replicas and tool servers join (`ray`), and the
turns that threads sharing this process's devices take on them (`device_turns`)."""
