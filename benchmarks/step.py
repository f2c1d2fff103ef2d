"""Step-time benchmark of the failure-masked step: SPARe vs plain DP, and time vs load.

    python benchmarks/step.py                 # full table (a few minutes on 2 cores)
    python benchmarks/step.py --steps=5       # quicker, noisier

Everything runs in one process on simulated CPU devices, side by side, and
reports medians over ``--steps`` timed steps (after ``--warmup`` untimed ones);
configurations that are compared are timed in interleaved rounds and their
ratio is the median of the per-round ratios:

1. Failure-free SPARe (cyclic stacking, r = 2) vs plain data parallelism on the
   same mesh, model and global batch: the time ratio (target <= 1.10).
2. Through failures (whole shards m = 1 and m = 4): the measured step-time ratio
   to the failure-free step vs the assignment's ``max_load / m`` (target within
   15%). Every group walks ``max_load`` slots (SPMD), so on a CPU shared by all
   simulated devices the work, and hence the time, also scales with the load.
3. Memory: the host and device bytes of one step's stacked input vs one copy of
   the global batch.
"""

from __future__ import annotations

import json
import os
import sys
import time

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import jax
import numpy as np
from absl import flags

from spare_jax import cli, reorder
from spare_jax import data as data_lib
from spare_jax import mesh as mesh_lib
from spare_jax import model as model_lib
from spare_jax import train_step as step_lib

_STEPS = flags.DEFINE_integer("steps", 30, "Timed steps (rounds) per configuration.", lower_bound=1)
_WARMUP = flags.DEFINE_integer("warmup", 3, "Untimed steps per configuration.", lower_bound=1)
_OUT = flags.DEFINE_string("out", "", "Optional JSON file for the results.")
_BATCH = flags.DEFINE_integer(
    "batch", 4, "Sequences per micro-batch (compute per slot).", lower_bound=1
)

MODEL = model_lib.ModelConfig(vocab=256, seq_len=64, d_model=128, heads=4, layers=2, d_ff=512)


class _Bench:
    """One compiled step for a (mesh, placement, m); times live sets on it."""

    def __init__(self, mesh_shape: tuple[int, int, int], strategy: str, r: int, m: int):
        self.mesh = mesh_lib.make_mesh(mesh_shape)
        self.placement = mesh_lib.placement_for(strategy, self.mesh, r)
        self.m = m
        tx = step_lib.make_optimizer(1e-3, 10, 1000)
        graphdef, self.state, shardings = step_lib.init_state(MODEL, tx, self.mesh, seed=0)
        stack = self.placement.depth * self.placement.shard_units * m
        self.step = step_lib.TrainStep(self.mesh, graphdef, tx, shardings, slot_bound=stack)
        source = data_lib.MarkovSource(MODEL.vocab, MODEL.seq_len, _BATCH.value, seed=0)
        self.host_tokens = data_lib.stack_inputs(source, self.placement, m, 0)
        self.tokens = self.step.put_tokens(self.host_tokens)

    def plan(self, dead: list[int], policy: str = "adaptive") -> tuple[tuple[jax.Array, ...], int]:
        """The device plan of a dead set and its max load."""
        alive = reorder.alive_mask(self.placement.groups, dead)
        plan = step_lib.plan_from_assignment(reorder.assign(self.placement, alive, self.m, policy))
        return self.step.put_plan(plan), plan.max_load

    def once(self, plan: tuple[jax.Array, ...]) -> float:
        """Seconds of one step, dispatch to result."""
        t0 = time.perf_counter()
        with jax.transfer_guard("disallow"):
            self.state, metrics = self.step(self.state, self.tokens, plan)
        jax.block_until_ready(metrics)
        return time.perf_counter() - t0


def _interleaved(
    jobs: list[tuple[_Bench, tuple[jax.Array, ...]]],
) -> tuple[list[float], list[float]]:
    """Median step time of each job and its median time ratio to the first job.

    Every round times one step of every job back to back (in a rotating order),
    and a job's ratio is the median over rounds of its time over the first
    job's time in the same round, so load drifting on a shared machine hits
    both sides of each ratio alike.
    """
    for bench, plan in jobs:  # warm-up (and compilation) outside the timing
        for _ in range(_WARMUP.value):
            bench.once(plan)
    times = np.zeros((_STEPS.value, len(jobs)))
    for rnd in range(_STEPS.value):
        for k in np.roll(np.arange(len(jobs)), rnd):
            bench, plan = jobs[k]
            times[rnd, k] = bench.once(plan)
    medians = np.median(times, axis=0).tolist()
    ratios = np.median(times / times[:, :1], axis=0).tolist()
    return medians, ratios


def _device_bytes(array: jax.Array) -> int:
    return sum(s.data.nbytes for s in array.addressable_shards)


def main(argv: list[str]) -> None:
    del argv
    print(
        f"devices: {jax.device_count()} x {jax.devices()[0].platform}, "
        f"host cores: {os.cpu_count()}, "
        f"model {MODEL}, batch {_BATCH.value} sequences per micro-batch; "
        f"medians of {_STEPS.value} steps"
    )
    results: dict[str, list] = {"spare_vs_dp": [], "load": [], "memory": []}

    print("\n1. failure-free SPARe (r=2) vs plain DP, same mesh, model and global batch")
    print(f"{'mesh':>9} {'m':>2} {'dp s':>9} {'spare s':>9} {'ratio':>6}")
    benches = {}
    for shape in [(2, 2, 2), (8, 1, 1)]:
        m = 4
        dp = _Bench(shape, "dp", 1, m)
        spare = _Bench(shape, "spare", 2, m)
        benches[shape] = (dp, spare)
        (t_dp, t_spare), (_, ratio) = _interleaved(
            [(dp, dp.plan([])[0]), (spare, spare.plan([])[0])]
        )
        results["spare_vs_dp"].append(
            {"mesh": shape, "m": m, "dp_s": t_dp, "spare_s": t_spare, "ratio": ratio}
        )
        print(f"{'x'.join(map(str, shape)):>9} {m:>2} {t_dp:9.4f} {t_spare:9.4f} {ratio:6.3f}")

    print(
        "\n2. step time through failures vs the assignment's max_load / m "
        "(mesh 8x1x1, one ring of 8)"
    )
    print(
        f"{'r':>2} {'m':>2} {'policy':>8} {'dead':>10} {'L':>3} {'L/m':>6} {'time s':>8} "
        f"{'ratio':>6} {'dev':>7}"
    )
    cases = {
        1: [([], "adaptive"), ([3], "adaptive"), ([1, 5], "adaptive")],
        4: [
            ([], "adaptive"),
            ([3], "adaptive"),
            ([1, 5], "adaptive"),
            ([1, 4, 6], "adaptive"),
            ([3], "fixed"),
        ],
    }
    for m, runs in cases.items():
        bench = benches[(8, 1, 1)][1] if m == 4 else _Bench((8, 1, 1), "spare", 2, m)
        plans = [bench.plan(dead, policy) for dead, policy in runs]
        times, ratios = _interleaved([(bench, plan) for plan, _ in plans])
        for (dead, policy), (_, load), t, ratio in zip(runs, plans, times, ratios):
            expected = load / m
            dev = ratio / expected - 1
            results["load"].append(
                {
                    "r": 2,
                    "m": m,
                    "policy": policy,
                    "dead": dead,
                    "max_load": load,
                    "expected": expected,
                    "time_s": t,
                    "ratio": ratio,
                    "deviation": dev,
                }
            )
            print(
                f"{2:>2} {m:>2} {policy:>8} {dead!s:>10} {load:>3} {expected:6.3f} {t:8.4f} "
                f"{ratio:6.3f} "
                f"{dev:+7.1%}"
            )
        # Step time = fixed per-step cost (optimizer update, psum, dispatch) + cost per slot.
        slope, fixed = np.polyfit([load for _, load in plans], times, 1)
        print(
            f"   fit m={m}: step = {fixed:.4f} s fixed + {slope:.4f} s per slot "
            f"(fixed share of the failure-free step {fixed / times[0]:.0%})"
        )
        # Control: failure-free plain DP walking the same number of slots (m' = L).
        loads = sorted({load for _, load in plans})
        controls = [_Bench((8, 1, 1), "dp", 1, load) for load in loads]
        c_times, c_ratios = _interleaved([(c, c.plan([])[0]) for c in controls])
        control = dict(zip(loads, c_ratios))
        for (dead, policy), (_, load), ratio in zip(runs, plans, ratios):
            print(
                f"   control m={m} {policy:>8} dead {dead!s:>10}: DP with {load} slots runs "
                f"{control[load]:.3f}x its {loads[0]}-slot step; SPARe {ratio:.3f}x "
                f"({ratio / control[load] - 1:+.1%})"
            )
            results["load"][-len(runs) + runs.index((dead, policy))]["control"] = control[load]

    print("\n3. memory of one step's input: stacks of r shards vs one copy of the global batch")
    print(
        f"{'placement':>22} {'host stacked':>13} {'global batch':>13} {'extra':>10} "
        f"{'device stacked':>15}"
    )
    for shape, (dp, spare) in benches.items():
        for bench in (dp, spare):
            b = data_lib.stack_bytes(bench.placement, bench.m, _BATCH.value, MODEL.seq_len)
            dev = _device_bytes(bench.tokens)
            label = (
                f"{bench.placement.kind} r={bench.placement.redundancy} {'x'.join(map(str, shape))}"
            )
            assert b["stacked"] == bench.host_tokens.nbytes
            results["memory"].append({"placement": label, **b, "device_stacked": dev})
            print(
                f"{label:>22} {b['stacked']:>13,} {b['global_batch']:>13,} {b['extra']:>10,} "
                f"{dev:>15,}"
            )
    print(
        "(device bytes count every model-axis replica of a group's stack; parameters and optimizer "
        "state are identical for all strategies)"
    )
    if _OUT.value:
        with open(_OUT.value, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    sys.exit(cli.run(main))
