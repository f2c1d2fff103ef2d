"""The failure-masked train step: exact gradient synchronisation over live groups.

Owns: the train state, the optimizer, the *slot plan* (an assignment from
`spare_jax.reorder` turned into padded runtime arrays), the pure `train_step`, and
`TrainStep`, the one builder that adds shardings, donation and the compiled
slot bound.

**The step.** Inside a ``jax.shard_map`` that is manual over the group axes
``("data", "redundancy")`` and automatic over ``"model"`` (so XLA partitions each
group's computation over its model devices from the parameters' shardings),
every group walks the plan's work slots. Slot ``l`` of group ``g`` names a local
micro-batch of ``g``'s stack (``index[g, l]``, or -1 for an empty slot) and a
weight (1 when it counts, 0 for empty slots and replication's redundant
copies). The loop runs ``n_slots`` = the plan's maximum load iterations on every
group (a runtime scalar, so step time follows the load without recompiling);
SPMD control flow must not diverge between devices (a per-device ``lax.cond``
deadlocks XLA's CPU collectives), so a group with fewer slots computes its
empty ones with weight 0, which is what it would spend waiting for the slowest
group anyway. The group accumulates ``weight * grad``, its
sum is multiplied by its live mask (a dead group contributes exactly zero), and
one ``psum`` over ``("data", "redundancy")`` adds the groups. The sum is divided
by ``denom = G * m`` (failure-free micro-batch count, never the live count) and
AdamW is applied outside the shard_map, replicated over the groups and sharded
over ``model`` like the parameters.

**Runtime assignment.** ``index``, ``weight``, ``alive``, ``denom`` and ``n_slots``
are device arrays, not static arguments. Plans are padded to the compiled slot
bound, so a new live set only recompiles when its maximum load exceeds the
bound (which then grows to that load). The trainer's default bound is the stack
size ``r * m``, which no assignment can exceed.

**Baselines.** Replication and plain data parallelism are placements on this
same step. `drop_and_renormalise_plan` is the *inexact* elastic baseline: dead
groups' data is dropped and the rest averaged (``denom`` = live micro-batches).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
import optax.tree_utils as otu
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from spare_jax import mesh as mesh_lib
from spare_jax import model as model_lib
from spare_jax.placement import Placement
from spare_jax.reorder import Assignment

__all__ = [
    "SlotPlan",
    "TrainState",
    "TrainStep",
    "drop_and_renormalise_plan",
    "init_state",
    "make_optimizer",
    "plan_from_assignment",
    "train_step",
]


@flax.struct.dataclass
class TrainState:
    """Parameters and optimizer state (replicated over groups, sharded over model)."""

    step: jax.Array
    params: model_lib.Params
    opt_state: optax.OptState


@dataclasses.dataclass(frozen=True)
class SlotPlan:
    """One step's work as runtime arrays (host numpy).

    Attributes:
        index: int32[G, L] local micro-batch index into the group's stack, -1 empty.
        weight: float32[G, L] 1.0 when the slot's gradient counts, else 0.0.
        alive: float32[G] live mask.
        denom: the divisor of the gradient sum (``G * m`` for exact plans).
        max_load: slots actually used by the busiest group.
        exact: False only for the drop-and-renormalise baseline.
    """

    index: np.ndarray
    weight: np.ndarray
    alive: np.ndarray
    denom: float
    max_load: int
    exact: bool = True

    @property
    def slots(self) -> int:
        return int(self.index.shape[1])

    def padded(self, bound: int) -> SlotPlan:
        """The same plan with empty slots appended up to ``bound``."""
        extra = bound - self.slots
        if extra < 0:
            raise ValueError(f"plan uses {self.slots} slots, more than the bound {bound}")
        index = np.pad(self.index, ((0, 0), (0, extra)), constant_values=-1)
        weight = np.pad(self.weight, ((0, 0), (0, extra)))
        return dataclasses.replace(self, index=index, weight=weight)


def plan_from_assignment(assignment: Assignment) -> SlotPlan:
    """Turn a reorder assignment into slot arrays (local index = position * units*m + mb)."""
    p: Placement = assignment.placement
    m = assignment.microbatches
    work = np.asarray(assignment.work)
    position, micro = work[..., 0], work[..., 1]
    index = np.where(position >= 0, position * p.shard_units * m + micro, -1).astype(np.int32)
    counted = np.asarray(assignment.counted, bool)
    if np.any(counted & (index < 0)):
        raise ValueError("assignment counts an empty slot")
    alive = np.asarray(assignment.alive, bool)
    if np.any(index[~alive] >= 0):
        raise ValueError("assignment gives work to a dead group")
    total = p.shards * p.shard_units * m
    if int(counted.sum()) != total:
        raise ValueError(f"assignment counts {int(counted.sum())} micro-batches, expected {total}")
    return SlotPlan(
        index=index,
        weight=counted.astype(np.float32),
        alive=alive.astype(np.float32),
        denom=float(total),
        max_load=int(assignment.max_load),
    )


def drop_and_renormalise_plan(
    placement: Placement, alive: np.ndarray, microbatches: int
) -> SlotPlan:
    """INEXACT baseline (what elastic systems do): drop dead groups, average the rest.

    Every live group does its failure-free work (its stack position 0, counted
    once per shard by its first holder); the dead groups' work is simply lost and
    the sum is divided by the number of micro-batches that were computed.
    """
    alive = np.asarray(alive, bool)
    m, units = microbatches, placement.shard_units
    per_group = units * m
    index = np.tile(np.arange(per_group, dtype=np.int32), (placement.groups, 1))
    first_holder = np.zeros(placement.groups, bool)
    first_holder[placement.holders_table[:, 0]] = True
    weight = np.where(first_holder[:, None], 1.0, 0.0) * np.ones_like(index, np.float32)
    index[~alive] = -1
    weight[~alive] = 0.0
    computed = float(weight.sum())
    if computed == 0:
        raise ValueError("drop-and-renormalise has no live group left")
    return SlotPlan(
        index=index,
        weight=weight.astype(np.float32),
        alive=alive.astype(np.float32),
        denom=computed,
        max_load=per_group if alive.any() else 0,
        exact=False,
    )


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


def state_shardings(
    mesh: Mesh, params_shape: model_lib.Params, tx: optax.GradientTransformation
) -> TrainState:
    """Explicit NamedShardings of the whole train state."""
    is_axes = lambda x: isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x)
    axes = model_lib.param_logical_axes(params_shape)
    param_sh = jax.tree.map(
        lambda a: NamedSharding(mesh, mesh_lib.logical_spec(a)), axes, is_leaf=is_axes
    )
    opt_shape = jax.eval_shape(tx.init, params_shape)
    rep = mesh_lib.replicated(mesh)
    opt_sh = otu.tree_map_params(
        tx, lambda _, sh: sh, opt_shape, param_sh, transform_non_params=lambda _: rep
    )
    return TrainState(step=rep, params=param_sh, opt_state=opt_sh)


def init_state(
    cfg: model_lib.ModelConfig, tx: optax.GradientTransformation, mesh: Mesh, seed: int
) -> tuple[nnx.GraphDef, TrainState, TrainState]:
    """Build the model and optimizer state and place them in their shardings.

    Returns:
        ``(graphdef, state, shardings)``.
    """
    graphdef = nnx.split(
        nnx.eval_shape(lambda: model_lib.TransformerLM(cfg, nnx.Rngs(params=seed)))
    )[0]
    params_shape = jax.eval_shape(lambda: model_lib.init_params(cfg, seed)[1])
    shardings = state_shardings(mesh, params_shape, tx)
    # Built eagerly (no XLA compilation of an init program) and then placed with
    # one explicit transfer into the final shardings.
    params = model_lib.init_params(cfg, seed)[1]
    fresh = TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))
    state = jax.device_put(fresh, shardings)
    return graphdef, state, shardings


def _group_gradients(
    graphdef: nnx.GraphDef,
    params: model_lib.Params,
    tokens: jax.Array,
    index: jax.Array,
    weight: jax.Array,
    alive: jax.Array,
    n_slots: jax.Array,
) -> tuple[Any, jax.Array]:
    """One group's weighted gradient and loss sums, psum'd over the live groups.

    Runs inside shard_map: ``tokens`` [1, S, B, T+1], ``index``/``weight`` [1, L],
    ``alive`` [1] are this group's rows; ``n_slots`` (replicated) is the plan's
    maximum load, so every group runs the same number of iterations.
    """
    grad_fn = jax.value_and_grad(lambda p, batch: model_lib.loss_fn(graphdef, p, batch))
    # Differentiate with respect to a per-group ("varying") copy of the replicated
    # parameters. Differentiating the replicated ("invariant") value itself would
    # make JAX insert the psum of the transpose inside grad, summing every group's
    # slot gradient before this group's weight is applied.
    params = jax.lax.pcast(params, mesh_lib.GROUP_AXES, to="varying")
    stack = tokens[0]
    zeros = (
        jax.tree.map(jnp.zeros_like, params),
        jax.lax.pcast(jnp.zeros((), jnp.float32), mesh_lib.GROUP_AXES, to="varying"),
    )

    def slot(l: jax.Array, carry: Any) -> Any:
        i, w = index[0, l], weight[0, l]
        w = jnp.where(i >= 0, w, 0.0)
        loss, grads = grad_fn(
            params, jax.lax.dynamic_index_in_dim(stack, jnp.maximum(i, 0), keepdims=False)
        )
        return jax.tree.map(lambda acc, g: acc + g * w, carry, (grads, loss))

    grads, loss = jax.lax.fori_loop(0, n_slots, slot, zeros)
    live = alive[0]
    masked = jax.tree.map(lambda g: g * live, (grads, loss))
    return jax.lax.psum(masked, mesh_lib.GROUP_AXES)


def train_step(
    state: TrainState,
    tokens: jax.Array,
    index: jax.Array,
    weight: jax.Array,
    alive: jax.Array,
    denom: jax.Array,
    n_slots: jax.Array,
    *,
    graphdef: nnx.GraphDef,
    tx: optax.GradientTransformation,
    mesh: Mesh,
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One exact, failure-masked optimizer step (pure; jit it with `TrainStep`).

    Args:
        state: the train state.
        tokens: int32[G, S, B, T+1] every group's stack, split over the groups.
        index: int32[G, L] local micro-batch of each slot, -1 for empty.
        weight: float32[G, L] 1 where the slot's gradient counts.
        alive: float32[G] live mask.
        denom: float32 scalar divisor (``G * m``).
        n_slots: int32 scalar, slots to walk (the plan's maximum load, <= L).
        graphdef: the model's graph definition.
        tx: the optimizer.
        mesh: the mesh.

    Returns:
        The new state and ``{"loss", "grad_norm"}`` (the loss is the mean over the
        counted micro-batches, the failure-free global-batch loss).
    """
    group = PartitionSpec(mesh_lib.GROUP_AXES)
    synced = jax.shard_map(
        lambda p, t, i, w, a, n: _group_gradients(graphdef, p, t, i, w, a, n),
        mesh=mesh,
        in_specs=(PartitionSpec(), group, group, group, group, PartitionSpec()),
        out_specs=PartitionSpec(),
        axis_names=set(mesh_lib.GROUP_AXES),
    )
    grad_sum, loss_sum = synced(state.params, tokens, index, weight, alive, n_slots)
    grads = jax.tree.map(lambda g: g / denom, grad_sum)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {"loss": loss_sum / denom, "grad_norm": optax.tree.norm(grads)}
    return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics


class TrainStep:
    """`train_step` jitted with explicit shardings, donated state and a slot bound.

    Attributes:
        slot_bound: the number of slots the current executable walks.
        compiles: how many times the step has been traced/compiled.
    """

    def __init__(
        self,
        mesh: Mesh,
        graphdef: nnx.GraphDef,
        tx: optax.GradientTransformation,
        shardings: TrainState,
        slot_bound: int,
    ):
        if slot_bound < 1:
            raise ValueError(f"slot_bound must be >= 1, got {slot_bound}")
        self.mesh, self.slot_bound, self.compiles = mesh, int(slot_bound), 0
        self._group = mesh_lib.group_sharding(mesh)
        self._rep = mesh_lib.replicated(mesh)
        self._device_plans: dict[tuple, tuple[jax.Array, ...]] = {}

        def counted_step(*args: Any) -> Any:
            self.compiles += 1  # runs only while tracing, i.e. once per compilation
            return train_step(*args, graphdef=graphdef, tx=tx, mesh=mesh)

        self._jitted: Callable[..., Any] = jax.jit(
            counted_step,
            in_shardings=(
                shardings,
                self._group,
                self._group,
                self._group,
                self._group,
                self._rep,
                self._rep,
            ),
            out_shardings=(shardings, self._rep),
            donate_argnums=(0,),
        )

    def put_tokens(self, tokens: np.ndarray) -> jax.Array:
        """Explicit host-to-device transfer of the stacked input, split over groups."""
        return jax.device_put(tokens, self._group)

    def put_plan(self, plan: SlotPlan) -> tuple[jax.Array, ...]:
        """Pad a plan to the slot bound (growing the bound if needed) and place it.

        Device copies are cached per plan content, so an unchanged live set costs
        no transfer at all.
        """
        self.slot_bound = max(self.slot_bound, plan.slots)
        plan = plan.padded(self.slot_bound)
        key = (plan.index.tobytes(), plan.weight.tobytes(), plan.alive.tobytes(), plan.denom)
        if key not in self._device_plans:
            if len(self._device_plans) > 64:
                self._device_plans.clear()
            self._device_plans[key] = (
                jax.device_put(plan.index, self._group),
                jax.device_put(plan.weight, self._group),
                jax.device_put(plan.alive, self._group),
                jax.device_put(np.float32(plan.denom), self._rep),
                jax.device_put(np.int32(plan.max_load), self._rep),
            )
        return self._device_plans[key]

    def __call__(
        self, state: TrainState, tokens: jax.Array, plan: tuple[jax.Array, ...]
    ) -> tuple[TrainState, dict[str, jax.Array]]:
        """Run one step on device arrays (see `put_tokens`, `put_plan`)."""
        return self._jitted(state, tokens, *plan)
