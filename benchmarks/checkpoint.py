"""Checkpoint benchmark: async vs blocking Orbax saves, restores, and the interval they imply.

    python benchmarks/checkpoint.py                         # the LM of configs/lm_tiny.py
    python benchmarks/checkpoint.py --config.model.d_model=256 --repeats=9
    python benchmarks/checkpoint.py --config=configs/lm_tiny.py:smoke --repeats=2 --steps=2

On the project's LM (``experiments/lm`` set up from ``--config``, 8 simulated
CPU devices) and its train state after one step, in one process, side by
side:

(a) Saves through `spare_jax.checkpoint.Checkpointer`, asynchronous
    (``use_async=True``, what the trainer uses) and blocking, timed in
    interleaved rounds (alternating which goes first): the **stall** (how long
    ``save`` keeps the training loop waiting), and for the async save the time
    until it has completed on disk. The ratio is the median of the per-round
    ratios.
(b) Restores (`Checkpointer.restore_latest` onto ``step.abstract_state``):
    the library's own restore time and the call's wall time, which adds
    waiting for saves in flight, listing the directory and the checksum.
(c) The checkpoint interval the trainer would use, from
    `spare_jax.checkpoint.IntervalModel.interval` on these measured figures,
    for a few failure rates (failures per group per step), next to Young's
    ``sqrt(2 C M)``, Daly's higher-order form and the exact optimum of the
    Poisson model on the same figures: ``C`` the measured save stall, ``M`` the
    model's mean time to interruption (``mtti_s``). In steps and seconds, with
    the model's interval over Young's and Daly's. For an async save the model
    also charges the save's duration, and it plans a run of ``--run_steps``
    steps; Young and Daly know neither. A row is starred when the model's
    expected time-to-train at its interval is infinite (a save costs too
    much against the MTTI): that interval is then arbitrary.

Medians over ``--repeats`` rounds after one untimed save of each kind.
Checkpoints go to a temporary directory that is removed at the end; nothing is
written elsewhere except the ``--out`` JSON file, if given (checked first).
"""

from __future__ import annotations

import dataclasses
import json
import logging as std_logging
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from absl import app, flags, logging

from spare_jax import analysis, checkpoint, cli, liveness, strategies, trainer
from spare_jax import mesh as mesh_lib

sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments")
)
from lm import setup as experiment

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_CONFIG = cli.config_file_flag(
    "config",
    os.path.join(_ROOT, "configs", "lm_tiny.py"),
    "Training config whose LM and mesh are checkpointed (configs/lm_tiny.py:smoke is tiny).",
)
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed rounds of saves and restores.", lower_bound=1)
_STEPS = flags.DEFINE_integer("steps", 5, "Timed train steps (for the step time).", lower_bound=1)
_RATES = flags.DEFINE_list(
    "rates", ["1e-3", "1e-2", "5e-2"], "Failure rates to plan for, per group per step."
)
_RUN_STEPS = flags.DEFINE_integer(
    "run_steps", 10_000, "Length of the run the interval model plans for.", lower_bound=1
)
_OUT = flags.DEFINE_string("out", "", "Optional JSON file for the results.")


def rates(values: Sequence[str]) -> list[float]:
    """``--rates`` as floats in (0, 1), or `app.UsageError`."""
    try:
        out = [float(v) for v in values]
    except ValueError:
        raise app.UsageError(f"--rates must be numbers, got {','.join(values)!r}") from None
    if not out or not all(0.0 < r < 1.0 for r in out):
        raise app.UsageError(f"--rates must lie in (0, 1) failures per group per step, got {out}")
    return out


def _quiet_orbax() -> None:
    """Keep Orbax's per-save log lines out of the table."""
    logging.get_absl_handler().addFilter(lambda record: "orbax" not in record.pathname)
    std_logging.getLogger("absl").addFilter(lambda record: "orbax" not in record.pathname)


def step_time(run: experiment.Run, steps: int) -> tuple[Any, float]:
    """The state after warm-up, and the median seconds of the public step (batch pre-made)."""
    step, alive = run.step, np.ones(run.groups, bool)
    batch = run.batch(0)
    state, metrics = step(run.fresh_state(), batch, alive)  # compiles
    jax.block_until_ready(metrics["loss"])
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        state, metrics = step(state, batch, alive)
        jax.block_until_ready((state, metrics["loss"]))
        times.append(time.perf_counter() - t0)
    return state, statistics.median(times)


def save_once(ckpt: checkpoint.Checkpointer, k: int, state: Any) -> tuple[float, float]:
    """(stall, seconds until complete) of one forced save at step ``k``."""
    stall = ckpt.save(k, state, {"step": k}, force=True)
    done = ckpt.wait()
    if stall is None or [d.step for d in done] != [k]:
        raise RuntimeError(f"save {k} in {ckpt.directory} did not happen")
    return stall, done[0].write_s


def restore_once(ckpt: checkpoint.Checkpointer, abstract: Any, want: int) -> tuple[float, float]:
    """(the library's restore seconds, the call's wall seconds) of the newest checkpoint."""
    t0 = time.perf_counter()
    restored = ckpt.restore_latest(abstract)
    wall = time.perf_counter() - t0
    if restored is None or restored.step != want:
        got = None if restored is None else restored.step
        raise RuntimeError(f"restored step {got} from {ckpt.directory}, expected {want}")
    jax.block_until_ready(restored.state)
    return restored.restore_s, wall


def measure(run: experiment.Run, state: Any, repeats: int, root: str) -> dict[str, Any]:
    """Sections (a) and (b): interleaved saves and restores, async and blocking."""
    ckpts = {
        mode: checkpoint.Checkpointer(
            os.path.join(root, mode),
            checkpoint.Interval(total=10**6, pinned=1),
            keep=2,
            use_async=mode == "async",
        )
        for mode in ("async", "blocking")
    }
    abstract = run.step.abstract_state(run.params)
    try:
        for ckpt in ckpts.values():  # warm-up: Orbax set-up, the checksum's compilation
            save_once(ckpt, 0, state)
            restore_once(ckpt, abstract, 0)
        out: dict[str, dict[str, list[float]]] = {
            mode: {"stall_s": [], "save_s": [], "restore_s": [], "restore_wall_s": []}
            for mode in ckpts
        }
        for k in range(1, repeats + 1):
            order = list(ckpts) if k % 2 else list(reversed(ckpts))
            for mode in order:
                stall, save_s = save_once(ckpts[mode], k, state)
                out[mode]["stall_s"].append(stall)
                out[mode]["save_s"].append(save_s)
            for mode in order:
                restore_s, wall = restore_once(ckpts[mode], abstract, k)
                out[mode]["restore_s"].append(restore_s)
                out[mode]["restore_wall_s"].append(wall)
    finally:
        for ckpt in ckpts.values():
            ckpt.close()
    result: dict[str, Any] = {
        mode: {key: statistics.median(values) for key, values in figures.items()}
        for mode, figures in out.items()
    }
    stall_ratio = np.asarray(out["async"]["stall_s"]) / np.asarray(out["blocking"]["stall_s"])
    result["async_over_blocking_stall"] = float(np.median(stall_ratio))
    return result


def intervals(
    run: experiment.Run, step_s: float, saves: dict[str, Any], rate_list: Sequence[float]
) -> list[dict[str, Any]]:
    """Section (c): the model's interval vs Young, Daly and the exact optimum, per rate and mode."""
    config = run.config
    rows = []
    for mode in ("async", "blocking"):
        fig = saves[mode]
        for rate in rate_list:
            model = dataclasses.replace(
                trainer.interval_model(
                    run.step,
                    liveness.Failures(run.groups, rate=rate),
                    int(config.steps),
                    float(config.checkpoint.gpu_mtbf_hours),
                ),
                steps=_RUN_STEPS.value,
            )
            steps, figures = model.interval(step_s, fig["stall_s"], fig["save_s"], fig["restore_s"])
            scenario = model.scenario(step_s, fig["stall_s"], fig["save_s"], fig["restore_s"])
            kind = strategies.canonical(config.strategy)
            ttt = analysis.time_to_train(
                scenario,
                kind,
                redundancy=model.redundancy if kind != "dp" else 1,
                microbatches=model.microbatches,
                policy="adaptive" if model.policy == "drop" else model.policy,
                checkpoint_interval_s=figures["interval_s"],
            ).time_to_train_s
            c, m = fig["stall_s"], figures["mtti_s"]
            young, daly = analysis.young(c, m), analysis.daly(c, m)
            exact = analysis.exact_optimum(c, m)
            rows.append(
                {
                    "mode": mode,
                    "rate": rate,
                    "C_s": c,
                    "mtti_s": m,
                    "model_steps": steps,
                    "model_s": figures["interval_s"],
                    "young_s": young,
                    "daly_s": daly,
                    "exact_s": exact,
                    "young_steps": young / step_s,
                    "daly_steps": daly / step_s,
                    "exact_steps": exact / step_s,
                    "model_over_young": figures["interval_s"] / young,
                    "model_over_daly": figures["interval_s"] / daly,
                    "model_ttt_s": ttt,
                    "figures": figures,
                }
            )
    return rows


def main(argv: list[str]) -> None:
    del argv
    cli.output_file("out", _OUT.value)
    rate_list = rates(_RATES.value)
    config = cli.config_value(_CONFIG)
    try:
        experiment.validate(config)
    except ValueError as error:
        raise app.UsageError(f"bad --config: {error}") from None
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", max(8, int(np.prod(config.mesh))))
    _quiet_orbax()
    run = experiment.setup(config)
    state, step_s = step_time(run, _STEPS.value)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(mesh_lib.shaped(run.init)))
    state_bytes = sum(x.nbytes for x in jax.tree.leaves(state))
    print(
        f"devices: {jax.device_count()} x {jax.devices()[0].platform}, host cores: "
        f"{os.cpu_count()}; mesh {tuple(config.mesh)}, {run.groups} groups, "
        f"{config.strategy} r={run.step.placement.redundancy} m={run.step.microbatches}; "
        f"{n_params:,} parameters, state {state_bytes:,} bytes; step {step_s:.4f} s "
        f"(median of {_STEPS.value}); medians of {_REPEATS.value} rounds"
    )
    with tempfile.TemporaryDirectory(prefix="spare-ckpt-bench-") as root:
        saves = measure(run, state, _REPEATS.value, root)

    print("\n(a) save: stall (training waits) and time until complete, async vs blocking")
    print(f"{'mode':>9} {'stall s':>9} {'complete s':>11}")
    for mode in ("async", "blocking"):
        print(f"{mode:>9} {saves[mode]['stall_s']:9.4f} {saves[mode]['save_s']:11.4f}")
    print(f"async stall / blocking stall: {saves['async_over_blocking_stall']:.3f}")

    print("\n(b) restore (Checkpointer.restore_latest onto step.abstract_state)")
    print(f"{'saved by':>9} {'restore s':>10} {'call s':>9}")
    for mode in ("async", "blocking"):
        print(f"{mode:>9} {saves[mode]['restore_s']:10.4f} {saves[mode]['restore_wall_s']:9.4f}")

    rows = intervals(run, step_s, saves, rate_list)
    print(
        f"\n(c) checkpoint interval: IntervalModel (run of {_RUN_STEPS.value:,} steps) vs Young "
        "sqrt(2CM), Daly and the exact Poisson optimum, C = stall, M = the model's MTTI"
    )
    print(
        f"{'mode':>9} {'rate':>7} {'C s':>8} {'MTTI s':>9} | {'model':>7} {'Young':>8} "
        f"{'Daly':>8} {'exact':>8} steps | {'model s':>8} {'Young s':>8} {'Daly s':>8} | "
        f"{'/Young':>6} {'/Daly':>6}"
    )
    for row in rows:
        flag = "" if np.isfinite(row["model_ttt_s"]) else " *"
        print(
            f"{row['mode']:>9} {row['rate']:7.0e} {row['C_s']:8.4f} {row['mtti_s']:9.2f} | "
            f"{row['model_steps']:>7} {row['young_steps']:8.1f} {row['daly_steps']:8.1f} "
            f"{row['exact_steps']:8.1f}       | {row['model_s']:8.3f} {row['young_s']:8.3f} "
            f"{row['daly_s']:8.3f} | {row['model_over_young']:6.3f} {row['model_over_daly']:6.3f}"
            f"{flag}"
        )
    if any(not np.isfinite(row["model_ttt_s"]) for row in rows):
        print(
            "* the model's expected time-to-train is infinite at its interval (saves cost too much "
            "against the MTTI for the run to finish), so that interval is arbitrary"
        )
    results = {
        "config": {
            "mesh": list(config.mesh),
            "strategy": config.strategy,
            "redundancy": run.step.placement.redundancy,
            "microbatches": run.step.microbatches,
            "groups": run.groups,
            "parameters": n_params,
            "state_bytes": state_bytes,
            "repeats": _REPEATS.value,
            "run_steps": _RUN_STEPS.value,
            "cores": os.cpu_count(),
        },
        "step_s": step_s,
        "save": {mode: saves[mode] for mode in ("async", "blocking")},
        "async_over_blocking_stall": saves["async_over_blocking_stall"],
        "intervals": rows,
    }
    if _OUT.value:
        with cli.replace_file(_OUT.value) as f:
            json.dump(results, f, indent=1)
        print(f"\nwrote {_OUT.value}")


if __name__ == "__main__":
    sys.exit(cli.run(main))
