"""HSDP layouts: any inner axes inside a group, per-unit input, fp32 sums, donation.

Every exactness check compares parameters after training through random
non-interrupting live sets against a single-device reference written with
`jax.grad` and optax (fp32 round-off: rtol 1e-5, atol 1e-6).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_library import assert_close, random_alive
from test_library import reference as library_reference

import spare_jax
from spare_jax import inputs
from spare_jax import mesh as mesh_lib

B = 4  # rows of one micro-batch
M = 2  # micro-batches per group

# (mesh, parameter specs by inner axis role, batch axes): FSDP, tensor, both.
LAYOUTS = {
    "fsdp": ("data:1,redundancy:4,fsdp:2", {"w1": ("fsdp", None), "w2": ("fsdp", None)}, "fsdp"),
    "tensor": (
        "data:1,redundancy:4,tensor:2",
        {"w1": (None, "tensor"), "w2": ("tensor", None)},
        (),
    ),
    "fsdp_tensor": (
        "data:1,redundancy:2,fsdp:2,tensor:2",
        {"w1": ("fsdp", "tensor"), "w2": ("tensor", None)},
        "fsdp",
    ),
}


def init_params(dtype=np.float32):
    rng = np.random.default_rng(0)
    return {
        "w1": (rng.normal(size=(8, 16)) / np.sqrt(8)).astype(dtype),
        "b1": np.zeros(16, dtype),
        "w2": (rng.normal(size=(16, 3)) / 4).astype(dtype),
    }


def loss_fn(params, batch):
    h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"] - batch["y"]) ** 2)


def global_batch(t, groups, dtype=np.float32):
    rng = np.random.default_rng([7, t])
    x = rng.normal(size=(groups * M * B, 8)).astype(dtype)
    y = np.stack([np.sin(x.sum(1)), np.cos(x[:, 0]), x[:, 1] ** 2], 1)
    return {"x": x, "y": y.astype(dtype)}


def per_unit(groups):
    """The per-unit form of `global_batch`: only the asked units' asked rows."""

    def batches(t, units):
        full = global_batch(t, groups)
        rows = units.rows(B)
        return jax.tree.map(lambda a: a.reshape(-1, B, *a.shape[1:])[units.ids][:, rows], full)

    return batches


def make_step(layout, tx=None, **kw):
    spec, roles, batch_axes = LAYOUTS[layout]
    mesh = spare_jax.make_mesh(spec)
    specs = {k: jax.P(*v) for k, v in roles.items()}
    specs["b1"] = jax.P(roles["w1"][1])
    return spare_jax.make_train_step(
        loss_fn,
        tx or optax.adamw(1e-2),
        mesh,
        redundancy=2,
        microbatches=M,
        param_specs=specs,
        batch_axes=batch_axes,
        **kw,
    )


def reference(params, tx, batches, units):
    """The single-device `jax.grad` + optax reference of tests/test_library.py, on this model."""
    return library_reference(params, loss_fn, tx, batches, units)


# ------------------------------------------------------------------ the mesh


def test_named_axes_parse_and_keep_the_three_number_form():
    assert mesh_lib.parse_axes((1, 4, 2)) == (("data", 1), ("redundancy", 4), ("model", 2))
    assert mesh_lib.parse_axes("data:1,redundancy:4,fsdp:2") == (
        ("data", 1),
        ("redundancy", 4),
        ("fsdp", 2),
    )
    assert mesh_lib.parse_axes({"fsdp": 2, "redundancy": 2, "tensor": 2}) == (
        ("data", 1),
        ("redundancy", 2),
        ("fsdp", 2),
        ("tensor", 2),
    )
    for bad, match in [
        ("data:1,redundancy", "NAME:SIZE"),
        ("data:1,fsdp:0", "positive integer"),
        ("fsdp:2,fsdp:2", "twice"),
        ((2, 2), "three positive"),
    ]:
        with pytest.raises(ValueError, match=match):
            mesh_lib.parse_axes(bad)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_group_is_a_contiguous_run_of_devices(layout):
    mesh = spare_jax.make_mesh(LAYOUTS[layout][0])
    per_group = mesh_lib.devices_per_group(mesh)
    order = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    for g, devs in mesh_lib.group_devices(mesh).items():
        assert devs == order[g * per_group : (g + 1) * per_group]
    assert mesh_lib.inner_axes(mesh) == tuple(mesh.axis_names[2:])


# ------------------------------------------------------------------ exactness


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("form", ["global", "units"])
def test_inner_layouts_are_exact_through_failures(layout, form):
    """Parameters sharded over inner axes, the batch split FSDP-style: exact against jax.grad."""
    tx = optax.adamw(1e-2)
    step = make_step(layout, tx)
    groups = step.groups
    source = per_unit(groups) if form == "units" else (lambda t: global_batch(t, groups))
    state = step.init(init_params())
    rng = np.random.default_rng(3)
    rows_read = []
    for t in range(3):
        alive = random_alive(step.placement, rng) if t else np.ones(groups, bool)
        table, _ = step.table(alive)
        stacks, rows = inputs.load(step, source, t)
        rows_read.append(rows)
        state, metrics = step.run(state, stacks, table)
        assert bool(metrics["finite"])
    # The state keeps the layout it was given.
    assert state.params["w1"].sharding.spec == jax.P(*LAYOUTS[layout][1]["w1"])
    want = reference(init_params(), tx, [global_batch(t, groups) for t in range(3)], groups * M)
    assert_close(jax.device_get(state.params), want)
    assert rows_read == [groups * M * B] * 3  # one process holds every unit once


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**16), layout=st.sampled_from(sorted(LAYOUTS)))
def test_split_reduce_then_update_equals_the_fused_step(seed, layout):
    """The multi-process form (reduce, then a donating update) computes the fused step's state."""
    fused = make_step(layout)
    split = make_step(layout)
    split = split.on_mesh(split.mesh, split.rows, split=True)
    rng = np.random.default_rng(seed)
    alive = random_alive(fused.placement, rng)
    batch = global_batch(seed, fused.groups)
    a, _ = fused(fused.init(init_params()), batch, alive)
    b, metrics = split(split.init(init_params()), batch, alive)
    assert bool(metrics["finite"])
    assert_close(jax.device_get(a.params), jax.device_get(b.params))


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_parameters_given_as_a_function_are_born_in_their_shards(layout):
    step = make_step(layout)
    build = lambda: jax.tree.map(jnp.asarray, init_params())
    assert step.abstract_state(build) == step.abstract_state(init_params())
    born, placed = step.init(build), step.init(init_params())
    for a, b in zip(jax.tree.leaves(born), jax.tree.leaves(placed), strict=True):
        assert a.sharding == b.sharding and a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    batch = global_batch(0, step.groups)
    alive = np.ones(step.groups, bool)
    a, _ = step(born, batch, alive)
    b, _ = step(placed, batch, alive)
    assert_close(jax.device_get(a.params), jax.device_get(b.params))


def test_bf16_parameters_sum_in_fp32():
    """bf16 parameters train (no XLA abort), summed in fp32: close to an fp32-summed reference."""
    tx = optax.sgd(0.1)
    step = make_step("fsdp", tx)
    params = init_params(jnp.bfloat16)
    state = step.init(params)
    batch = jax.tree.map(lambda a: a.astype(jnp.bfloat16), global_batch(0, step.groups))
    table, _ = step.table(np.ones(step.groups, bool))
    grad_sum, loss_sum, finite = step.reduce(state, step.stacks(batch), table)
    assert {x.dtype for x in jax.tree.leaves(grad_sum)} == {jnp.dtype(jnp.float32)}
    assert loss_sum.dtype == jnp.float32 and bool(finite)
    new, metrics = step(state, batch, np.ones(step.groups, bool))
    assert new.params["w1"].dtype == jnp.bfloat16 and np.isfinite(float(metrics["loss"]))
    # Reference: each micro-batch's bf16 gradient, summed in fp32, one SGD update in bf16.
    micro = jax.tree.map(lambda x: x.reshape(step.groups * M, B, *x.shape[1:]), batch)
    grads = jax.vmap(jax.grad(loss_fn), in_axes=(None, 0))(params, micro)
    mean = jax.tree.map(lambda g: g.astype(jnp.float32).sum(0) / (step.groups * M), grads)
    want = jax.tree.map(lambda p, g: p - (0.1 * g).astype(jnp.bfloat16), params, mean)
    jax.tree.map(
        lambda x, y: np.testing.assert_allclose(
            np.asarray(x, np.float32), np.asarray(y, np.float32), rtol=2e-2, atol=1e-3
        ),
        jax.device_get(new.params),
        want,
    )


def test_the_donated_state_is_reused_in_place():
    """memory_analysis: the state's buffers are aliased to the new state's (one state lives)."""
    step = make_step("fsdp_tensor")
    state = step.init(init_params())
    stacks = step.stacks(global_batch(0, step.groups))
    memory = step.memory(state, stacks)
    on_device0 = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(state) if x.ndim)
    assert memory["aliased"] >= on_device0
    assert memory["peak"] == (
        memory["arguments"] + memory["outputs"] + memory["temporaries"] - memory["aliased"]
    )


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_the_split_update_allocates_nothing_of_the_state_size(optimizer):
    """memory_analysis of a split step's update: the state (donated, reused) and the gradient
    sum, no gradient-sized temporary (a divided copy of the sums was one)."""
    mesh = spare_jax.make_mesh(LAYOUTS["fsdp"][0])
    tx = optax.sgd(0.1) if optimizer == "sgd" else optax.adam(1e-3)
    loss = lambda p, b: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)
    step = spare_jax.make_train_step(
        loss, tx, mesh, redundancy=2, microbatches=M, param_specs={"w": jax.P("fsdp", None)}
    )
    step = step.on_mesh(mesh, step.rows, split=True)
    state = step.init({"w": np.ones((512, 512), np.float32)})
    x = np.ones((step.groups * M * B, 512), np.float32)
    memory = step.memory(state, step.stacks({"x": x, "y": x}), program="update")
    params = state.params["w"].addressable_shards[0].data.nbytes
    assert memory["temporaries"] < params // 10, memory
    leaves = [leaf for leaf in jax.tree.leaves(state) if leaf.ndim]
    assert memory["aliased"] >= sum(leaf.addressable_shards[0].data.nbytes for leaf in leaves)
    with pytest.raises(ValueError, match="program: one of"):
        step.memory(state, step.stacks({"x": x, "y": x}), program="step")


# ------------------------------------------------------------------ bad input


def test_bad_layouts_are_named_in_one_line():
    spec = LAYOUTS["fsdp"][0]
    mesh = spare_jax.make_mesh(spec)
    cases = [
        ({"w1": jax.P("redundancy"), "b1": jax.P(), "w2": jax.P()}, r"\['w1'\].*group axis"),
        ({"w1": jax.P("tensor"), "b1": jax.P(), "w2": jax.P()}, r"\['w1'\].*not an axis"),
        ({"w1": jax.P(), "b1": jax.P(), "w2": jax.P(None, "fsdp")}, r"\['w2'\].*does not divide"),
        ({"w1": jax.P("fsdp", "fsdp"), "b1": jax.P(), "w2": jax.P()}, "twice"),
    ]
    for specs, match in cases:
        step = spare_jax.make_train_step(
            loss_fn, optax.sgd(0.1), mesh, redundancy=2, param_specs=specs
        )
        with pytest.raises(ValueError, match=match):
            step.init(init_params())
    for axes, match in [("redundancy", "inner axes"), ("tensor", "inner axes")]:
        with pytest.raises(ValueError, match=match):
            spare_jax.make_train_step(loss_fn, optax.sgd(0.1), mesh, batch_axes=axes)


def test_a_loader_returning_the_wrong_units_is_named():
    step = make_step("fsdp")
    good = per_unit(step.groups)
    short = lambda t, units: jax.tree.map(lambda a: a[1:], good(t, units))
    ragged = lambda t, units: {**good(t, units), "y": good(t, units)["y"][:, :1]}
    with pytest.raises(ValueError, match="returned 7 units, but 8 were asked for"):
        inputs.load(step, short, 0)
    with pytest.raises(ValueError, match=r"leaves shaped \[len\(units.ids\), rows, ...\] alike"):
        inputs.load(step, ragged, 0)
    with pytest.raises(ValueError, match="does not split into 2 equal parts"):
        inputs.Units(0, np.arange(2), 0, 1, 2).rows(3)


def test_the_per_unit_form_is_told_apart_by_its_arguments():
    assert inputs.takes_units(lambda t, units: None)
    assert not inputs.takes_units(lambda t: None)
    assert not inputs.takes_units(lambda t, units=None: None)


def test_one_group_with_inner_axes_is_exact():
    """The survivors' mesh can hold a single group: its sum needs no reduction across groups."""
    mesh = spare_jax.make_mesh("data:1,redundancy:1,fsdp:2,tensor:2")
    specs = {"w1": jax.P("fsdp", "tensor"), "b1": jax.P("tensor"), "w2": jax.P("tensor", None)}
    tx = optax.adamw(1e-2)
    step = spare_jax.make_train_step(
        loss_fn,
        tx,
        mesh,
        strategy="dp",
        redundancy=1,
        microbatches=M,
        param_specs=specs,
        batch_axes="fsdp",
    )
    for split in (False, True):
        s = step.on_mesh(step.mesh, step.rows, split=split)
        state = s.init(init_params())
        for t in range(2):
            state, _ = s(state, global_batch(t, 1), np.ones(1, bool))
        want = reference(init_params(), tx, [global_batch(t, 1) for t in range(2)], M)
        assert_close(jax.device_get(state.params), want)


def test_processes_may_span_groups_but_not_split_two():
    """A group may span processes; a process holding parts of two groups is named in one line."""
    from types import SimpleNamespace

    from spare_jax import multihost

    def fake_mesh(process_of_device, groups):
        devices = np.array([SimpleNamespace(process_index=p) for p in process_of_device])
        return SimpleNamespace(
            devices=devices.reshape(1, groups, -1), shape={"data": 1, "redundancy": groups}
        )

    spanning = multihost.group_processes(fake_mesh([0, 0, 1, 1, 2, 2, 3, 3], 2))
    assert spanning.tolist() == [[0, 0, 1, 1], [2, 2, 3, 3]]
    assert multihost.groups_touching(spanning, [1]).tolist() == [0]
    whole = multihost.group_processes(fake_mesh([0, 0, 0, 0, 1, 1, 1, 1], 4))
    assert multihost.groups_touching(whole, [1]).tolist() == [2, 3]
    with pytest.raises(ValueError, match=r"process 1 holds part of the devices of groups \[0, 1\]"):
        multihost.group_processes(fake_mesh([0, 0, 0, 1, 1, 1, 2, 2], 2))


@pytest.mark.parametrize("spec", [("fsdp", "tensor"), (None, "tensor"), (None, None)])
def test_own_shards_keep_each_distinct_shard_once_and_place_back_bit_exact(spec):
    """What a process keeps across a backend reset: its distinct shards only, never a full
    copy of what it does not hold, and they place back to the same array."""
    from spare_jax import multihost

    mesh = jax.make_mesh((2, 2, 2), ("redundancy", "fsdp", "tensor"))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))
    x = jax.device_put(np.arange(8 * 6, dtype=np.float32).reshape(8, 6), sharding)
    shards = multihost.own_shards(x)
    split = [mesh.shape[a] if a else 1 for a in spec]
    assert len(shards) == split[0] * split[1]  # the two redundancy replicas share each shard
    assert sum(s.size for s in shards.values()) == x.size
    like = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
    back = multihost.from_shards(shards, like)
    assert back.sharding == sharding
    np.testing.assert_array_equal(np.asarray(back), np.asarray(x))
