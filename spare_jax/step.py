"""The pure failure-masked step: the train state, each group's gradients, the masked sum
across groups, and the update. Functions of arrays only (no cache, no I/O):
`spare_jax.train_step.SpareStep` wraps them with shardings, donation and the slot
tables, and `spare_jax.domains` runs them per failure domain.

Inside a ``jax.shard_map`` that is manual over the group axes
``("data", "redundancy")`` and automatic over the inner axes (XLA partitions
each group's computation from the parameters' and the stacks' shardings: FSDP,
tensor, any layout the user names), every group walks its own slots, up to its
last filled one (the loop's trip count is data, so a new live set or a lighter
group is not a new program). Slot ``l`` of group ``g`` computes the gradient
of local micro-batch ``index[g, l]`` and adds ``weight[g, l]`` times it, in
float32 at least (``accum_dtype``); no collective across groups runs in the loop. Each
group's sum is multiplied by its live mask, one ``psum`` over the groups adds
them (`reduce_step`), the sum is scaled by ``1 / denom`` (``denom = G * m``,
never the live count), cast to the parameters' dtype, and
the optimizer is applied, replicated over the groups (`update_step`). One
process runs both fused (`train_step`); a multi-process job runs them as two
programs (``split``) so that only the update, which crosses no group, takes
the donated state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, PartitionSpec

from spare_jax import mesh as mesh_lib
from spare_jax import slots

__all__ = [
    "LossFn",
    "TrainState",
    "accumulator",
    "group_gradients",
    "reduce_step",
    "train_step",
    "update_step",
]

LossFn = Callable[[Any, Any], jax.Array]


@flax.struct.dataclass
class TrainState:
    """Step count, parameters and optimizer state (replicated over groups)."""

    step: jax.Array
    params: Any
    opt_state: optax.OptState


def accumulator(dtype: Any, accum_dtype: Any) -> np.dtype:
    """The dtype gradients of a ``dtype`` leaf are summed in: at least ``accum_dtype``."""
    return np.dtype(jnp.promote_types(dtype, accum_dtype))


def group_gradients(
    loss_fn: LossFn,
    params: Any,
    stacks: Any,
    table: slots.Slots,
    accum_dtype: Any,
    reduce: bool = True,
) -> tuple[Any, jax.Array]:
    """One group's weighted gradient and loss sums, psum'd over the live groups.

    Runs inside shard_map, manual over the group axes: ``stacks`` leaves are
    ``[1, S, b, ...]`` (this group's stack; rows split over the batch's inner
    axes by XLA), ``table.index``/``weight`` are ``[1, L]``, ``table.alive`` is
    ``[1]``. Sums run in ``accum_dtype`` (at least), whatever the parameters' dtype.
    """
    grad_fn = jax.value_and_grad(loss_fn)
    # Differentiate a per-group ("varying") copy of the replicated parameters:
    # differentiating the replicated value itself makes JAX put the transpose's
    # psum inside grad, summing every group's slot gradient before its weight.
    params = jax.lax.pcast(params, mesh_lib.GROUP_AXES, to="varying")
    local = jax.tree.map(lambda x: x[0], stacks)
    zero_loss = jax.lax.pcast(jnp.zeros((), jnp.float32), mesh_lib.GROUP_AXES, to="varying")
    zeros = lambda p: jnp.zeros_like(p, dtype=accumulator(p.dtype, accum_dtype))
    carry0 = (jax.tree.map(zeros, params), zero_loss)

    def slot(k: jax.Array, carry: Any) -> Any:
        i = table.index[0, k]
        w = jnp.where(i >= 0, table.weight[0, k], 0.0)
        pick = lambda x: jax.lax.dynamic_index_in_dim(x, jnp.maximum(i, 0), keepdims=False)
        loss, grads = grad_fn(params, jax.tree.map(pick, local))
        grad_acc, loss_acc = carry
        grad_acc = jax.tree.map(
            lambda acc, g: acc + g.astype(acc.dtype) * w.astype(acc.dtype), grad_acc, grads
        )
        return grad_acc, loss_acc + loss.astype(jnp.float32) * w

    # This group walks its own slots only, up to its last filled one: a group given
    # fewer micro-batches (a slower one, `reorder.assign_by_speed`) finishes sooner
    # instead of computing empty slots at weight 0.
    filled = jnp.max(jnp.where(table.index[0] >= 0, jnp.arange(1, table.index.shape[1] + 1), 0))
    grads, loss = jax.lax.fori_loop(0, jnp.minimum(filled, table.n_slots), slot, carry0)
    live = table.alive[0]
    masked = jax.tree.map(lambda g: g * live.astype(g.dtype), (grads, loss))
    if not reduce:  # one group: its sum is the sum (returned with a group axis of 1)
        return jax.tree.map(lambda x: x[None], masked)
    return jax.lax.psum(masked, mesh_lib.GROUP_AXES)


def reduce_step(
    state: TrainState,
    stacks: Any,
    table: slots.Slots,
    *,
    loss_fn: LossFn,
    mesh: Mesh,
    accum_dtype: Any = jnp.float32,
) -> tuple[Any, jax.Array, jax.Array]:
    """The exact gradient sum over every counted micro-batch, its loss sum and whether finite.

    The part of a step that crosses groups; `update_step` is the rest. The sums
    are in ``accum_dtype`` (at least) and not yet scaled by ``1 / (G * m)``.
    """
    group = PartitionSpec(mesh_lib.GROUP_AXES)
    table_specs = slots.Slots(group, group, group, PartitionSpec(), PartitionSpec())
    # XLA refuses a psum over group axes of size 1 beside automatic inner axes.
    single = mesh_lib.num_groups(mesh) == 1
    synced = jax.shard_map(
        lambda p, s, t: group_gradients(loss_fn, p, s, t, accum_dtype, reduce=not single),
        mesh=mesh,
        in_specs=(PartitionSpec(), group, table_specs),
        out_specs=group if single else PartitionSpec(),
        axis_names=set(mesh_lib.GROUP_AXES),
    )
    grad_sum, loss_sum = synced(state.params, stacks, table)
    if single:
        grad_sum, loss_sum = jax.tree.map(lambda x: x[0], (grad_sum, loss_sum))
    return grad_sum, loss_sum, jnp.isfinite(loss_sum) & jnp.isfinite(_squares(grad_sum))


def _squares(grads: Any) -> jax.Array:
    """The sum of every gradient element's square, in float32 (one pass over the gradients)."""
    return sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in jax.tree.leaves(grads))


def _norm(grad_sum: Any, denom: jax.Array) -> jax.Array:
    """The norm of the mean gradient, from the sums (the divided gradients are never kept)."""
    return jnp.sqrt(_squares(grad_sum)) / denom


def update_step(
    state: TrainState,
    grad_sum: Any,
    loss_sum: jax.Array,
    denom: jax.Array,
    *,
    tx: optax.GradientTransformation,
    grad_norm: jax.Array | None = None,
) -> tuple[TrainState, dict[str, jax.Array]]:
    """The optimizer update from a `reduce_step`'s sums: divide by ``G * m``, apply ``tx``.

    No collective crosses groups here: every group updates its own replica.
    ``grad_norm``, when the caller has it, saves a pass over the gradients.
    With the state donated, nothing of the state's size is allocated beside
    it: the update's peak is the state plus ``grad_sum``.
    """
    if grad_norm is None:
        grad_norm = _norm(grad_sum, denom)
    # A multiply, not a divide: XLA recomputes a multiply inside each of its consumers
    # (Adam's two moments) but computes a divide once into a gradient-sized buffer.
    scale = 1 / denom
    grads = jax.tree.map(lambda g: g * scale.astype(g.dtype), grad_sum)
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, state.params)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    loss = loss_sum / denom
    new = TrainState(step=state.step + 1, params=params, opt_state=opt_state)
    return new, {"loss": loss, "grad_norm": grad_norm}


def train_step(
    state: TrainState,
    stacks: Any,
    table: slots.Slots,
    *,
    loss_fn: LossFn,
    tx: optax.GradientTransformation,
    mesh: Mesh,
    accum_dtype: Any = jnp.float32,
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One exact, failure-masked optimizer step (pure; `SpareStep` jits it).

    Args:
        state: the train state.
        stacks: pytree of ``[G, S, b, ...]`` arrays, every group's stack, split over groups.
        table: the step's slot table (``[G, L]`` arrays split over groups, scalars replicated).
        loss_fn: ``loss_fn(params, microbatch) -> scalar``, the mean loss of one micro-batch.
        tx: the optimizer.
        mesh: the mesh.
        accum_dtype: the micro-batch and cross-group sums run in this dtype at
            least (float32: bf16 parameters still get an fp32-accumulated gradient).

    Returns:
        The new state and ``{"loss", "grad_norm", "finite"}``; the loss is the
        mean over the counted micro-batches: the failure-free global-batch
        loss. When the loss or the gradient is not finite the state is
        returned unchanged and ``finite`` is False.
    """
    grad_sum, loss_sum, _ = reduce_step(
        state, stacks, table, loss_fn=loss_fn, mesh=mesh, accum_dtype=accum_dtype
    )
    # One pass over the gradients for both the finite check and the norm.
    norm = _norm(grad_sum, table.denom)
    finite = jnp.isfinite(loss_sum) & jnp.isfinite(norm)

    def apply(st: TrainState) -> tuple[TrainState, jax.Array]:
        new, metrics = update_step(st, grad_sum, loss_sum, table.denom, tx=tx, grad_norm=norm)
        return new, metrics["grad_norm"]

    # A non-finite step keeps the state it started from, so the last good state
    # survives to be saved (the caller sees metrics["finite"] is False). A cond, not
    # a select over the whole state: with the state donated, one state lives.
    keep = lambda st: (st, jnp.asarray(jnp.nan, jnp.float32))
    new, grad_norm = jax.lax.cond(finite, apply, keep, state)
    return new, {"loss": loss_sum / table.denom, "grad_norm": grad_norm, "finite": finite}
