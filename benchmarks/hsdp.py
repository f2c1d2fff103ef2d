"""HSDP layouts: SPARe's step vs a hand-written HSDP step, its device memory, and rows read.

    python benchmarks/hsdp.py                      # sections 1 and 2 (a few minutes on 2 cores)
    python benchmarks/hsdp.py --sections=memory    # section 2 alone (seconds)
    python benchmarks/hsdp.py --processes          # also section 3: two 8-process jobs
    python benchmarks/hsdp.py --rows=64,256,1024   # section 1 at three micro-batch sizes
    python benchmarks/hsdp.py --tiny --steps=2 --warmup=1 --out=/tmp/hsdp.json   # smoke run

1. Failure-free SPARe (r = 2) vs a hand-written HSDP step on the same mesh,
   parameter specs and global batch: ``jax.grad`` of the mean loss plus optax,
   jitted with the state donated, the batch's rows split over the group axes
   and the first inner axis. Three inner layouts (FSDP, tensor, FSDP x tensor)
   of an MLP on 8 simulated CPU devices, m = 1. Interleaved rounds; the ratio is
   the median of per-round ratios. Target <= 1.02. ``--rows`` sweeps the rows
   of a micro-batch (its compute) at a fixed state: SPARe's own cost per step
   (the slot loop, the masking) is about fixed, so its share falls as the
   compute grows.
2. Device memory per device of the compiled step (XLA's ``memory_analysis``):
   the fused step with the state donated (``fused donated``, one process), the
   split step (``split``: a reduction that keeps the state, then an update that
   takes it), the step split by failure domain as a multi-process job with one
   process a group runs it (``by domain``: one domain's ``gradients``, the
   ``cross`` sum over every group, its ``update``), and the form multi-process
   jobs ran before (``fused (before)``: fused, nothing donated). ``peak`` is
   arguments + outputs + temporaries - aliased; the state's own bytes beside it.
3. (``--processes``) Rows each process reads per step, measured: the same
   8-process job (``experiments/regression.py``, groups of 2 processes,
   ``data:1,redundancy:4,fsdp:2``) with per-unit input and with the global
   batch on every process; beside them ``r * m * b / parts`` per held group and
   the global batch ``G * m * b``.

``--tiny`` shrinks the model (a smoke run for tests; its figures are not
measurements). ``--out`` writes the results as JSON to that one file.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags
from jax.sharding import NamedSharding, PartitionSpec

import spare_jax
from spare_jax import cli, domains, multihost, runlog
from spare_jax import mesh as mesh_lib

_STEPS = flags.DEFINE_integer("steps", 20, "Timed rounds per comparison.", lower_bound=1)
_WARMUP = flags.DEFINE_integer("warmup", 3, "Untimed calls per configuration.", lower_bound=1)
_OUT = flags.DEFINE_string("out", "", "Optional JSON file for the results.")
_TINY = flags.DEFINE_bool("tiny", False, "Tiny model: a smoke run.")
_PROCESSES = flags.DEFINE_bool("processes", False, "Also run section 3 (two 8-process jobs).")
_SECTIONS = flags.DEFINE_multi_enum(
    "sections", ["speed", "memory"], ["speed", "memory"], "Sections 1 (speed) and 2 (memory)."
)
_ROWS = flags.DEFINE_list(
    "rows", ["64"], "Rows per micro-batch per group: a section-1 table each (section 2: the first)."
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# mesh, (fsdp axis, tensor axis) of the MLP's specs
LAYOUTS = {
    "fsdp": ("data:1,redundancy:4,fsdp:2", ("fsdp", None)),
    "tensor": ("data:1,redundancy:4,tensor:2", (None, "tensor")),
    "fsdp x tensor": ("data:1,redundancy:2,fsdp:2,tensor:2", ("fsdp", "tensor")),
}


def mlp(width: int, depth: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        f"w{i}": (rng.normal(size=(width, width)) / np.sqrt(width)).astype(np.float32)
        for i in range(depth)
    }


def loss_fn(params: dict[str, jax.Array], batch: dict[str, jax.Array]) -> jax.Array:
    h = batch["x"]
    for i in range(len(params)):
        h = jnp.tanh(h @ params[f"w{i}"])
    return jnp.mean((h - batch["y"]) ** 2)


def specs_for(params: dict[str, Any], fsdp: str | None, tensor: str | None) -> dict[str, Any]:
    """Alternate column- and row-sharded layers over ``tensor``; the other dim over ``fsdp``."""
    return {
        k: PartitionSpec(fsdp, tensor) if i % 2 == 0 else PartitionSpec(tensor, fsdp)
        for i, k in enumerate(sorted(params))
    }


def interleaved(jobs: list[Callable[[], float]]) -> np.ndarray:
    for job in jobs:
        for _ in range(_WARMUP.value):
            job()
    times = np.empty((_STEPS.value, len(jobs)))
    for rnd in range(_STEPS.value):
        for k in np.roll(np.arange(len(jobs)), rnd):
            times[rnd, k] = jobs[k]()
    return times


def timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - t0


def versus_hand(width: int, depth: int, rows: int) -> list[dict[str, Any]]:
    """Section 1: SPARe's step vs a hand-written HSDP step, same mesh, specs and batch."""
    print(
        f"\n1. failure-free SPARe (r=2, m=1) vs a hand-written HSDP step (jax.grad + optax), "
        f"{rows} rows per micro-batch"
    )
    print(f"{'layout':>14} {'hand s':>9} {'spare s':>9} {'ratio':>6}  target <= 1.02")
    params, tx, out = mlp(width, depth), optax.adamw(1e-3), []
    for name, (shape, (fsdp, tensor)) in LAYOUTS.items():
        mesh = spare_jax.make_mesh(shape)
        specs = specs_for(params, fsdp, tensor)
        batch_axes = (fsdp,) if fsdp else ()
        step = spare_jax.make_train_step(
            loss_fn, tx, mesh, redundancy=2, param_specs=specs, batch_axes=batch_axes
        )
        rng = np.random.default_rng(1)
        x = rng.normal(size=(step.groups * rows, width)).astype(np.float32)
        batch = {"x": x, "y": np.sin(x)}
        alive = np.ones(step.groups, bool)
        table, _ = step.table(alive)
        stacks = step.stacks(batch)
        box = {"spare": step.init(params)}

        # The hand step: the global batch's rows over the groups and the FSDP axis.
        row_axes = ("data", "redundancy", *batch_axes)
        placed = jax.device_put(batch, NamedSharding(mesh, PartitionSpec(row_axes)))
        shardings = step.state_shardings(params)

        def hand(p, o, b):
            grads = jax.grad(loss_fn)(p, b)
            updates, o = tx.update(grads, o, p)
            return optax.apply_updates(p, updates), o

        hand_step = jax.jit(
            hand,
            out_shardings=(shardings.params, shardings.opt_state),
            donate_argnums=(0, 1),
        )
        init = step.init(params)
        box["hand"] = (init.params, init.opt_state)

        def run_spare(box=box, step=step, stacks=stacks, table=table):
            box["spare"], metrics = step.run(box["spare"], stacks, table)
            return box["spare"], metrics

        def run_hand(box=box, hand_step=hand_step, placed=placed):
            box["hand"] = hand_step(*box["hand"], placed)
            return box["hand"]

        times = interleaved([lambda: timed(run_hand), lambda: timed(run_spare)])
        t_hand, t_spare = np.median(times, axis=0)
        ratio = float(np.median(times[:, 1] / times[:, 0]))
        out.append(
            {"layout": name, "rows": rows, "hand_s": t_hand, "spare_s": t_spare, "ratio": ratio}
        )
        print(f"{name:>14} {t_hand:9.4f} {t_spare:9.4f} {ratio:6.3f}")
    return out


def by_domain(step: Any, state: Any, stacks: Any) -> dict[str, Any]:
    """The programs of the step split by failure domain, every group its own domain (one
    process a group), as a multi-process job runs them: the first domain's, compiled."""
    by_group = mesh_lib.group_devices(step.mesh)
    splits = [
        domains.Split(
            step.loss_fn,
            step.tx,
            multihost.survivors_mesh(by_group, np.array([g]), step.mesh),
            np.array([g]),
            step.accum_dtype,
        )
        for g in range(step.groups)
    ]
    table, _ = step.table(np.ones(step.groups, bool))
    parts = [split.gradients(state.params, stacks, table) for split in splits]
    grad_sum, loss_sum, _ = splits[0].cross(step.mesh, parts)
    replica = jax.tree.map(
        lambda x: domains.view(x, NamedSharding(splits[0].mesh, x.sharding.spec)), state
    )
    jax.block_until_ready(splits[0].update(replica, grad_sum, loss_sum, table.denom))
    return {key[0]: exe for key, exe in splits[0]._exe.items()}


def memory(width: int, depth: int, rows: int) -> list[dict[str, Any]]:
    """Section 2: the compiled step's device memory, per device, in each form."""
    print("\n2. device memory of the step per device (memory_analysis), bytes")
    print(
        f"{'layout':>14} {'form':>20} {'state':>9} {'args':>9} {'temps':>9} "
        f"{'aliased':>9} {'peak':>9}"
    )
    params, tx, out = mlp(width, depth), optax.adamw(1e-3), []
    for name, (shape, (fsdp, tensor)) in LAYOUTS.items():
        mesh = spare_jax.make_mesh(shape)
        base = spare_jax.make_train_step(
            loss_fn,
            tx,
            mesh,
            redundancy=2,
            param_specs=specs_for(params, fsdp, tensor),
            batch_axes=(fsdp,) if fsdp else (),
        )
        x = np.zeros((base.groups * rows, width), np.float32)
        stacks = base.stacks({"x": x, "y": x})
        forms = {
            "fused donated": base,
            "fused (before)": base.on_mesh(mesh, base.rows, donate=False),
            "split": base.on_mesh(mesh, base.rows, split=True),
        }
        programs = []
        for form, step in forms.items():
            state = step.init(params)
            own = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(state))
            step.precompile(state, stacks)
            programs.append((form, own, step._aot[step.slot_bound]))
            if form == "split":  # what a multi-process job runs: one domain's programs
                programs.append(("by domain", own, by_domain(step, state, stacks)))
        for form, own, compiled in programs:
            for program, exe in compiled.items():
                m = exe.memory_analysis()
                args, outs, temps = m.argument_size_in_bytes, m.output_size_in_bytes, 0
                temps, aliased = m.temp_size_in_bytes, m.alias_size_in_bytes
                peak = args + outs + temps - aliased
                label = form if len(compiled) == 1 else f"{form}: {program}"
                out.append(
                    {"layout": name, "form": label, "state": own, "arguments": args,
                     "outputs": outs, "temporaries": temps, "aliased": aliased, "peak": peak}
                )  # fmt: skip
                print(
                    f"{name:>14} {label:>20} {own:9d} {args:9d} {temps:9d} {aliased:9d} {peak:9d}"
                )
    return out


def rows_read(out_dir: str) -> list[dict[str, Any]]:
    """Section 3: rows each process reads per step, per-unit input vs the global batch."""
    print("\n3. rows read per process per step: 8 processes, groups of 2, G=4, r=2, m=2, b=4")
    print(f"{'input':>8} {'rows/step':>10} {'r*m*b/parts':>12} {'G*m*b':>6}")
    out = []
    for form in ("units", "global"):
        workdir = os.path.join(out_dir, form)
        command = [
            sys.executable, "-m", "spare_jax.launch", "--processes=8", "--devices_per_process=1",
            f"--launch_dir={workdir}/launch", "--", sys.executable,
            os.path.join(ROOT, "experiments", "regression.py"), f"--workdir={workdir}",
            "--mesh=data:1,redundancy:4,fsdp:2", f"--input={form}", "--steps=4",
            "--checkpoint_steps=100",
        ]  # fmt: skip
        env = {**os.environ, "JAX_PLATFORMS": "cpu"}
        subprocess.run(command, check=True, cwd=ROOT, env=env, timeout=900, capture_output=True)
        records = runlog.read_records(os.path.join(workdir, "metrics.jsonl"))
        per_step = max(r["input_rows"] for r in records if "input_rows" in r)
        out.append({"input": form, "rows_per_step": per_step, "expected": 8, "global": 32})
        print(f"{form:>8} {per_step:10d} {2 * 2 * 4 // 2:12d} {4 * 2 * 4:6d}")
    return out


def main(argv: list[str]) -> None:
    del argv
    out_path = cli.output_file("out", _OUT.value) if _OUT.value else None
    try:
        sizes = [int(r) for r in _ROWS.value]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise app.UsageError(
            f"--rows={','.join(_ROWS.value)}: positive integers, e.g. --rows=64,256"
        )
    width, depth = (16, 2) if _TINY.value else (512, 4)
    sizes = [4] if _TINY.value else sizes
    print(f"MLP {depth} x {width}x{width}, {jax.device_count()} devices")
    results: dict[str, Any] = {}
    if "speed" in _SECTIONS.value:
        results["versus_hand"] = [row for n in sizes for row in versus_hand(width, depth, n)]
    if "memory" in _SECTIONS.value:
        results["memory"] = memory(width, depth, sizes[0])
    if _PROCESSES.value:
        with tempfile.TemporaryDirectory() as tmp:
            results["rows_read"] = rows_read(tmp)
    if out_path:
        with open(out_path, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)
        print(f"\nwrote {out_path}")


if __name__ == "__main__":
    jax.config.update("jax_num_cpu_devices", 8)
    cli.run(main)
