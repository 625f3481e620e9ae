"""Test setup: 8 simulated CPU devices, set before jax is imported anywhere."""
import os
import tempfile

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")  # libtpu is installed; this is not a TPU VM.
# Only AOT compilation uses libtpu here; let it load beside another process doing the same.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

# One persistent compilation cache for the whole session, shared with the subprocesses the
# tests start (they inherit the environment): the launcher tests compile the same train step in
# many runs. A fresh folder each session, so nothing carries over between sessions.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", tempfile.mkdtemp(prefix="moe-hk-jax-cache-"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
