"""Every config file (and every variant) loads and validates."""

import importlib.util
import pathlib

import ml_collections
import pytest
from lm import setup as experiment

from spare_jax.scenario import Scenario

CONFIGS = sorted((pathlib.Path(__file__).resolve().parents[1] / "configs").glob("*.py"))


def _load(path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_loads(path):
    module = _load(path)
    variants = getattr(module, "VARIANTS", (None,))
    for arg in variants:
        config = module.get_config(arg)
        assert isinstance(config, ml_collections.ConfigDict)
        if "model" in config and "strategy" in config:  # a training config
            experiment.validate(config)
            assert len(config.mesh) == 3
        if hasattr(module, "to_scenario"):  # a scenario config: a valid Scenario
            assert isinstance(module.to_scenario(config), Scenario)


def test_training_config_found_and_smoke_is_smaller():
    module = _load(next(p for p in CONFIGS if p.name == "lm_tiny.py"))
    full, smoke = module.get_config(), module.get_config("smoke")
    assert smoke.steps < full.steps and smoke.model.d_model < full.model.d_model
    with pytest.raises(ValueError):
        module.get_config("bogus")
