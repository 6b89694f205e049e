"""Test setup: 8 fake CPU devices (so sharding code really runs)."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

jax.config.update("jax_num_cpu_devices", 8)
