"""spare_jax.jax_internals: the JAX internals in use exist, and a missing one fails in one line."""

import importlib
import subprocess
import sys

import jax
import jaxlib
import orbax.checkpoint as ocp
import pytest
from jax.experimental import multihost_utils
from jaxlib import _jax

from spare_jax import jax_internals


def _one_line_naming(err: jax_internals.UnsupportedJax, missing: str) -> None:
    text = str(err)
    assert "\n" not in text
    assert f"JAX {jax.__version__} (jaxlib {jaxlib.__version__}, Orbax {ocp.__version__})" in text
    assert missing in text


def test_installed_jax_has_everything() -> None:
    jax_internals.check()
    jax.devices()
    assert jax_internals.backends_started() is True
    assert jax_internals.client() is None  # a lone process: no job
    assert isinstance(jax_internals.live_devices_cache(), dict)


def test_missing_function_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(_jax, "get_distributed_runtime_client")
    with pytest.raises(jax_internals.UnsupportedJax) as err:
        jax_internals.check()
    _one_line_naming(err.value, "jaxlib._jax.get_distributed_runtime_client")


def test_missing_attribute_of_an_object_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(multihost_utils.live_devices, "devices")
    with pytest.raises(jax_internals.UnsupportedJax) as err:
        jax_internals.check()
    _one_line_naming(err.value, "jax.experimental.multihost_utils.live_devices.devices")


def test_orbax_barrier_timeout_holds_inside_the_block_only() -> None:
    orbax_multihost = importlib.import_module("orbax.checkpoint._src.multihost.multihost")
    was = orbax_multihost.coordination_timeout()
    with jax_internals.orbax_barrier_timeout(17):
        assert orbax_multihost.coordination_timeout() == 17
        with jax_internals.orbax_barrier_timeout(0):  # nested; never below 1 s
            assert orbax_multihost.coordination_timeout() == 1
        assert orbax_multihost.coordination_timeout() == 17
    assert orbax_multihost.coordination_timeout() == was
    with pytest.raises(RuntimeError), jax_internals.orbax_barrier_timeout(9):
        raise RuntimeError("a save failed")
    assert orbax_multihost.coordination_timeout() == was


def test_missing_orbax_constant_named(monkeypatch: pytest.MonkeyPatch) -> None:
    orbax_multihost = importlib.import_module("orbax.checkpoint._src.multihost.multihost")
    monkeypatch.delattr(orbax_multihost, "_DEFAULT_BARRIER_TIMEOUT")
    with pytest.raises(jax_internals.UnsupportedJax) as err:
        jax_internals.check()
    _one_line_naming(
        err.value, "orbax.checkpoint._src.multihost.multihost._DEFAULT_BARRIER_TIMEOUT"
    )


def test_missing_module_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "jax._src.xla_bridge", None)  # import raises
    with pytest.raises(jax_internals.UnsupportedJax) as err:
        jax_internals.check()
    _one_line_naming(err.value, "module jax._src.xla_bridge")


def test_renamed_keyword_named(monkeypatch: pytest.MonkeyPatch) -> None:
    def factory(*args: object, **kwargs: object) -> None:
        pass

    # A compiled function's signature line, without missed_heartbeat_callback.
    factory.__doc__ = (
        "get_distributed_runtime_client(address: str, node_id: int, init_timeout: int | None"
        " = None, shutdown_timeout: int | None = None, heartbeat_timeout: int | None = None,"
        " use_compression: bool | None = None) -> object"
    )
    monkeypatch.setattr(_jax, "get_distributed_runtime_client", factory)
    with pytest.raises(jax_internals.UnsupportedJax) as err:
        jax_internals.check()
    _one_line_naming(err.value, "'missed_heartbeat_callback'")


def test_no_signature_to_read_is_not_a_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_jax, "get_distributed_runtime_service", lambda *a, **k: None)
    jax_internals.check()


def test_import_fails_in_one_line_without_the_name() -> None:
    """What a user sees: importing the multi-process code under a JAX that lacks a name."""
    code = (
        "import jaxlib._jax as j; del j.get_distributed_runtime_service; import spare_jax.multihost"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120
    )
    assert run.returncode != 0
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("spare_jax.jax_internals.UnsupportedJax: spare_jax cannot run on JAX ")
    assert f"JAX {jax.__version__} " in last
    assert "jaxlib._jax.get_distributed_runtime_service" in last
    assert "AttributeError" not in run.stderr
