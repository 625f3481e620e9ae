"""Test setup: 8 simulated CPU devices, set before jax is imported anywhere."""
import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")  # libtpu is installed; this is not a TPU VM.
# Only AOT compilation uses libtpu here; let it load beside another process doing the same.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
