"""The failure-masked train step for any JAX model, and its public entry point.

Owns `SpareStep` (built by `make_train_step`): the one wrapper that adds
shardings, donation, the compiled slot bound and the one cache of slot tables.

**Inputs.** The failure-free global batch (leaves of ``G * m * b`` rows;
micro-batch ``(g, j)`` is rows ``[(g*m + j) b, (g*m + j + 1) b)``), laid out
as stacks (each group its ``r`` shards, `spare_jax.slots.unit_ids`), or only
this process's units (`spare_jax.inputs`); and a live mask, turned into a
`Slots` table (`slots.for_live_set`, cached per live set). The batch never
changes with the live set; who computes what does.

**The step** is `spare_jax.step`'s pure functions (each group's weighted sum
over its slots, one masked ``psum`` across groups, the update): fused in one
process (`step.train_step`); two programs in a multi-process job (``split``),
so that only the update, which crosses no group, takes the donated state.
The table is runtime data: a new live set is new arrays, not a new program,
until a table needs more slots than were compiled (the default bound, the
stack size ``r * m``, no exact assignment exceeds).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import optax.tree_utils as otu
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from spare_jax import checks, inputs, slots, strategies
from spare_jax import mesh as mesh_lib
from spare_jax import step as step_fns
from spare_jax.placement import Placement
from spare_jax.step import (  # re-exported: the step's pure parts live in spare_jax.step
    LossFn,
    TrainState,
    train_step,
)

__all__ = ["LossFn", "SpareStep", "TrainState", "make_train_step", "train_step"]


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
        batch_axes: Sequence[str] = (),
        accum_dtype: Any = jnp.float32,
        split: bool = False,
        domain: Any = None,
    ):
        self.loss_fn, self.tx, self.mesh, self.placement = loss_fn, tx, mesh, placement
        self.donate = bool(donate)
        self.batch_axes = mesh_lib.check_batch_axes(batch_axes, mesh)
        self.accum_dtype = np.dtype(accum_dtype)
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
        # Each group's walked slots (up to its last filled one) in the latest table, and
        # the seconds of this process's gradients program in the latest timed `reduce`.
        self.walked = np.zeros(self.groups, np.int32)
        self.compute_s: float | None = None
        self.computed_at: float | None = None  # when they were ready (perf_counter)
        self._checked: set[Any] = set()
        self._group = mesh_lib.group_sharding(mesh)
        self._rep = mesh_lib.replicated(mesh)
        self._tables = slots.Tables(
            placement, self.microbatches, self.policy, self.rows, self._group, self._rep
        )
        rows_spec = self.batch_axes if self.batch_axes else None
        self.stack_sharding = NamedSharding(
            mesh, PartitionSpec(mesh_lib.GROUP_AXES, None, rows_spec)
        )
        units = placement.shards * placement.shard_units * self.microbatches
        self._stacks = inputs.GlobalStacks(units, self._unit_ids, self.stack_sharding)
        self.split = bool(split) or domain is not None
        self.domain = domain  # a `domains.Split`: the step split by failure domain
        self._jitted: dict[int, dict[str, Callable[..., Any]]] = {}  # programs by slot bound
        self._aot: dict[int, dict[str, Any]] = {}  # ahead-of-time executables by slot bound

    # ------------------------------------------------------------------ state

    def state_shardings(self, params: Any) -> TrainState:
        """NamedShardings of the train state for parameters shaped like ``params``."""
        params = mesh_lib.shaped(params)
        specs = self.param_specs
        if specs is None:
            specs = jax.tree.map(lambda _: PartitionSpec(), params)
        is_spec = lambda x: isinstance(x, PartitionSpec)
        if jax.tree.structure(specs, is_leaf=is_spec) != jax.tree.structure(params):
            raise ValueError("param_specs must have the structure of params")
        for (path, spec), leaf in zip(
            jax.tree_util.tree_leaves_with_path(specs, is_leaf=is_spec),
            jax.tree.leaves(params),
            strict=True,
        ):
            mesh_lib.check_param_spec(jax.tree_util.keystr(path), spec, np.shape(leaf), self.mesh)
        param_sh = jax.tree.map(lambda s: NamedSharding(self.mesh, s), specs, is_leaf=is_spec)
        opt_shape = jax.eval_shape(self.tx.init, params)
        opt_sh = otu.tree_map_params(
            self.tx, lambda _, sh: sh, opt_shape, param_sh, transform_non_params=lambda _: self._rep
        )
        return TrainState(step=self._rep, params=param_sh, opt_state=opt_sh)

    def abstract_state(self, params: Any) -> TrainState:
        """Shapes, dtypes and shardings of the state (a restore target for Orbax)."""
        params = mesh_lib.shaped(params)
        shardings = self.state_shardings(params)
        shapes = jax.eval_shape(
            lambda p: TrainState(jnp.zeros((), jnp.int32), p, self.tx.init(p)), params
        )
        return jax.tree.map(
            lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings
        )

    def init(self, params: Any) -> TrainState:
        """A fresh state: ``params`` placed, optimizer state initialised. ``params``: a
        pytree of arrays, or a function of no arguments returning one (run as one
        program whose outputs are born in their shards, never whole on one device)."""
        shardings = self.state_shardings(params)
        if callable(params):
            fresh = lambda: TrainState(jnp.zeros((), jnp.int32), p := params(), self.tx.init(p))
            return jax.jit(fresh, out_shardings=shardings)()
        placed = jax.tree.map(mesh_lib.put, params, shardings.params)
        opt_state = jax.tree.map(mesh_lib.put, self.tx.init(placed), shardings.opt_state)
        step = mesh_lib.put(np.zeros((), np.int32), self._rep)
        return TrainState(step=step, params=placed, opt_state=opt_state)

    @staticmethod
    def params(state: TrainState) -> Any:
        """The current parameters, the pytree given to `init`."""
        return state.params

    # ------------------------------------------------------------------ inputs

    def table(self, alive: np.ndarray, speeds: np.ndarray | None = None) -> tuple[slots.Slots, int]:
        """The placed slot table of a live set and its max load (cached per live set).

        ``speeds``: the groups' relative throughputs (adaptive policy only): the
        table of the shortest step at those speeds (`slots.for_speeds`), a slow
        group walking fewer slots; None: equal speeds.

        Raises:
            reorder.Interruption: some shard has no live holder.
            ValueError: ``alive`` not ``groups`` bools, or live where this mesh has no
                devices; ``speeds`` not ``groups`` values >= 0, or a policy not adaptive.
        """
        alive = checks.bool_mask("alive", alive, self.groups)
        if speeds is not None:
            if self.policy != "adaptive":
                raise ValueError(f"speeds need the adaptive policy, this step's is {self.policy}")
            if np.shape(speeds) != (self.groups,):
                raise ValueError(f"speeds must have shape ({self.groups},), got {np.shape(speeds)}")
            speeds = np.where(alive, np.asarray(speeds, np.float64), 0.0)
        placed, load, self.walked, self.slot_bound = self._tables.get(
            alive, speeds, self.slot_bound
        )
        return placed, load

    def stacks(self, batch: Any) -> Any:
        """The global batch laid out as every mesh group's stack, placed on the group axis."""
        return self._stacks(batch)

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

    def _programs(self, state: Any) -> dict[str, Callable[..., Any]]:
        """The jitted programs for the current slot bound: ``step``, or ``reduce`` + ``update``."""
        if self.slot_bound in self._jitted:
            return self._jitted[self.slot_bound]
        state_sh = jax.tree.map(lambda x: x.sharding, state)
        donate = (0,) if self.donate else ()
        kw = {"loss_fn": self.loss_fn, "mesh": self.mesh, "accum_dtype": self.accum_dtype}

        def fused(state: TrainState, stacks: Any, table: slots.Slots) -> Any:
            self.compiles += 1  # runs only while tracing: once per compilation
            return step_fns.train_step(state, stacks, table, tx=self.tx, **kw)

        def reduce(state: TrainState, stacks: Any, table: slots.Slots) -> Any:
            self.compiles += 1
            return step_fns.reduce_step(state, stacks, table, **kw)

        programs = {  # jit compiles on first call: only the programs used are built
            "step": jax.jit(fused, out_shardings=(state_sh, self._rep), donate_argnums=donate),
            # The gradient sum laid out as the parameters (sharded over FSDP axes, not whole).
            "reduce": jax.jit(reduce, out_shardings=(state_sh.params, self._rep, self._rep)),
            "update": jax.jit(
                lambda st, g, l, d: step_fns.update_step(st, g, l, d, tx=self.tx),
                out_shardings=(state_sh, self._rep),
                donate_argnums=donate,
            ),
        }
        self._jitted = {self.slot_bound: programs}
        return programs

    def precompile(self, state: Any, stacks: Any) -> float:
        """Compile the step ahead of time for inputs shaped like these; the seconds it took.

        ``state`` may be arrays or ``jax.ShapeDtypeStruct`` s with shardings on
        this mesh; ``stacks`` gives the per-group input's shape after the group
        axis (leaves shaped ``[any, S, b, ...]``).
        """
        start = time.perf_counter()
        group = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=self._group)
        rep = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=self._rep)
        rows, bound = int(self.rows.size), self.slot_bound
        abstract_stacks = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(
                (rows, *x.shape[1:]), x.dtype, sharding=self.stack_sharding
            ),
            stacks,
        )
        table = slots.Slots(
            index=group((rows, bound), np.int32),
            weight=group((rows, bound), np.float32),
            alive=group((rows,), np.float32),
            denom=rep((), np.float32),
            n_slots=rep((), np.int32),
        )
        abstract_state = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
        )
        if self.domain is not None:
            self.domain.precompile(self.mesh, abstract_state, abstract_stacks, table)
            return time.perf_counter() - start
        programs = self._programs(abstract_state)
        if self.split:
            reduce = programs["reduce"].lower(abstract_state, abstract_stacks, table)
            grad_sum, loss_sum, _ = reduce.out_info
            update = programs["update"].lower(
                abstract_state,
                jax.tree.map(
                    lambda x, p: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=p.sharding),
                    grad_sum,
                    abstract_state.params,
                ),
                rep((), loss_sum.dtype),
                table.denom,
            )
            self._aot[bound] = {"reduce": reduce.compile(), "update": update.compile()}
        else:
            lowered = programs["step"].lower(abstract_state, abstract_stacks, table)
            self._aot[bound] = {"step": lowered.compile()}
        return time.perf_counter() - start

    def compiled(self) -> bool:
        """Whether the programs for the current slot bound are compiled ahead of time."""
        if self.domain is not None:
            return self.domain.ready(self.mesh)
        return self.slot_bound in self._aot

    def _program(self, name: str, state: Any) -> Callable[..., Any]:
        ready = self._aot.get(self.slot_bound, {})
        return ready[name] if name in ready else self._programs(state)[name]

    def run(self, state: TrainState, stacks: Any, table: slots.Slots) -> tuple[TrainState, dict]:
        """The jitted step on inputs already placed (`stacks`, `table`); donates ``state``."""
        self._check_loss(state, stacks)
        if not self.split:
            with jax.transfer_guard("disallow"):
                return self._program("step", state)(state, stacks, table)
        grad_sum, loss_sum, finite = self.reduce(state, stacks, table)
        if not bool(np.asarray(finite.addressable_shards[0].data)):
            nan = np.float32(np.nan)
            return state, {"loss": nan, "grad_norm": nan, "finite": False}
        new, metrics = self.update(state, grad_sum, loss_sum, table)
        return new, {**metrics, "finite": finite}

    def reduce(
        self, state: TrainState, stacks: Any, table: slots.Slots, *, timed: bool = False
    ) -> tuple[Any, ...]:
        """The step's part that crosses groups: ``(grad_sum, loss_sum, finite)``; keeps ``state``.

        With `update`, the split form of `run` (``split=True``, multi-process
        jobs): a peer lost during `reduce` leaves every survivor's state as it
        was, and the state is donated only to `update`, in which no other group
        takes part. A non-finite sum is never applied. ``timed`` (a step split by
        failure domain): wait for this domain's gradients before the cross-group
        sum and keep their seconds in `compute_s` (a slow group's own time, not
        the time it makes the others wait).
        """
        self._check_loss(state, stacks)
        with jax.transfer_guard("disallow"):
            if self.domain is not None:
                start = time.perf_counter()
                mine = self.domain.gradients(state.params, stacks, table)
                if timed:
                    jax.block_until_ready(mine)
                    self.computed_at = time.perf_counter()
                    self.compute_s = self.computed_at - start
                return self.domain.cross(self.mesh, [mine])
            return self._program("reduce", state)(state, stacks, table)

    def update(
        self, state: TrainState, grad_sum: Any, loss_sum: jax.Array, table: slots.Slots
    ) -> tuple[TrainState, dict[str, jax.Array]]:
        """Apply a `reduce`'s sums to ``state`` (donated): the new state and its metrics."""
        with jax.transfer_guard("disallow"):
            if self.domain is not None:
                # The new replica stays on the domain's mesh: the next step reads it
                # there without a view; `global_state` puts it on this mesh when asked.
                return self.domain.update(state, grad_sum, loss_sum, table.denom)
            return self._program("update", state)(state, grad_sum, loss_sum, table.denom)

    def global_state(self, state: TrainState) -> TrainState:
        """``state`` as arrays over this step's mesh (a split step keeps it on its domain's)."""
        if self.domain is None:
            return state
        return self.domain.lift(self.mesh, [state])

    def memory(self, state: TrainState, stacks: Any, program: str | None = None) -> dict[str, int]:
        """Device bytes per device of ``program`` (``step``, or a split step's ``reduce`` (default)
        or ``update``; XLA's ``memory_analysis``): ``arguments``, ``outputs``, ``temporaries``
        (gradients, activations), ``aliased`` (donated buffers reused for outputs) and
        ``peak`` = arguments + outputs + temporaries - aliased."""
        if self.slot_bound not in self._aot:
            self.precompile(state, stacks)
        compiled = self._aot[self.slot_bound]
        if (program := program or next(iter(compiled))) not in compiled:
            raise ValueError(f"program: one of {sorted(compiled)}, got {program!r}")
        stats = compiled[program].memory_analysis()
        out = {
            "arguments": int(stats.argument_size_in_bytes),
            "outputs": int(stats.output_size_in_bytes),
            "temporaries": int(stats.temp_size_in_bytes),
            "aliased": int(stats.alias_size_in_bytes),
        }
        out["peak"] = out["arguments"] + out["outputs"] + out["temporaries"] - out["aliased"]
        return out

    def __call__(
        self, state: TrainState, batch: Any, alive: np.ndarray, speeds: np.ndarray | None = None
    ) -> tuple[TrainState, dict[str, Any]]:
        """One exact step on the failure-free global ``batch`` with the groups ``alive``.

        ``speeds`` (optional): the groups' relative throughputs; see `table`.

        Raises:
            reorder.Interruption: some shard has no live holder (``state`` is untouched).
            ValueError: a malformed ``batch``, ``alive`` or ``speeds``, or a non-scalar loss.
        """
        table, load = self.table(alive, speeds)
        new_state, metrics = self.run(state, self.stacks(batch), table)
        return new_state, {**metrics, "max_load": load}

    def on_mesh(
        self,
        mesh: Mesh,
        rows: np.ndarray,
        *,
        donate: bool | None = None,
        split: bool | None = None,
        domain: Any = None,
    ) -> SpareStep:
        """The same step over another mesh whose groups are the original groups ``rows``.

        Survivors of a real failure use it to continue on their own devices.
        ``donate``, ``split`` and ``domain`` (the `domains.Split` whose
        compiled programs the new step shares) default to this step's.
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
            batch_axes=self.batch_axes,
            accum_dtype=self.accum_dtype,
            split=self.split if split is None else split,
            domain=self.domain if domain is None else domain,
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
    batch_axes: str | Sequence[str] = (),
    slot_bound: int | None = None,
    donate: bool = True,
    accum_dtype: Any = jnp.float32,
) -> SpareStep:
    """SPARe's exact, failure-masked train step for any model and optax optimizer.

    Args:
        loss_fn: ``loss_fn(params, batch) -> scalar``, the MEAN loss over one micro-batch.
        optimizer: any ``optax.GradientTransformation``.
        mesh: a mesh from `spare_jax.make_mesh`: the group axes ``data`` and
            ``redundancy`` (their coordinates are the groups), then any inner axes.
        strategy: ``"spare"`` (cyclic stacking along the redundancy axis),
            ``"replication"`` or ``"dp"`` (redundancy 1).
        redundancy: r, the groups holding each shard.
        microbatches: m, micro-batches per group per step.
        policy: ``"adaptive"`` (optimal), ``"fixed"`` (stack order) or ``"drop"``
            (the inexact drop-and-renormalise baseline).
        param_specs: optional pytree of ``PartitionSpec`` s for the parameters over
            any inner axes (``fsdp``, ``tensor``, ...; never a group axis); default
            replicated within each group.
        batch_axes: inner axes each micro-batch's rows are split over (FSDP-style,
            e.g. ``"fsdp"``); default none: every device of a group sees whole
            micro-batches.
        slot_bound: slots to compile for (default the stack size ``r * m``: never recompiles).
        donate: reuse the input state's memory.
        accum_dtype: the micro-batch and cross-group gradient sums run in this
            dtype at least (default float32, whatever the parameters' dtype).

    Returns:
        A `SpareStep`.
    """
    kind = strategies.canonical(strategy)
    r = checks.integer("redundancy", redundancy, low=1)
    if not isinstance(mesh, Mesh) or tuple(mesh.axis_names)[:2] != mesh_lib.GROUP_AXES:
        raise ValueError(
            f"mesh must be a Mesh whose first axes are {mesh_lib.GROUP_AXES} (spare_jax.make_mesh)"
        )
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
        batch_axes=batch_axes,
        accum_dtype=accum_dtype,
    )
