"""Test set-up: eight simulated CPU devices, configured before JAX starts its backend.

``experiments/`` goes on ``sys.path`` so that tests import the demo LM as ``lm``.

Compiled programs go to a persistent compilation cache for the session, so a
test that builds the same step as an earlier one loads it instead of
compiling it again (removed at exit).
"""

import atexit
import os
import pathlib
import shutil
import sys
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The demo LM lives with the binaries that use it (experiments/lm), not in the library.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "experiments"))

import jax

jax.config.update("jax_num_cpu_devices", 8)
_CACHE = tempfile.mkdtemp(prefix="spare_jax_test_cache_")
atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
