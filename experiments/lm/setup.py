"""The experiment a training config describes: checks, model, data, optimizer and SPARe step.

The project's demo LM, one client of `spare_jax.fit` among others.
`validate` refuses a bad config up front with a `ValueError` naming the field
and the rule (NaN and infinity included); `setup` builds the `Run`: the
Flax LM and its parameters, the token source, and the step from
`spare_jax.make_train_step` (the same public entry point any model uses).
`experiments/train.py` then trains it through failures with `spare_jax.fit`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import ml_collections
import numpy as np
import optax
from lm import data as data_lib
from lm import model as model_lib

from spare_jax import checks, strategies
from spare_jax import mesh as mesh_lib
from spare_jax import train_step as step_lib

__all__ = ["LIMITS", "Run", "make_optimizer", "setup", "validate"]

# Refused up front: sizes past these run for hours on the CPU this targets or
# exhaust its memory, and are almost always a typo.
LIMITS = {"steps": 10**7, "batch": 2**16, "microbatches": 2**10, "redundancy": 2**10}


def make_optimizer(
    learning_rate: float,
    warmup_steps: int,
    total_steps: int,
    weight_decay: float = 0.01,
    clip_norm: float = 0.0,
) -> optax.GradientTransformation:
    """AdamW with linear warm-up then cosine decay to 10% (optional global-norm clipping)."""
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=learning_rate,
        warmup_steps=max(warmup_steps, 1),
        decay_steps=max(total_steps, warmup_steps + 1),
        end_value=0.1 * learning_rate,
    )
    adamw = optax.adamw(schedule, b1=0.9, b2=0.98, eps=1e-8, weight_decay=weight_decay)
    return optax.chain(optax.clip_by_global_norm(clip_norm), adamw) if clip_norm > 0 else adamw


def validate(config: ml_collections.ConfigDict) -> None:
    """Raise ValueError naming the first bad setting of a training config."""
    strategies.canonical(config.strategy)
    strategies.check_policy(config.policy)
    axes = mesh_axes(config)
    for name, size in axes:
        checks.integer(f"mesh {name} size", size, low=1, high=4096)
    mesh = (axes[0][1], axes[1][1])  # data, redundancy: the groups
    for name, high in LIMITS.items():
        checks.integer(name, config[name], low=1, high=high)
    checks.integer("slot_bound", config.slot_bound, low=0)
    checks.integer("seed", config.seed, low=0, high=2**32 - 1)
    checks.number("learning_rate", config.learning_rate, low=0.0, low_open=True, high=10.0)
    checks.integer("warmup_steps", config.warmup_steps, low=0)
    checks.number("weight_decay", config.weight_decay, low=0.0)
    checks.number("clip_norm", config.clip_norm, low=0.0)
    checks.integer("log_every", config.log_every, low=1)
    ck = config.checkpoint
    checks.integer("checkpoint.steps", ck.steps, low=0)
    checks.integer("checkpoint.keep", ck.keep, low=1, high=1000)
    checks.integer("checkpoint.warmup_steps", ck.warmup_steps, low=1)
    checks.integer("checkpoint.max_rollbacks", ck.max_rollbacks, low=0)
    checks.number("checkpoint.gpu_mtbf_hours", ck.gpu_mtbf_hours, low=0.0, low_open=True)
    kind = strategies.canonical(config.strategy)
    redundancy = 1 if kind == "dp" else int(config.redundancy)
    ring = int(mesh[1]) if kind == "spare" and int(mesh[1]) >= redundancy else None
    strategies.placement(kind, int(mesh[0]) * int(mesh[1]), redundancy, ring_size=ring)
    model_lib.ModelConfig(**config.model).validate()
    checks.choice("data.kind", config.data.kind, ("markov", "file"))
    if config.data.kind == "file":
        _check_token_file(config.data.path, config.model.vocab, config.model.seq_len)
    else:
        checks.integer("data.branching", config.data.branching, low=1, high=config.model.vocab)


def _check_token_file(path: str, vocab: int, seq_len: int) -> None:
    if not path:
        raise ValueError("data.path must name a uint16 .bin token file when data.kind='file'")
    try:
        tokens = np.memmap(path, dtype=np.uint16, mode="r")
    except (OSError, ValueError) as err:
        raise ValueError(f"data.path {path!r} cannot be read: {err}") from None
    if tokens.size < seq_len + 2:
        raise ValueError(f"data.path {path!r} holds {tokens.size} tokens, fewer than seq_len + 2")
    top = int(tokens.max())
    if top >= vocab:
        raise ValueError(f"data.path {path!r} holds token id {top}, outside model.vocab={vocab}")


@dataclasses.dataclass
class Run:
    """Everything the loop needs, built once from a config (`setup`)."""

    config: ml_collections.ConfigDict
    step: step_lib.SpareStep
    init: Callable[[], Any]  # builds the initial parameters: `fit` runs it in their shards
    source: data_lib.TokenSource
    units: int

    @functools.cached_property
    def params(self) -> Any:
        """The initial parameters, built here on first use (eagerly, on this process)."""
        return self.init()

    @property
    def groups(self) -> int:
        return self.step.groups

    def fresh_state(self) -> step_lib.TrainState:
        return self.step.init(self.params)

    def batch(self, step: int) -> np.ndarray:
        return data_lib.global_batch(self.source, self.units, step)


def _source(config: ml_collections.ConfigDict) -> data_lib.TokenSource:
    m = config.model
    if config.data.kind == "markov":
        return data_lib.MarkovSource(
            m.vocab, m.seq_len, config.batch, seed=config.seed, branching=config.data.branching
        )
    return data_lib.TokenFileSource(
        config.data.path, m.vocab, m.seq_len, config.batch, seed=config.seed
    )


def mesh_axes(config: ml_collections.ConfigDict) -> tuple[tuple[str, int], ...]:
    """The named mesh axes: ``config.mesh_axes`` if set, else the three ``config.mesh`` sizes."""
    named = config.get("mesh_axes", "")
    return mesh_lib.parse_axes(named if named else tuple(config.mesh))


def layout(mesh: jax.sharding.Mesh, params: Any) -> tuple[Any, tuple[str, ...]]:
    """The LM's parameter specs and batch axes on a mesh with any inner axes.

    The logical rules shard heads and the MLP over ``model``; on a mesh that
    names its inner axes otherwise, over the last of them (tensor-style), and
    a first of two or more splits each micro-batch's rows (FSDP-style).
    """
    specs = model_lib.param_specs(params)
    inner = mesh_lib.inner_axes(mesh)
    if "model" in inner:
        return specs, ()
    rename = lambda p: jax.P(*(inner[-1] if a == "model" else a for a in p))
    specs = jax.tree.map(rename, specs, is_leaf=lambda x: isinstance(x, jax.P))
    return specs, (inner[0],) if len(inner) > 1 else ()


def setup(config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh | None = None) -> Run:
    """Mesh, model, data and the SPARe step for a config (validated here).

    Args:
        config: the training config.
        mesh: the mesh (default: ``config.mesh`` over the job's devices).
    """
    validate(config)
    mesh = mesh_lib.make_mesh(mesh_axes(config)) if mesh is None else mesh
    kind = strategies.canonical(config.strategy)
    cfg = model_lib.ModelConfig(**config.model)
    graphdef, init = model_lib.param_initializer(cfg, config.seed)  # built where needed
    specs, batch_axes = layout(mesh, mesh_lib.shaped(init))
    tx = make_optimizer(
        config.learning_rate,
        config.warmup_steps,
        config.steps,
        config.weight_decay,
        config.clip_norm,
    )
    step = step_lib.make_train_step(
        functools.partial(model_lib.loss_fn, graphdef),
        tx,
        mesh,
        strategy=kind,
        redundancy=1 if kind == "dp" else int(config.redundancy),
        microbatches=int(config.microbatches),
        policy=config.policy,
        param_specs=specs,
        batch_axes=batch_axes,
        slot_bound=int(config.slot_bound) or None,
    )
    units = step.placement.shards * step.placement.shard_units * step.microbatches
    return Run(config, step, init, _source(config), units)
