"""Step-time benchmark of the public SPARe step: vs plain DP, through failures, and its wrapper.

    python benchmarks/step.py                          # full tables (several minutes on 2 cores)
    python benchmarks/step.py --steps=5                # quicker, noisier
    python benchmarks/step.py --sections=6             # one section (repeat the flag for more)
    python benchmarks/step.py --tiny --steps=2 --warmup=1 --out=/tmp/step.json   # smoke run

Everything runs in one process on 8 simulated CPU devices with the project's
LM, built through `spare_jax.make_train_step`. Configurations that are compared
are timed in interleaved rounds (one call of each per round, in a rotating
order, after ``--warmup`` untimed calls); a time is the median over the
``--steps`` rounds and a ratio is the median of the per-round ratios, so load
drifting on a shared machine hits both sides of a ratio alike.

1. Failure-free SPARe (cyclic stacking, r = 2) vs plain data parallelism on the
   same mesh, model and global batch (meshes 2x2x2 and 8x1x1, m = 4): the time
   ratio, target <= 1.10.
2. Through failures (mesh 8x1x1, whole shards m = 1 and m = 4): each step's
   time over the failure-free step vs the assignment's ``max_load / m``; the
   affine fit of step time vs slots (a fixed cost per step plus a cost per
   slot); and the control, failure-free plain DP walking the same number of
   slots, timed in the same rounds, which SPARe through failures should match.
3. Memory: bytes of one step's stacked input (r shards per group) vs one copy
   of the global batch, on the host and on the devices.
4. The public entry point ``step(state, batch, alive)`` (host batch, host live
   mask, slot table cached) vs the bare jitted step ``step.run(state, stacks,
   table)`` on inputs already placed, side by side, with what the wrapper adds
   broken down: laying the host batch out as stacks and sending it
   (``step.stacks``), the cached and uncached slot table, and the entry point
   called with a batch that is already a device array.

5. `spare_jax.fit`'s loop vs a hand loop of ``step(state, batch, alive)``.
6. The step split by failure domain, as every multi-process job runs it
   (`spare_jax.domains`: the domain's gradients, the cross-group sum, the
   update), vs the fused step of one process: the time ratio, target <= 1.02,
   and each program's compile time.

``--tiny`` shrinks the model and keeps one mesh (8x1x1) and whole shards: a
smoke run for tests, whose figures are not measurements.

``--platform=gpu`` runs section 6 on the GPUs present (a mesh of one group
per GPU, r = 2 where there are two or more groups, else 1) with a larger
bfloat16 model (`GPU_MODEL`): the split step's failure-free cost and each
program's compile time where the step is short and compiles are long. The
other sections are defined on 8 CPU devices. ``--out`` writes the
results as JSON to that one file (checked before anything is measured).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
import optax
from absl import app, flags

import spare_jax
from spare_jax import cli, domains, reorder

sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments")
)
from lm import data as data_lib
from lm import model as model_lib
from lm import setup as experiment

_STEPS = flags.DEFINE_integer("steps", 30, "Timed rounds per comparison.", lower_bound=1)
_WARMUP = flags.DEFINE_integer("warmup", 3, "Untimed calls per configuration.", lower_bound=1)
_BATCH = flags.DEFINE_integer(
    "batch", 4, "Sequences per micro-batch (compute per slot).", lower_bound=1
)
_OUT = flags.DEFINE_string("out", "", "Optional JSON file for the results.")
_TINY = flags.DEFINE_bool("tiny", False, "Tiny model, one mesh, m = 1 only: a smoke run.")
_SECTIONS = flags.DEFINE_multi_enum(
    "sections", ["1", "2", "3", "4", "5", "6"], ["1", "2", "3", "4", "5", "6"], "Sections to run."
)
_PLATFORM = flags.DEFINE_enum(
    "platform", "cpu", ["cpu", "gpu"], "cpu: 8 simulated devices; gpu: the GPUs, section 6."
)

DEVICES = 8
MODEL = model_lib.ModelConfig(vocab=256, seq_len=64, d_model=128, heads=4, layers=2, d_ff=512)
TINY_MODEL = model_lib.ModelConfig(vocab=32, seq_len=8, d_model=16, heads=2, layers=1, d_ff=32)
# About 0.13 B parameters: a step of tens of milliseconds on one GPU.
GPU_MODEL = model_lib.ModelConfig(
    vocab=8192, seq_len=512, d_model=1024, heads=16, layers=8, d_ff=4096, dtype="bfloat16"
)


@dataclasses.dataclass(frozen=True)
class Lm:
    """The project's LM as a user of the public API sees it: a loss, parameters, shardings."""

    cfg: model_lib.ModelConfig
    loss_fn: Callable[[Any, Any], jax.Array]
    params: Any
    specs: Any
    tx: optax.GradientTransformation

    @classmethod
    def build(cls, cfg: model_lib.ModelConfig) -> Lm:
        graphdef, params = model_lib.init_params(cfg, 0)
        loss = functools.partial(model_lib.loss_fn, graphdef)
        tx = experiment.make_optimizer(1e-3, 10, 1000)
        return cls(cfg, loss, params, model_lib.param_specs(params), tx)


class Bench:
    """One `SpareStep` (mesh, strategy, r, m, policy), its state and one step's inputs."""

    def __init__(
        self,
        lm: Lm,
        mesh_shape: tuple[int, int, int],
        strategy: str,
        r: int,
        m: int,
        batch: int,
        policy: str = "adaptive",
    ):
        self.mesh_shape, self.m = mesh_shape, m
        self.step = spare_jax.make_train_step(
            lm.loss_fn,
            lm.tx,
            spare_jax.make_mesh(mesh_shape),
            strategy=strategy,
            redundancy=r,
            microbatches=m,
            policy=policy,
            param_specs=lm.specs,
        )
        self.label = f"{strategy} r={r} m={m} {'x'.join(map(str, mesh_shape))}"
        source = data_lib.MarkovSource(lm.cfg.vocab, lm.cfg.seq_len, batch, seed=0)
        self.batch = data_lib.global_batch(source, self.step.groups * m, 0)  # host int32
        self.state = self.step.init(lm.params)
        self.stacks = self.step.stacks(self.batch)

    def alive(self, dead: Sequence[int] = ()) -> np.ndarray:
        return reorder.alive_mask(self.step.groups, list(dead))

    def run(self, table: Any) -> float:
        """Seconds of the bare jitted step on placed inputs, dispatch to result."""
        t0 = time.perf_counter()
        self.state, metrics = self.step.run(self.state, self.stacks, table)
        jax.block_until_ready((self.state, metrics))
        return time.perf_counter() - t0

    def call(self, batch: Any, alive: np.ndarray) -> float:
        """Seconds of the public entry point ``step(state, batch, alive)``."""
        t0 = time.perf_counter()
        self.state, metrics = self.step(self.state, batch, alive)
        jax.block_until_ready((self.state, metrics["loss"]))
        return time.perf_counter() - t0

    def layout_then_run(self, alive: np.ndarray) -> float:
        """Seconds of the same work spelled out: ``stacks``, ``table``, then ``run``."""
        t0 = time.perf_counter()
        stacks = self.step.stacks(self.batch)
        table, _ = self.step.table(alive)
        self.state, metrics = self.step.run(self.state, stacks, table)
        jax.block_until_ready((self.state, metrics))
        return time.perf_counter() - t0

    def layout(self) -> float:
        """Seconds to lay the host batch out as stacks and place them on the groups."""
        t0 = time.perf_counter()
        jax.block_until_ready(self.step.stacks(self.batch))
        return time.perf_counter() - t0


def interleaved(jobs: Sequence[Callable[[], float]]) -> np.ndarray:
    """Seconds of every job in every round: float[rounds, jobs].

    Each job is warmed up (and compiled) first; then every round calls every
    job once, starting at a different job each round.
    """
    for job in jobs:
        for _ in range(_WARMUP.value):
            job()
    times = np.empty((_STEPS.value, len(jobs)))
    for rnd in range(_STEPS.value):
        for k in np.roll(np.arange(len(jobs)), rnd):
            times[rnd, k] = jobs[k]()
    return times


def ratio(times: np.ndarray, a: int, b: int) -> float:
    """Median over rounds of job ``a``'s time over job ``b``'s."""
    return float(np.median(times[:, a] / times[:, b]))


def mesh_name(shape: Sequence[int]) -> str:
    return "x".join(map(str, shape))


class Benches:
    """Benches built once and shared between sections (each costs a compilation)."""

    def __init__(self, lm: Lm, batch: int):
        self.lm, self.batch = lm, batch
        self._made: dict[tuple, Bench] = {}

    def get(self, shape: tuple[int, int, int], strategy: str, r: int, m: int, policy="adaptive"):
        key = (shape, strategy, r, m, policy)
        if key not in self._made:
            self._made[key] = Bench(self.lm, shape, strategy, r, m, self.batch, policy)
        return self._made[key]


def spare_vs_dp(benches: Benches, meshes: Sequence[tuple], m: int) -> list[dict[str, Any]]:
    """Section 1: failure-free SPARe r = 2 vs plain DP, same mesh, model and global batch."""
    print("\n1. failure-free SPARe (r=2) vs plain DP, same mesh, model and global batch")
    print(f"{'mesh':>6} {'m':>2} {'dp s':>9} {'spare s':>9} {'ratio':>6}  target <= 1.10")
    rows = []
    for shape in meshes:
        dp, spare = benches.get(shape, "dp", 1, m), benches.get(shape, "spare", 2, m)
        dp_table, spare_table = dp.step.table(dp.alive())[0], spare.step.table(spare.alive())[0]
        times = interleaved(
            [functools.partial(dp.run, dp_table), functools.partial(spare.run, spare_table)]
        )
        t_dp, t_spare = np.median(times, axis=0)
        row = {"mesh": list(shape), "m": m, "dp_s": t_dp, "spare_s": t_spare}
        rows.append({**row, "ratio": ratio(times, 1, 0)})
        print(f"{mesh_name(shape):>6} {m:>2} {t_dp:9.4f} {t_spare:9.4f} {rows[-1]['ratio']:6.3f}")
    return rows


def through_failures(benches: Benches, m: int, cases: Sequence[tuple]) -> dict[str, Any]:
    """Section 2 for one m: time ratio vs max_load / m, the affine fit, the DP control."""
    shape = (8, 1, 1)
    runs = []
    for dead, policy in cases:
        bench = benches.get(shape, "spare", 2, m, policy)
        table, load = bench.step.table(bench.alive(dead))
        runs.append((dead, policy, bench, table, load))
    loads = sorted({load for *_, load in runs})
    controls = {load: benches.get(shape, "dp", 1, load) for load in loads}
    control_tables = {load: c.step.table(c.alive())[0] for load, c in controls.items()}
    jobs = [functools.partial(b.run, t) for _, _, b, t, _ in runs]
    jobs += [functools.partial(controls[load].run, control_tables[load]) for load in loads]
    times = interleaved(jobs)
    medians = np.median(times, axis=0)
    base_control = len(runs) + loads.index(m)  # DP walking m slots, failure-free
    rows = []
    for k, (dead, policy, _, _, load) in enumerate(runs):
        r_time = ratio(times, k, 0)
        ctl = len(runs) + loads.index(load)
        row = {
            "r": 2,
            "m": m,
            "policy": policy,
            "dead": list(dead),
            "max_load": load,
            "expected": load / m,
            "time_s": float(medians[k]),
            "ratio": r_time,
            "deviation": r_time / (load / m) - 1,
            "control": ratio(times, ctl, base_control),
            "vs_control": ratio(times, k, ctl) - 1,
        }
        rows.append(row)
        print(
            f"{2:>2} {m:>2} {policy:>8} {dead!s:>10} {load:>3} {load / m:6.3f} "
            f"{row['time_s']:8.4f} {r_time:6.3f} {row['deviation']:+7.1%} "
            f"{row['control']:8.3f} {row['vs_control']:+7.1%}"
        )
    # Step time = a fixed cost per step (optimizer, psum, dispatch) + a cost per slot.
    slope, fixed = np.polyfit([row["max_load"] for row in rows], medians[: len(runs)], 1)
    fit = {"m": m, "fixed_s": float(fixed), "per_slot_s": float(slope)}
    fit["fixed_share"] = float(fixed / medians[0])
    print(
        f"   fit m={m}: step = {fixed:.4f} s fixed + {slope:.4f} s per slot "
        f"(fixed share of the failure-free step {fit['fixed_share']:.0%})"
    )
    return {"rows": rows, "fit": fit}


def memory(benches: Benches, shapes: Sequence[tuple], m: int) -> list[dict[str, Any]]:
    """Section 3: stacked input bytes vs one global batch (arithmetic, host and device arrays)."""
    print("\n3. memory of one step's input: stacks of r shards vs one copy of the global batch")
    print(
        f"{'step':>18} {'host stacked':>13} {'global batch':>13} {'extra':>10} {'factor':>6} "
        f"{'device stacked':>15}"
    )
    rows = []
    for shape in shapes:
        for strategy, r in (("dp", 1), ("spare", 2)):
            bench = benches.get(shape, strategy, r, m)
            seq_len = benches.lm.cfg.seq_len
            b = data_lib.stack_bytes(bench.step.placement, m, benches.batch, seq_len)
            stacked = sum(x.nbytes for x in jax.tree.leaves(bench.stacks))  # global array bytes
            device = sum(s.data.nbytes for s in bench.stacks.addressable_shards)
            if stacked != b["stacked"] or bench.batch.nbytes != b["global_batch"]:
                raise AssertionError(f"{bench.label}: stack_bytes disagrees with the arrays")
            rows.append({"step": bench.label, **b, "device_stacked": device})
            print(
                f"{bench.label:>18} {b['stacked']:>13,} {b['global_batch']:>13,} "
                f"{b['extra']:>10,} {b['factor']:>6} {device:>15,}"
            )
    print("(device bytes count every model-axis copy of a group's stack)")
    return rows


def entry_point(benches: Benches, shapes: Sequence[tuple], m: int) -> list[dict[str, Any]]:
    """Section 4: ``step(state, batch, alive)`` vs ``step.run(state, stacks, table)``."""
    print(
        "\n4. public entry point step(state, batch, alive) vs the bare jitted step "
        "step.run(state, stacks, table) on placed inputs"
    )
    print(
        f"{'step':>18} {'run s':>8} {'entry s':>8} {'ratio':>6} {'spelled':>8} {'ratio':>6} "
        f"{'stacks s':>9} {'table hit':>10} {'table miss':>11} {'dev batch s':>12}"
    )
    rows = []
    for shape in shapes:
        bench = benches.get(shape, "spare", 2, m)
        alive = bench.alive()
        table, _ = bench.step.table(alive)
        device_batch = jax.device_put(bench.batch)
        times = interleaved(
            [
                functools.partial(bench.run, table),
                functools.partial(bench.call, bench.batch, alive),
                functools.partial(bench.layout_then_run, alive),
                bench.layout,
                functools.partial(bench.call, device_batch, alive),
            ]
        )
        med = np.median(times, axis=0)
        hits = []
        for _ in range(max(_STEPS.value, 10)):
            t0 = time.perf_counter()
            bench.step.table(alive)
            hits.append(time.perf_counter() - t0)
        misses = []
        for g in range(bench.step.groups):  # each live set is new to the cache once
            t0 = time.perf_counter()
            bench.step.table(bench.alive([g]))
            misses.append(time.perf_counter() - t0)
        row = {
            "step": bench.label,
            "run_s": float(med[0]),
            "entry_s": float(med[1]),
            "entry_vs_run": ratio(times, 1, 0),
            "spelled_out_s": float(med[2]),
            "entry_vs_spelled_out": ratio(times, 1, 2),
            "stacks_s": float(med[3]),
            "table_hit_s": float(np.median(hits)),
            "table_miss_s": float(np.median(misses)),
            "device_batch_entry_s": float(med[4]),
            "device_batch_vs_run": ratio(times, 4, 0),
            "compiles": bench.step.compiles,
        }
        rows.append(row)
        print(
            f"{bench.label:>18} {row['run_s']:8.4f} {row['entry_s']:8.4f} "
            f"{row['entry_vs_run']:6.3f} {row['spelled_out_s']:8.4f} "
            f"{row['entry_vs_spelled_out']:6.3f} {row['stacks_s']:9.4f} "
            f"{row['table_hit_s'] * 1e6:8.1f}us {row['table_miss_s'] * 1e3:9.2f}ms "
            f"{row['device_batch_entry_s']:12.4f}"
        )
    print(
        "(entry / run: what the wrapper costs over pre-placed inputs, mostly the host layout "
        "and transfer (stacks s); entry / spelled: the wrapper vs calling stacks, table and run "
        "yourself, as spare_jax.fit does; dev batch: the entry point given a jax.Array batch)"
    )
    return rows


def fit_loop(benches: Benches, shapes: Sequence[tuple], m: int) -> list[dict[str, Any]]:
    """Section 5: `spare_jax.fit`'s loop vs a hand loop of ``step(state, batch, alive)``."""
    print(
        "\n5. spare_jax.fit's loop (checkpoints, records, failure handling) vs a hand loop of "
        "step(state, batch, alive), per step, same step and batch"
    )
    print(f"{'step':>18} {'hand s':>8} {'fit s':>8} {'ratio':>6}")
    rows = []
    n = max(_STEPS.value, 5)
    for shape in shapes:
        bench = benches.get(shape, "spare", 2, m)
        alive = bench.alive()

        def hand(bench: Bench = bench, alive: np.ndarray = alive) -> list[float]:
            return [bench.call(bench.batch, alive) for _ in range(n)]

        hand_before = hand()
        seen: list[dict[str, Any]] = []
        with tempfile.TemporaryDirectory() as workdir:
            spare_jax.fit(
                bench.step,
                benches.lm.params,
                lambda t, batch=bench.batch: batch,
                steps=n + 1,
                workdir=workdir,
                checkpoint_steps=n + 1,  # one save, after the last timed step
                on_step=seen.append,
            )
        hand_after = hand()
        fit_s = float(np.median([r["step_time_s"] + r["data_time_s"] for r in seen[1:]]))
        hand_s = float(np.median(hand_before + hand_after))
        rows.append(
            {"step": bench.label, "hand_s": hand_s, "fit_s": fit_s, "ratio": fit_s / hand_s}
        )
        print(f"{bench.label:>18} {hand_s:8.4f} {fit_s:8.4f} {fit_s / hand_s:6.3f}")
    print("(fit's per-step time is its own record: batch layout + step + reading the metrics)")
    return rows


def split_vs_fused(benches: Benches, shapes: Sequence[tuple], m: int) -> list[dict[str, Any]]:
    """Section 6: the multi-process step split by failure domain vs the fused step.

    The split runs as a multi-process job runs it (`domains.Split`, one domain
    over the whole mesh here): the domain's gradient program, the cross-group
    sum, a host read of the finite flag, then the donating update. Beside it,
    the two-program form over the whole mesh (``split=True``: the reduction
    with its psum, then the update) that multi-process jobs ran before.
    """
    print("\n6. the step split by failure domain (gradients, cross, update) vs the fused step")
    print(
        f"{'mesh':>6} {'m':>2} {'fused s':>9} {'domain s':>9} {'ratio':>6} {'2-prog s':>9} "
        f"{'ratio':>6}  target <= 1.02"
    )
    rows = []
    for shape in shapes:
        r = min(2, shape[0] * shape[1])  # one group (one GPU): no neighbour to hold
        fused = benches.get(shape, "spare", r, m)
        split = Bench(benches.lm, shape, "spare", r, m, benches.batch)
        two = Bench(benches.lm, shape, "spare", r, m, benches.batch)
        base = split.step
        program = domains.Split(base.loss_fn, base.tx, base.mesh, base.rows, base.accum_dtype)
        split.step = base.on_mesh(base.mesh, base.rows, domain=program)
        two.step = two.step.on_mesh(two.step.mesh, two.step.rows, split=True)
        tables = [b.step.table(b.alive())[0] for b in (fused, split, two)]
        times = interleaved(
            [lambda b=b, tb=tb: b.run(tb) for b, tb in zip((fused, split, two), tables)]
        )
        row = {
            "mesh": mesh_name(shape),
            "m": m,
            "fused_s": float(np.median(times[:, 0])),
            "split_s": float(np.median(times[:, 1])),
            "ratio": ratio(times, 1, 0),
            "two_program_s": float(np.median(times[:, 2])),
            "two_program_ratio": ratio(times, 2, 0),
            "compiled": dict(program.compiles),
            "compile_s": {k: round(v, 4) for k, v in program.compile_s.items()},
        }
        rows.append(row)
        print(
            f"{row['mesh']:>6} {m:>2} {row['fused_s']:9.4f} {row['split_s']:9.4f} "
            f"{row['ratio']:6.3f} {row['two_program_s']:9.4f} {row['two_program_ratio']:6.3f}"
            f"  compile s: {row['compile_s']}"
        )
    return rows


def main(argv: list[str]) -> None:
    del argv
    cli.output_file("out", _OUT.value)
    tiny = _TINY.value
    if _PLATFORM.value == "gpu":
        if set(_SECTIONS.value) != {"6"}:
            raise app.UsageError("--platform=gpu runs section 6 only: pass --sections=6")
        jax.config.update("jax_platforms", "cuda")  # "gpu" would also try ROCm
        lm = Lm.build(TINY_MODEL if tiny else GPU_MODEL)
        meshes = [(jax.device_count(), 1, 1)]
    else:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", DEVICES)
        if jax.device_count() < DEVICES:
            raise app.UsageError(f"need {DEVICES} CPU devices, JAX has {jax.device_count()}")
        lm = Lm.build(TINY_MODEL if tiny else MODEL)
        meshes = [(8, 1, 1)] if tiny else [(2, 2, 2), (8, 1, 1)]
    m_free = 1 if tiny else 4
    print(
        f"devices: {jax.device_count()} x {jax.devices()[0].device_kind}, host cores: "
        f"{os.cpu_count()}, model {lm.cfg}, {_BATCH.value} sequences per micro-batch; "
        f"medians of {_STEPS.value} interleaved rounds after {_WARMUP.value} warm-up calls"
        + (" (--tiny: a smoke run, not a measurement)" if tiny else "")
    )
    benches = Benches(lm, _BATCH.value)
    results: dict[str, Any] = {
        "config": {
            "steps": _STEPS.value,
            "warmup": _WARMUP.value,
            "batch": _BATCH.value,
            "tiny": tiny,
            "platform": jax.devices()[0].platform,
            "device_kind": jax.devices()[0].device_kind,
            "model": dataclasses.asdict(lm.cfg),
            "cores": os.cpu_count(),
        }
    }
    run = set(_SECTIONS.value)
    if "1" in run:
        results["spare_vs_dp"] = spare_vs_dp(benches, meshes, m_free)
    if "2" in run:
        print(
            "\n2. step time through failures vs the assignment's max_load / m (mesh 8x1x1, one "
            "ring of 8); control: failure-free DP walking the same slot count, same rounds"
        )
        print(
            f"{'r':>2} {'m':>2} {'policy':>8} {'dead':>10} {'L':>3} {'L/m':>6} {'time s':>8} "
            f"{'ratio':>6} {'vs L/m':>7} {'control':>8} {'vs ctl':>7}"
        )
        cases = {1: [((), "adaptive"), ((3,), "adaptive"), ((1, 5), "adaptive")]}
        if not tiny:
            cases[4] = [
                ((), "adaptive"),
                ((3,), "adaptive"),
                ((1, 5), "adaptive"),
                ((1, 4, 6), "adaptive"),
                ((3,), "fixed"),
            ]
        results["load"], results["fit"] = [], []
        for m, runs in cases.items():
            out = through_failures(benches, m, runs)
            results["load"] += out["rows"]
            results["fit"].append(out["fit"])
    if "3" in run:
        results["memory"] = memory(benches, meshes, m_free)
    if "4" in run:
        results["entry_point"] = entry_point(benches, meshes, m_free)
    if "5" in run:
        results["fit_loop"] = fit_loop(benches, meshes, m_free)
    if "6" in run:
        results["split_vs_fused"] = split_vs_fused(benches, meshes, m_free)
    if _OUT.value:
        with cli.replace_file(_OUT.value) as f:
            json.dump(results, f, indent=1)
        print(f"\nwrote {_OUT.value}")


if __name__ == "__main__":
    sys.exit(cli.run(main))
