"""The failure-masked train step for any JAX model, and its public entry point.

Owns the train state, the pure `train_step`, and `SpareStep` (built by
`make_train_step`): the one wrapper that adds shardings, donation, the
compiled slot bound and the one cache of slot tables.

**Inputs.** A user passes the failure-free global batch (a pytree whose leaves
have ``G * m * b`` rows; micro-batch ``(g, j)`` is rows ``[(g*m + j) b, (g*m +
j + 1) b)``) and a live mask. `SpareStep` lays the batch out as stacks (each
group gets its ``r`` shards, `spare_jax.slots.unit_ids`), and turns the live
mask into a `Slots` table (`slots.for_live_set`, cached per live set). The
batch never changes with the live set; who computes what does.

**The step.** Inside a ``jax.shard_map`` that is manual over the group axes
``("data", "redundancy")`` and automatic over ``"model"`` (XLA partitions each
group's computation from the parameters' shardings), every group walks
``n_slots`` slots. Slot ``l`` of group ``g`` computes the gradient of local
micro-batch ``index[g, l]`` and adds ``weight[g, l]`` times it. The loop runs the
same count on every group: a per-device ``lax.cond`` that skips empty slots
deadlocks XLA's CPU collectives, and a less loaded group would wait for the
busiest anyway. Each group's sum is multiplied by its live mask, one ``psum``
over the groups adds them, the sum is divided by ``denom = G * m`` (never the
live count) and the optimizer is applied, replicated over the groups.

The table is runtime data: a new live set is new arrays, not a new program,
until a table needs more slots than were compiled (the default bound, the
stack size ``r * m``, no exact assignment exceeds).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
import optax.tree_utils as otu
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from spare_jax import checks, slots, strategies
from spare_jax import mesh as mesh_lib
from spare_jax.placement import Placement

__all__ = ["LossFn", "SpareStep", "TrainState", "make_train_step", "train_step"]

LossFn = Callable[[Any, Any], jax.Array]
_CACHE_SIZE = 64


@flax.struct.dataclass
class TrainState:
    """Step count, parameters and optimizer state (replicated over groups)."""

    step: jax.Array
    params: Any
    opt_state: optax.OptState


def _group_gradients(
    loss_fn: LossFn, params: Any, stacks: Any, table: slots.Slots
) -> tuple[Any, jax.Array]:
    """One group's weighted gradient and loss sums, psum'd over the live groups.

    Runs inside shard_map: ``stacks`` leaves are ``[1, S, b, ...]`` (this group's
    stack), ``table.index``/``weight`` are ``[1, L]``, ``table.alive`` is ``[1]``.
    """
    grad_fn = jax.value_and_grad(loss_fn)
    # Differentiate a per-group ("varying") copy of the replicated parameters:
    # differentiating the replicated value itself makes JAX put the transpose's
    # psum inside grad, summing every group's slot gradient before its weight.
    params = jax.lax.pcast(params, mesh_lib.GROUP_AXES, to="varying")
    local = jax.tree.map(lambda x: x[0], stacks)
    zero_loss = jax.lax.pcast(jnp.zeros((), jnp.float32), mesh_lib.GROUP_AXES, to="varying")
    carry0 = (jax.tree.map(jnp.zeros_like, params), zero_loss)

    def slot(k: jax.Array, carry: Any) -> Any:
        i = table.index[0, k]
        w = jnp.where(i >= 0, table.weight[0, k], 0.0)
        pick = lambda x: jax.lax.dynamic_index_in_dim(x, jnp.maximum(i, 0), keepdims=False)
        loss, grads = grad_fn(params, jax.tree.map(pick, local))
        grad_acc, loss_acc = carry
        grad_acc = jax.tree.map(lambda acc, g: acc + (g * w).astype(acc.dtype), grad_acc, grads)
        return grad_acc, loss_acc + loss.astype(jnp.float32) * w

    grads, loss = jax.lax.fori_loop(0, table.n_slots, slot, carry0)
    live = table.alive[0]
    masked = jax.tree.map(lambda g: g * live.astype(g.dtype), (grads, loss))
    return jax.lax.psum(masked, mesh_lib.GROUP_AXES)


def train_step(
    state: TrainState,
    stacks: Any,
    table: slots.Slots,
    *,
    loss_fn: LossFn,
    tx: optax.GradientTransformation,
    mesh: Mesh,
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One exact, failure-masked optimizer step (pure; `SpareStep` jits it).

    Args:
        state: the train state.
        stacks: pytree of ``[G, S, b, ...]`` arrays, every group's stack, split over groups.
        table: the step's slot table (``[G, L]`` arrays split over groups, scalars replicated).
        loss_fn: ``loss_fn(params, microbatch) -> scalar``, the mean loss of one micro-batch.
        tx: the optimizer.
        mesh: the mesh.

    Returns:
        The new state and ``{"loss", "grad_norm", "finite"}``; the loss is the
        mean over the counted micro-batches: the failure-free global-batch
        loss. When the loss or the gradient is not finite the state is
        returned unchanged and ``finite`` is False.
    """
    group = PartitionSpec(mesh_lib.GROUP_AXES)
    table_specs = slots.Slots(group, group, group, PartitionSpec(), PartitionSpec())
    synced = jax.shard_map(
        lambda p, s, t: _group_gradients(loss_fn, p, s, t),
        mesh=mesh,
        in_specs=(PartitionSpec(), group, table_specs),
        out_specs=PartitionSpec(),
        axis_names=set(mesh_lib.GROUP_AXES),
    )
    grad_sum, loss_sum = synced(state.params, stacks, table)
    grads = jax.tree.map(lambda g: g / table.denom.astype(g.dtype), grad_sum)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    loss, grad_norm = loss_sum / table.denom, optax.tree.norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    new = TrainState(step=state.step + 1, params=params, opt_state=opt_state)
    # A non-finite step keeps the state it started from, so the last good state
    # survives to be saved (the caller sees metrics["finite"] is False).
    new = jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, state)
    return new, {"loss": loss, "grad_norm": grad_norm, "finite": finite}


def _put(value: Any, sharding: NamedSharding) -> jax.Array:
    """A fresh placed copy; host values go through a callback so each process sends its shards.

    Device arrays are copied first: `device_put` reuses the source buffer for
    one of the destination shards (even with ``may_alias=False``), and the
    step donates its state, which would delete the caller's array.
    """
    if isinstance(value, jax.Array) and (
        sharding.is_fully_addressable or not value.is_fully_addressable
    ):
        return jax.device_put(value.copy(), sharding)
    host = np.asarray(value)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


class SpareStep:
    """SPARe's train step over one mesh: ``state, metrics = step(state, batch, alive)``.

    Build it with `make_train_step`. Attributes:
        placement: who holds which shard (over all ``groups`` original groups).
        groups: G, the length of ``alive``.
        microbatches: m, micro-batches per group per step.
        policy: adaptive, fixed or drop.
        mesh: the mesh the step runs on.
        rows: the original group of each mesh group (all of them unless built
            by `on_mesh` for a subset of survivors).
        slot_bound: the slots the compiled step walks at most.
        compiles: how many times the step has been traced (compiled).
        donate: whether the step donates (reuses the memory of) its input state.
    """

    def __init__(
        self,
        loss_fn: LossFn,
        tx: optax.GradientTransformation,
        mesh: Mesh,
        placement: Placement,
        *,
        microbatches: int,
        policy: str,
        param_specs: Any = None,
        slot_bound: int | None = None,
        rows: np.ndarray | None = None,
        donate: bool = True,
    ):
        self.loss_fn, self.tx, self.mesh, self.placement = loss_fn, tx, mesh, placement
        self.donate = bool(donate)
        self.microbatches = checks.integer("microbatches", microbatches, low=1)
        self.policy = strategies.check_policy(policy)
        self.param_specs = param_specs
        self.groups = placement.groups
        self.rows = np.arange(self.groups) if rows is None else np.asarray(rows, np.int64)
        if self.rows.size != mesh_lib.num_groups(mesh):
            raise ValueError(
                f"the mesh has {mesh_lib.num_groups(mesh)} groups but rows names {self.rows.size}"
            )
        self.stack_size = slots.stack_size(placement, self.microbatches)
        bound = self.stack_size if slot_bound is None else slot_bound
        self.slot_bound = checks.integer("slot_bound", bound, low=1)
        self.compiles = 0
        self._unit_ids = slots.unit_ids(placement, self.microbatches)[self.rows]
        self._tables: collections.OrderedDict[bytes, tuple[slots.Slots, int]] = (
            collections.OrderedDict()
        )
        self._checked: set[Any] = set()
        self._group = mesh_lib.group_sharding(mesh)
        self._rep = mesh_lib.replicated(mesh)
        self._jitted: dict[int, Callable[..., Any]] = {}
        self._aot: dict[int, Any] = {}  # ahead-of-time executables by slot bound
        self._gathers: dict[int, Callable[..., Any]] = {}  # device-batch layout, by rows

    # ------------------------------------------------------------------ state

    def state_shardings(self, params: Any) -> TrainState:
        """NamedShardings of the train state for parameters shaped like ``params``."""
        specs = self.param_specs
        if specs is None:
            specs = jax.tree.map(lambda _: PartitionSpec(), params)
        is_spec = lambda x: isinstance(x, PartitionSpec)
        for spec in jax.tree.leaves(specs, is_leaf=is_spec):
            named = {
                a for part in spec if part for a in (part if isinstance(part, tuple) else (part,))
            }
            if not is_spec(spec) or named - {"model"}:
                raise ValueError(f"param_specs may shard over 'model' only, got {spec!r}")
        param_sh = jax.tree.map(lambda s: NamedSharding(self.mesh, s), specs, is_leaf=is_spec)
        if jax.tree.structure(param_sh) != jax.tree.structure(params):
            raise ValueError("param_specs must have the structure of params")
        opt_shape = jax.eval_shape(self.tx.init, params)
        opt_sh = otu.tree_map_params(
            self.tx, lambda _, sh: sh, opt_shape, param_sh, transform_non_params=lambda _: self._rep
        )
        return TrainState(step=self._rep, params=param_sh, opt_state=opt_sh)

    def abstract_state(self, params: Any) -> TrainState:
        """Shapes, dtypes and shardings of the state (a restore target for Orbax)."""
        shardings = self.state_shardings(params)
        shapes = jax.eval_shape(
            lambda p: TrainState(jnp.zeros((), jnp.int32), p, self.tx.init(p)), params
        )
        return jax.tree.map(
            lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings
        )

    def init(self, params: Any) -> TrainState:
        """A fresh state: ``params`` (any pytree of arrays) placed, optimizer state initialised."""
        shardings = self.state_shardings(params)
        placed = jax.tree.map(_put, params, shardings.params)
        opt_state = jax.tree.map(_put, self.tx.init(placed), shardings.opt_state)
        step = _put(np.zeros((), np.int32), self._rep)
        return TrainState(step=step, params=placed, opt_state=opt_state)

    @staticmethod
    def params(state: TrainState) -> Any:
        """The current parameters, the pytree given to `init`."""
        return state.params

    # ------------------------------------------------------------------ inputs

    def table(self, alive: np.ndarray) -> tuple[slots.Slots, int]:
        """The placed slot table of a live set and its max load (cached per live set).

        Raises:
            reorder.Interruption: some shard has no live holder.
            ValueError: ``alive`` is not a bool array of length ``groups``, or
                marks live a group that has no devices on this mesh.
        """
        alive = checks.bool_mask("alive", alive, self.groups)
        key = alive.tobytes()
        if key in self._tables:
            self._tables.move_to_end(key)
            return self._tables[key]
        if alive[np.setdiff1d(np.arange(self.groups), self.rows)].any():
            raise ValueError("alive marks a group live that has no devices on this mesh")
        host = slots.for_live_set(self.placement, alive, self.microbatches, self.policy)
        self.slot_bound = max(self.slot_bound, host.width)
        host = host.pad(self.slot_bound)
        placed = slots.Slots(
            index=_put(host.index[self.rows], self._group),
            weight=_put(host.weight[self.rows], self._group),
            alive=_put(host.alive[self.rows], self._group),
            denom=_put(host.denom, self._rep),
            n_slots=_put(host.n_slots, self._rep),
        )
        self._tables[key] = (placed, host.max_load)
        if len(self._tables) > _CACHE_SIZE:
            self._tables.popitem(last=False)
        return self._tables[key]

    def _rows_per_unit(self, batch: Any) -> int:
        """b, the rows of one micro-batch, after checking the batch's shape."""
        leaves = jax.tree.leaves(batch)
        if not leaves:
            raise ValueError("batch must hold at least one array")
        sizes = {int(np.shape(x)[0]) if np.ndim(x) else -1 for x in leaves}
        if len(sizes) != 1 or -1 in sizes:
            raise ValueError(f"batch leaves must share one leading (row) axis, got sizes {sizes}")
        (n,) = sizes
        units = self.placement.shards * self.placement.shard_units * self.microbatches
        if n < units or n % units:
            raise ValueError(
                f"batch must have G*m*b rows (a positive multiple of G*m = {units}), got {n}"
            )
        return n // units

    def stacks(self, batch: Any) -> Any:
        """The global batch laid out as every mesh group's stack, placed on the group axis."""
        rows = self._rows_per_unit(batch)
        ids = self._unit_ids

        def stack(x: Any) -> jax.Array:
            rest = tuple(np.shape(x)[1:])
            shape = (ids.shape[0], ids.shape[1], rows, *rest)
            if isinstance(x, jax.Array):
                return self._gather(x, rows)
            host = np.asarray(x).reshape(-1, rows, *rest)
            return jax.make_array_from_callback(
                shape, self._group, lambda index: host[ids[index[0]]][(slice(None), *index[1:])]
            )

        return jax.tree.map(stack, batch)

    def _gather(self, x: jax.Array, rows: int) -> jax.Array:
        """A device batch laid out as stacks on device (one compiled gather per row count)."""
        if rows not in self._gathers:
            ids = self._unit_ids
            self._gathers[rows] = jax.jit(
                lambda v: v.reshape(-1, rows, *v.shape[1:])[ids], out_shardings=self._group
            )
        return self._gathers[rows](x)

    def _check_loss(self, state: TrainState, stacks: Any) -> None:
        key = jax.tree.structure(stacks), tuple((x.shape, x.dtype) for x in jax.tree.leaves(stacks))
        if key in self._checked:
            return
        micro = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[2:], x.dtype), stacks)
        out = jax.eval_shape(self.loss_fn, state.params, micro)
        if not isinstance(out, jax.ShapeDtypeStruct) or out.shape != ():
            shape = getattr(out, "shape", type(out).__name__)
            raise ValueError(
                f"loss_fn must return a scalar (the mean micro-batch loss), got {shape}"
            )
        self._checked.add(key)

    # ------------------------------------------------------------------ the step

    def _compiled(self, state: TrainState) -> Callable[..., Any]:
        if self.slot_bound not in self._jitted:
            state_sh = jax.tree.map(lambda x: x.sharding, state)

            def counted(state: TrainState, stacks: Any, table: slots.Slots) -> Any:
                self.compiles += 1  # runs only while tracing: once per compilation
                return train_step(
                    state, stacks, table, loss_fn=self.loss_fn, tx=self.tx, mesh=self.mesh
                )

            self._jitted = {
                self.slot_bound: jax.jit(
                    counted,
                    out_shardings=(state_sh, self._rep),
                    donate_argnums=(0,) if self.donate else (),
                )
            }
        return self._jitted[self.slot_bound]

    def precompile(self, state: Any, stacks: Any) -> float:
        """Compile the step ahead of time for inputs shaped like these; the seconds it took.

        ``state`` may be arrays or ``jax.ShapeDtypeStruct`` s with shardings on
        this mesh; ``stacks`` gives the per-group input's shape after the group
        axis (leaves shaped ``[any, S, b, ...]``).
        """
        start = time.perf_counter()
        group = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=self._group)
        rep = lambda dtype: jax.ShapeDtypeStruct((), dtype, sharding=self._rep)
        rows, bound = int(self.rows.size), self.slot_bound
        abstract_stacks = jax.tree.map(lambda x: group((rows, *x.shape[1:]), x.dtype), stacks)
        table = slots.Slots(
            index=group((rows, bound), np.int32),
            weight=group((rows, bound), np.float32),
            alive=group((rows,), np.float32),
            denom=rep(np.float32),
            n_slots=rep(np.int32),
        )
        abstract_state = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
        )
        lowered = self._compiled(abstract_state).lower(abstract_state, abstract_stacks, table)
        self._aot[bound] = lowered.compile()
        return time.perf_counter() - start

    def run(self, state: TrainState, stacks: Any, table: slots.Slots) -> tuple[TrainState, dict]:
        """The jitted step on inputs already placed (`stacks`, `table`); donates ``state``.

        (Unless built with ``donate=False``: survivors of a real process failure
        rebuild the state from the buffers of the step that failed.)
        """
        self._check_loss(state, stacks)
        with jax.transfer_guard("disallow"):
            if self.slot_bound in self._aot:
                return self._aot[self.slot_bound](state, stacks, table)
            return self._compiled(state)(state, stacks, table)

    def __call__(
        self, state: TrainState, batch: Any, alive: np.ndarray
    ) -> tuple[TrainState, dict[str, Any]]:
        """One exact step on the failure-free global ``batch`` with the groups ``alive``.

        Raises:
            reorder.Interruption: some shard has no live holder (``state`` is untouched).
            ValueError: a malformed ``batch`` or ``alive``, or a non-scalar loss.
        """
        table, load = self.table(alive)
        new_state, metrics = self.run(state, self.stacks(batch), table)
        return new_state, {**metrics, "max_load": load}

    def on_mesh(self, mesh: Mesh, rows: np.ndarray, *, donate: bool | None = None) -> SpareStep:
        """The same step over another mesh whose groups are the original groups ``rows``.

        Survivors of a real failure use it to continue on their own devices;
        ``donate`` (default: as this step) is off in multi-process jobs.
        """
        return SpareStep(
            self.loss_fn,
            self.tx,
            mesh,
            self.placement,
            microbatches=self.microbatches,
            policy=self.policy,
            param_specs=self.param_specs,
            slot_bound=self.slot_bound,
            rows=rows,
            donate=self.donate if donate is None else donate,
        )


def make_train_step(
    loss_fn: LossFn,
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    *,
    strategy: str = "spare",
    redundancy: int = 2,
    microbatches: int = 1,
    policy: str = "adaptive",
    param_specs: Any = None,
    slot_bound: int | None = None,
    donate: bool = True,
) -> SpareStep:
    """SPARe's exact, failure-masked train step for any model and optax optimizer.

    Args:
        loss_fn: ``loss_fn(params, batch) -> scalar``, the MEAN loss over one micro-batch.
        optimizer: any ``optax.GradientTransformation``.
        mesh: a ``(data, redundancy, model)`` mesh (`spare_jax.make_mesh`); its
            ``data * redundancy`` coordinates are the groups.
        strategy: ``"spare"`` (cyclic stacking along the redundancy axis),
            ``"replication"`` or ``"dp"`` (redundancy 1).
        redundancy: r, the groups holding each shard.
        microbatches: m, micro-batches per group per step.
        policy: ``"adaptive"`` (optimal), ``"fixed"`` (stack order) or ``"drop"``
            (the inexact drop-and-renormalise baseline).
        param_specs: optional pytree of ``PartitionSpec`` over ``"model"`` for the
            parameters; default replicated.
        slot_bound: slots to compile for (default the stack size ``r * m``: never recompiles).
        donate: reuse the input state's memory (False across real process
            failures, where survivors rebuild the state from it).

    Returns:
        A `SpareStep`.
    """
    kind = strategies.canonical(strategy)
    r = checks.integer("redundancy", redundancy, low=1)
    if not isinstance(mesh, Mesh) or tuple(mesh.axis_names) != mesh_lib.AXES:
        raise ValueError(f"mesh must be a Mesh with axes {mesh_lib.AXES} (spare_jax.make_mesh)")
    groups = mesh_lib.num_groups(mesh)
    placement = strategies.placement(
        kind, groups, r, ring_size=mesh_lib.ring_size(mesh, r) if kind == "spare" else None
    )
    if not callable(loss_fn):
        raise ValueError(f"loss_fn must be callable, got {loss_fn!r}")
    if not isinstance(optimizer, optax.GradientTransformation):
        raise ValueError(f"optimizer must be an optax.GradientTransformation, got {optimizer!r}")
    return SpareStep(
        loss_fn,
        optimizer,
        mesh,
        placement,
        microbatches=microbatches,
        policy=policy,
        param_specs=param_specs,
        slot_bound=slot_bound,
        donate=donate,
    )
