"""Test set-up: eight simulated CPU devices, configured before JAX starts its backend.

Compiled programs go to a persistent compilation cache for the session, so a
test that builds the same step as an earlier one loads it instead of
compiling it again (removed at exit).
"""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

jax.config.update("jax_num_cpu_devices", 8)
_CACHE = tempfile.mkdtemp(prefix="spare_jax_test_cache_")
atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
