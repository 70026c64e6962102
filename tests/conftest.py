"""Test setup: 8 virtual CPU devices, float32 defaults. Must run before jax is imported."""

import os

from jaxpipe.xla_flags import cpu_devices  # (imports no jax)

cpu_devices(8)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
