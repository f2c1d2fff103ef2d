"""The step split by failure domain, in one process: domains, views, exactness, compiles.

One process stands in for several: each failure domain gets its own `domains.Split`
(its own programs over its own devices), and the cross program gets every domain's
sums. Exactness is against the single-device `jax.grad` reference of test_library.
"""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from test_layouts import LAYOUTS, global_batch, init_params, make_step, reference
from test_library import assert_close

from spare_jax import domains, inputs, multihost, reorder
from spare_jax import mesh as mesh_lib

# ------------------------------------------------------------------ domains


def reference_domains(owners: np.ndarray) -> np.ndarray:
    """Union-find over groups sharing a process, numbered by lowest group."""
    parent = list(range(len(owners)))

    def root(g):
        while parent[g] != g:
            g = parent[g]
        return g

    for a in range(len(owners)):
        for b in range(a):
            if set(owners[a].tolist()) & set(owners[b].tolist()):
                parent[root(a)] = root(b)
    roots = [root(g) for g in range(len(owners))]
    first = {r: i for i, r in enumerate(sorted(set(roots), key=roots.index))}
    return np.array([first[r] for r in roots])


@settings(max_examples=200, deadline=None)
@given(
    groups=st.integers(1, 12),
    per=st.integers(1, 3),
    procs=st.integers(1, 8),
    seed=st.integers(0, 2**16),
    whole=st.booleans(),
)
def test_failure_domains_join_groups_that_share_a_process(groups, per, procs, seed, whole):
    """Against union-find; ``whole``: every group on one process (no graph is built then)."""
    owners = np.random.default_rng(seed).integers(0, procs, size=(groups, 1 if whole else per))
    owners = np.repeat(owners, per, axis=1) if whole else owners
    got = domains.failure_domains(owners)
    np.testing.assert_array_equal(got, reference_domains(owners))
    for p in np.unique(owners):
        mine = domains.domain_of(owners, int(p))
        assert np.isin(np.flatnonzero((owners == p).any(1)), mine).all()
        assert np.unique(got[mine]).size == 1


@settings(max_examples=200, deadline=None)
@given(
    groups=st.integers(1, 10),
    per=st.integers(1, 3),
    procs=st.integers(1, 8),
    seed=st.integers(0, 2**16),
)
def test_whole_keeps_the_live_processes_whose_domains_are_all_live(groups, per, procs, seed):
    """The brute-force reading: a process can run when every process of its failure domain
    (the groups linked to its own by shared processes) is live."""
    rng = np.random.default_rng(seed)
    owners = rng.integers(0, procs, size=(groups, per))
    live = {int(p) for p in range(procs) if rng.random() < 0.7}
    got = domains.whole(owners, live)
    label = reference_domains(owners)
    members = {d: set(owners[label == d].ravel().tolist()) for d in set(label.tolist())}
    mine = {p: {d for d in members if p in members[d]} for p in range(procs)}
    want = [p for p in sorted(live) if all(members[d] <= live for d in mine[p])]
    assert got == want
    assert domains.whole(owners, got) == got  # what can run, runs on its own
    assert domains.whole(owners, range(procs)) == list(range(procs))


def test_failure_domains_of_common_layouts():
    one_each = np.arange(4)[:, None]
    np.testing.assert_array_equal(domains.failure_domains(one_each), [0, 1, 2, 3])
    spanning = np.array([[0, 1], [2, 3]])  # a group over two processes: one domain each
    np.testing.assert_array_equal(domains.failure_domains(spanning), [0, 1])
    two_per_process = np.array([[0], [0], [1], [1]])
    np.testing.assert_array_equal(domains.failure_domains(two_per_process), [0, 0, 1, 1])
    np.testing.assert_array_equal(domains.domain_of(two_per_process, 1), [2, 3])
    np.testing.assert_array_equal(domains.domain_of(two_per_process, 5), [])


# ------------------------------------------------------------------ the split step


class Job:
    """Every domain's `Split` of one process-like layout, and the step over a live set."""

    def __init__(self, layout: str, owners: np.ndarray, tx):
        self.step = make_step(layout, tx)
        self.mesh = self.step.mesh
        self.by_group = mesh_lib.group_devices(self.mesh)
        label = domains.failure_domains(owners)
        self.domains = [np.flatnonzero(label == d) for d in np.unique(label)]
        self.splits = [
            domains.Split(
                self.step.loss_fn,
                tx,
                multihost.survivors_mesh(self.by_group, rows, self.mesh),
                rows,
                self.step.accum_dtype,
            )
            for rows in self.domains
        ]

    def live_step(self, live_domains):
        rows = np.concatenate([self.domains[d] for d in live_domains])
        mesh = multihost.survivors_mesh(self.by_group, rows, self.mesh)
        return self.step.on_mesh(mesh, rows, split=True), rows

    def run(self, state, live_domains, t):
        """One step on the live domains; ``state`` is over the live step's mesh."""
        step, rows = self.live_step(live_domains)
        alive = np.isin(np.arange(self.step.groups), rows)
        table, _ = step.table(alive)
        stacks, _ = inputs.load(step, lambda t: global_batch(t, self.step.groups), t)
        mine = [self.splits[d] for d in live_domains]
        parts = [s.gradients(state.params, stacks, table) for s in mine]
        grad_sum, loss_sum, finite = mine[0].cross(step.mesh, parts)
        assert bool(np.asarray(finite.addressable_shards[0].data))
        # Each domain's replica, viewed before any update donates its buffers.
        replicas = [
            jax.tree.map(
                lambda x, s=s: domains.view(x, NamedSharding(s.mesh, x.sharding.spec)), state
            )
            for s in mine
        ]
        news = [s.update(r, grad_sum, loss_sum, table.denom)[0] for s, r in zip(mine, replicas)]
        return domains.lift(step.mesh, news), step


def covered(placement, rows):
    alive = np.isin(np.arange(placement.groups), rows)
    return reorder.uncovered(placement, alive).size == 0


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_the_split_step_is_exact_through_losses_and_compiles_the_model_once(layout):
    """Domains of one and two groups; losses between steps: every leaf against jax.grad.

    Each domain's gradient and update programs compile once, whatever the live
    set; the cross program once per live set.
    """
    tx = optax.adamw(1e-2)
    groups = make_step(layout, tx).groups
    owners = np.array([[0]] + [[1]] * (groups - 2) + [[2]])  # the middle groups share one
    job = Job(layout, owners, tx)
    order = [list(range(len(job.domains)))]
    for d in range(len(job.domains)):  # then lose each domain the shards can spare
        if len(order[-1]) == 1:
            break
        rows = np.concatenate([job.domains[e] for e in order[-1] if e != d])
        if d in order[-1] and covered(job.step.placement, rows):
            order.append([e for e in order[-1] if e != d])
    assert len(order) >= 2, "the test needs at least one loss"
    full_step, _ = job.live_step(order[0])
    state = full_step.init(init_params())
    steps = 0
    for live in order:
        step, rows = job.live_step(live)
        state = multihost.reshard(
            state, multihost.on_mesh(step.mesh, jax.tree.map(lambda x: x.sharding, state))
        )
        for _ in range(2):
            state, step = job.run(state, live, steps)
            steps += 1
    want = reference(init_params(), tx, [global_batch(t, groups) for t in range(steps)], groups * 2)
    assert_close(jax.device_get(state.params), want)
    for split in job.splits:
        assert split.compiles["gradients"] == 1 and split.compiles["update"] == 1
    assert sum(split.compiles["cross"] for split in job.splits) == len(order)


@settings(max_examples=4, deadline=None)
@given(seed=st.integers(0, 2**16), layout=st.sampled_from(sorted(LAYOUTS)))
def test_the_domain_step_of_one_process_equals_the_fused_step(seed, layout):
    """`SpareStep` with a `domains.Split` over the whole mesh (one domain) is the fused step."""
    fused = make_step(layout)
    split = make_step(layout)
    rows = np.arange(split.groups)
    program = domains.Split(split.loss_fn, split.tx, split.mesh, rows, split.accum_dtype)
    split = split.on_mesh(split.mesh, rows, domain=program)
    assert split.split and not split.compiled()
    batch = global_batch(seed, fused.groups)
    alive = np.ones(fused.groups, bool)
    state = split.init(init_params())
    split.precompile(state, split.stacks(batch))
    assert split.compiled() and program.compiles == {"gradients": 1, "cross": 1, "update": 1}
    a, _ = fused(fused.init(init_params()), batch, alive)
    b, metrics = split(state, batch, alive)
    assert bool(metrics["finite"])
    assert_close(jax.device_get(a.params), jax.device_get(b.params))
    assert program.compiles == {"gradients": 1, "cross": 1, "update": 1}  # none at run time


def test_a_view_shares_the_buffers():
    step = make_step("fsdp")
    state = step.init(init_params())
    x = state.params["w1"]
    rows = np.array([1, 2])
    sub = multihost.survivors_mesh(mesh_lib.group_devices(step.mesh), rows, step.mesh)
    v = domains.view(x, jax.sharding.NamedSharding(sub, x.sharding.spec))
    ptr = lambda a: {s.device: s.data.unsafe_buffer_pointer() for s in a.addressable_shards}
    assert all(ptr(x)[d] == p for d, p in ptr(v).items())
    np.testing.assert_array_equal(np.asarray(v), np.asarray(x))
