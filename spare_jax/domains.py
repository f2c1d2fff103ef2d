"""The step split by failure domain: a domain's heavy program never depends on the live set.

A **failure domain** is a set of groups that die together: the groups a
process touches, closed over shared processes (a process holding two groups
takes both down; a group spanning two processes dies with either). A
multi-process step runs as three programs (`Split`):

* ``gradients``, over the domain's devices only: forward, backward and the
  weighted slot sums of each of its groups (`train_step`'s per-group part,
  unreduced). Its inputs never change shape or layout while the domain lives,
  so it compiles once: a loss or a re-join elsewhere does not touch it.
* ``cross``, over every live group's devices: the sum of the groups' sums, the
  loss sum and whether both are finite. It holds no model code (one
  all-reduce per leaf), so the recompile a new live set needs is small; one
  executable is kept per live set.
* ``update``, over the domain's devices again: the optimizer, applied to the
  domain's replica (donated) when the sums are finite (the caller reads the
  flag first). No other group takes part.

Arrays cross between the live mesh and the domain's mesh without a copy: a
view over the same device buffers (`view`). The scaling by ``1 / (G * m)`` stays
in the update, with the optimizer, as in the fused step, so that both round
alike.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from spare_jax import compile_cache, slots
from spare_jax import mesh as mesh_lib
from spare_jax import step as step_fns

__all__ = ["Split", "domain_of", "failure_domains", "lift", "view", "whole"]


def failure_domains(owners: np.ndarray) -> np.ndarray:
    """int[G]: each group's failure domain (groups linked by a shared process share one).

    ``owners`` is int[G, M], the process of each device of each group
    (`multihost.group_processes`). Domains are numbered from 0 in order of
    their lowest group.
    """
    owners = np.asarray(owners)
    groups, per = owners.shape
    if (owners == owners[:, :1]).all():
        label = owners[:, 0]  # every group on one process: a process's groups are a domain
    else:
        import scipy.sparse.csgraph  # here: only jobs whose groups span processes need it

        procs = np.unique(owners, return_inverse=True)[1].reshape(groups, per)
        # Bipartite graph: group g -- process p per device; its components are the domains.
        size = groups + int(procs.max()) + 1
        rows = np.repeat(np.arange(groups), per)
        cols = groups + procs.ravel()
        graph = scipy.sparse.coo_matrix((np.ones(rows.size), (rows, cols)), shape=(size, size))
        label = scipy.sparse.csgraph.connected_components(graph, directed=False)[1][:groups]
    _, first = np.unique(label, return_index=True)
    order = np.argsort(np.argsort(first))  # renumber by each domain's lowest group
    return order[np.unique(label, return_inverse=True)[1]]


def domain_of(owners: np.ndarray, process: int) -> np.ndarray:
    """The groups of ``process``'s failure domain, ascending (empty if it holds none)."""
    domains = failure_domains(owners)
    mine = np.unique(domains[(np.asarray(owners) == process).any(axis=1)])
    return np.flatnonzero(np.isin(domains, mine))


def whole(owners: np.ndarray, live: Any) -> list[int]:
    """The processes of ``live`` whose failure domain has all its processes in ``live``.

    Only these can run: a replacement for one process of a group spanning
    several waits until its group-mates' replacements are live too. Every
    process computes the same list from the same live set.
    """
    owners = np.asarray(owners)
    live = sorted({int(p) for p in live})
    domain = failure_domains(owners)
    short = np.unique(domain[~np.isin(owners, live).all(axis=1)])
    out = set(np.unique(owners[np.isin(domain, short)]).tolist())
    return [p for p in live if p not in out]


def view(x: Any, sharding: NamedSharding, shape: Sequence[int] | None = None) -> jax.Array:
    """``x``'s buffers on ``sharding``'s devices as an array over ``sharding`` (no copy).

    ``x`` is an array or a list of arrays whose buffers together cover this
    process's devices of ``sharding``. ``shape`` defaults to ``x``'s: a
    group-replicated array keeps its shape on a mesh of fewer groups; a
    group-stacked one (``[G, ...]``) takes the new group count. Each device's
    buffer must already hold what ``sharding`` places there.
    """
    parts = x if isinstance(x, list) else [x]
    if len(parts) == 1 and parts[0].sharding == sharding and shape in (None, parts[0].shape):
        return parts[0]  # already there
    local = {s.device: s.data for part in parts for s in part.addressable_shards}
    buffers = [local[d] for d in sharding.addressable_devices]
    return jax.make_array_from_single_device_arrays(
        tuple(parts[0].shape if shape is None else shape), sharding, buffers
    )


def lift(live: Mesh, parts: Sequence[Any]) -> Any:
    """Domains' group-replicated pytrees (this process's), as one pytree over ``live``."""
    return jax.tree.map(
        lambda *xs: view(list(xs), NamedSharding(live, xs[0].sharding.spec)), *parts
    )


def _stacked(mesh: Mesh, spec: PartitionSpec) -> NamedSharding:
    """A leaf's per-group copies, stacked on a leading group axis over ``mesh``."""
    return NamedSharding(mesh, PartitionSpec(mesh_lib.GROUP_AXES, *spec))


def _squares(tree: Any) -> jax.Array:
    return sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in jax.tree.leaves(tree))


class Split:
    """One process's three programs of the split step, for its failure domain.

    Args:
        loss_fn: the model's ``loss_fn(params, microbatch)``.
        tx: the optimizer.
        mesh: a mesh over the domain's groups only (`multihost.survivors_mesh`).
        rows: the original group of each of the domain mesh's groups.
        accum_dtype: the dtype the sums run in, at least.
        scope: where the programs are kept to load untraced (`compile_cache.compile_scoped`):
            one per job and process slot (`rejoin.program_scope`), so that a re-join's
            survivors and its replacement skip tracing the model; None: not kept.

    Attributes:
        compiles: programs compiled, by kind (``gradients``, ``cross``, ``update``).
        compile_s: seconds spent compiling, by kind.
    """

    def __init__(
        self,
        loss_fn: Callable[[Any, Any], jax.Array],
        tx: optax.GradientTransformation,
        mesh: Mesh,
        rows: np.ndarray,
        accum_dtype: Any,
        scope: str | None = None,
    ):
        self.loss_fn, self.tx, self.mesh, self.scope = loss_fn, tx, mesh, scope
        self.rows = np.asarray(rows, np.int64)
        self.accum_dtype = accum_dtype
        self.compiles = {"gradients": 0, "cross": 0, "update": 0}
        self.compile_s = {"gradients": 0.0, "cross": 0.0, "update": 0.0}
        self._exe: dict[Any, Any] = {}

    lift = staticmethod(lift)

    # ------------------------------------------------------------- programs

    def _compiled(self, key: Any, kind: str, build: Callable[[], Any], args: Sequence[Any]) -> Any:
        if key not in self._exe:
            start = time.perf_counter()
            abstract = jax.tree.map(_abstract, args)
            devices = list(jax.tree.leaves(args)[0].sharding.mesh.devices.flat)
            self._exe[key] = compile_cache.compile_scoped(
                self.scope,
                f"split/{kind}/{np.dtype(self.accum_dtype).name}",
                abstract,
                devices,
                lambda: build().lower(*abstract),
            )
            self.compiles[kind] += 1
            self.compile_s[kind] += time.perf_counter() - start
        return self._exe[key]

    def _gradients_program(self, specs: Any) -> Any:
        group = PartitionSpec(mesh_lib.GROUP_AXES)
        table_specs = slots.Slots(group, group, group, PartitionSpec(), PartitionSpec())
        per_group = lambda p, s, t: step_fns.group_gradients(
            self.loss_fn, p, s, t, self.accum_dtype, reduce=False
        )
        is_spec = lambda x: isinstance(x, PartitionSpec)
        out = (
            jax.tree.map(lambda sp: _stacked(self.mesh, sp), specs, is_leaf=is_spec),
            NamedSharding(self.mesh, group),
        )
        return jax.jit(
            jax.shard_map(
                per_group,
                mesh=self.mesh,
                in_specs=(PartitionSpec(), group, table_specs),
                out_specs=group,
                axis_names=set(mesh_lib.GROUP_AXES),
            ),
            out_shardings=out,
        )

    @staticmethod
    def _cross_program(live: Mesh, specs: Any) -> Any:
        is_spec = lambda x: isinstance(x, PartitionSpec)
        rep = NamedSharding(live, PartitionSpec())

        def cross(grads: Any, losses: jax.Array) -> tuple[Any, jax.Array, jax.Array]:
            total = jax.tree.map(lambda g: g.sum(axis=0), grads)
            loss = losses.sum()
            return total, loss, jnp.isfinite(loss) & jnp.isfinite(_squares(total))

        out = (jax.tree.map(lambda sp: NamedSharding(live, sp), specs, is_leaf=is_spec), rep, rep)
        return jax.jit(cross, out_shardings=out)

    def _update_program(self, state_shardings: Any) -> Any:
        rep = NamedSharding(self.mesh, PartitionSpec())

        def update(state: Any, grad_sum: Any, loss_sum: jax.Array, denom: jax.Array) -> Any:
            return step_fns.update_step(state, grad_sum, loss_sum, denom, tx=self.tx)

        metrics = {"loss": rep, "grad_norm": rep}
        return jax.jit(update, out_shardings=(state_shardings, metrics), donate_argnums=(0,))

    # ------------------------------------------------------------------ steps

    def _domain(self, x: Any, shape: Sequence[int] | None = None) -> Any:
        """A live-mesh array as the domain's (no copy): group-replicated keeps its shape,
        group-stacked (``shape`` given) keeps the domain's rows. Abstract in, abstract out."""
        return _on(x, NamedSharding(self.mesh, x.sharding.spec), shape)

    def _rows(self, x: Any) -> Any:
        return self._domain(x, (self.rows.size, *x.shape[1:]))

    def _inputs(self, params: Any, stacks: Any, table: slots.Slots) -> tuple[Any, Any, Any]:
        return (
            jax.tree.map(self._domain, params),
            jax.tree.map(self._rows, stacks),
            slots.Slots(
                index=self._rows(table.index),
                weight=self._rows(table.weight),
                alive=self._rows(table.alive),
                denom=self._domain(table.denom),
                n_slots=self._domain(table.n_slots),
            ),
        )

    def _gradients_exe(self, args: tuple[Any, Any, Any]) -> Any:
        specs = jax.tree.map(lambda x: x.sharding.spec, args[0])
        key = ("gradients", jax.tree.structure(args))
        return self._compiled(key, "gradients", lambda: self._gradients_program(specs), args)

    def gradients(self, params: Any, stacks: Any, table: slots.Slots) -> tuple[Any, jax.Array]:
        """Dispatch the domain's program on live-mesh inputs: each group's unreduced sums.

        Returns the domain's ``[g, ...]`` gradient sums and ``[g]`` loss sums
        (arrays over the domain's mesh; nothing has crossed domains yet).
        """
        args = self._inputs(params, stacks, table)
        return self._gradients_exe(args)(*args)

    @staticmethod
    def _cross_args(live: Mesh, parts: Sequence[tuple[Any, Any]]) -> tuple[Any, Any]:
        groups = mesh_lib.num_groups(live)
        grads = jax.tree.map(lambda *g: list(g), *[p[0] for p in parts])
        stacked = jax.tree.map(
            lambda g: _on(
                g, _stacked(live, PartitionSpec(*g[0].sharding.spec[1:])), (groups, *g[0].shape[1:])
            ),
            grads,
            is_leaf=lambda x: isinstance(x, list),
        )
        losses = [p[1] for p in parts]
        return stacked, _on(losses, _stacked(live, PartitionSpec()), (groups,))

    def _cross_exe(self, live: Mesh, args: tuple[Any, Any]) -> Any:
        specs = jax.tree.map(lambda g: PartitionSpec(*g.sharding.spec[1:]), args[0])
        key = ("cross", tuple(d.id for d in live.devices.flat), jax.tree.structure(args))
        return self._compiled(key, "cross", lambda: self._cross_program(live, specs), args)

    def cross(
        self, live: Mesh, parts: Sequence[tuple[Any, jax.Array]]
    ) -> tuple[Any, jax.Array, jax.Array]:
        """Sum every live group's sums over ``live``: ``(grad_sum, loss_sum, finite)``.

        ``parts`` are the `gradients` of the domains this process holds (its
        own; a single process simulating several domains passes them all).
        Every live process calls this in the same step.
        """
        args = self._cross_args(live, parts)
        return self._cross_exe(live, args)(*args)

    def _update_args(self, state: Any, grad_sum: Any, loss_sum: Any, denom: Any) -> tuple:
        return (
            jax.tree.map(self._domain, state),
            jax.tree.map(self._domain, grad_sum),
            self._domain(loss_sum),
            self._domain(denom),
        )

    def _update_exe(self, args: tuple) -> Any:
        shardings = jax.tree.map(lambda x: x.sharding, args[0])
        key = ("update", jax.tree.structure(args))
        return self._compiled(key, "update", lambda: self._update_program(shardings), args)

    def update(
        self, state: Any, grad_sum: Any, loss_sum: jax.Array, denom: jax.Array
    ) -> tuple[Any, dict[str, jax.Array]]:
        """Apply finite cross sums to the domain's replica of ``state`` (donated).

        Returns the domain's new replica over the domain's mesh (`lift` puts
        it back on ``live``) and the step's metrics.
        """
        args = self._update_args(state, grad_sum, loss_sum, denom)
        return self._update_exe(args)(*args)

    def precompile(self, live: Mesh, state: Any, stacks: Any, table: slots.Slots) -> float:
        """Compile whatever of the three programs these live-mesh inputs still need; seconds.

        The inputs may be abstract (``jax.ShapeDtypeStruct`` with shardings on ``live``).
        """
        before = sum(self.compile_s.values())
        abstract = lambda tree: jax.tree.map(_abstract, tree)
        state, stacks, table = abstract(state), abstract(stacks), abstract(table)
        args = self._inputs(state.params, stacks, table)
        grads, losses = self._gradients_exe(args).out_info
        cross_args = self._cross_args(live, [(grads, losses)])
        grad_sum, loss_sum, _ = self._cross_exe(live, cross_args).out_info
        self._update_exe(self._update_args(state, grad_sum, loss_sum, table.denom))
        return sum(self.compile_s.values()) - before

    def ready(self, live: Mesh) -> bool:
        """Whether the cross program for ``live`` (and the domain's own two) are compiled."""
        ids = tuple(d.id for d in live.devices.flat)
        kinds = {k[0] for k in self._exe}
        return {"gradients", "update"} <= kinds and any(
            k[0] == "cross" and k[1] == ids for k in self._exe
        )


def _abstract(x: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)


def _on(x: Any, sharding: NamedSharding, shape: Sequence[int] | None = None) -> Any:
    """`view` for arrays; the matching ``jax.ShapeDtypeStruct`` for abstract values."""
    first = x[0] if isinstance(x, list) else x
    if isinstance(first, jax.Array):
        return view(x, sharding, shape)
    x = first
    return jax.ShapeDtypeStruct(
        tuple(x.shape if shape is None else shape), x.dtype, sharding=sharding
    )
