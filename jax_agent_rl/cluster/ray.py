"""Joining the Ray cluster of ``engine.ray.address``: one connection per process, shared by
the rollout replicas (`jax_agent_rl.rollout.ray_pool`) and the tool servers
(`jax_agent_rl.tools.ray_servers`); whoever connected disconnects."""

from __future__ import annotations

import logging
import os
import socket

REACH_TIMEOUT_S = 10.0  # a head that does not accept a connection within this is unreachable


def connect(address: str) -> bool:
    """Joins the cluster at ``address`` ("auto": the one this machine belongs to; "local": a
    new one-node cluster here; else the head's HOST:PORT) unless this process is connected
    already; returns whether it connected (and so should disconnect)."""
    import ray

    if ray.is_initialized():
        return False
    if address not in ("auto", "local"):  # Ray itself retries an unreachable head for minutes
        host, _, port = address.removeprefix("ray://").rpartition(":")
        try:
            socket.create_connection((host, int(port)), timeout=REACH_TIMEOUT_S).close()
        except (OSError, ValueError) as e:
            raise RuntimeError(
                f"engine.ray.address={address!r}: no Ray head answers there ({e})"
            ) from None
    if address == "local":
        # Ray starts its workers at niceness 15: the replicas (the run's rollout engines) and
        # the tool servers then got almost no CPU beside the learner on a CPU machine (an
        # engine compiled 5x slower than in the trainer's own process); a cluster of the user's
        # own ("auto", HOST:PORT) keeps what its head was started with
        os.environ.setdefault("RAY_worker_niceness", "0")
    ray.init(
        # "local" to Ray itself: a new cluster even when this machine runs one (with None, Ray
        # joins the cluster /tmp/ray/ray_current_cluster names: another job's, or a dead one)
        address=address,
        include_dashboard=False,
        logging_level=logging.WARNING,
        configure_logging=False,
    )
    return True


def disconnect(connected: bool) -> None:
    """Leaves the cluster if `connect` joined it (``connected``)."""
    import ray

    if connected and ray.is_initialized():
        ray.shutdown()
