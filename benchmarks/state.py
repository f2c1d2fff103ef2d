"""A whole state at scale: moving it to a returning group, saving it, restoring it.

    python benchmarks/state.py                       # 64 MB, 512 MB, 2 GB; 3 repeats (minutes)
    python benchmarks/state.py --sizes_mb=64 --repeats=1 --sections=transfer

``--sections=transfer`` (the default runs both):

Each run is a fresh job of 3 processes of one CPU device each (one group
each), as a re-join sees it: process 0 holds the state (``--leaves`` float32
matrices of SGD parameters, ``--sizes_mb`` in all) on its host, processes 1
and 2 hold nothing and receive it (``--receivers=1``: process 1 alone, one
returning group as a re-join of one killed worker has it, while process 2
stands by). Side by side, per size:

* **devices**: `spare_jax.broadcast`, what a re-join does now: the holder's
  group streams its replica, ``CHUNK_BYTES`` per collective, to the
  receivers' devices (Gloo here, NCCL on GPU); the receivers assemble their
  arrays;
* **kv**: the transport a re-join used before (kept here, and only here, to
  compare): the holder packs the state into one in-memory ``.npz`` and puts
  it in the coordination service's key-value store; the receivers fetch,
  unpack and place it. One message: it stops near 2 GiB.

Printed per case, medians over ``--repeats``: seconds from the start of the
transfer to every receiver's state on its device, MB/s of state; *moving*,
the seconds of the collectives alone (the slowest receiver's; compiling the
transfer's program and assembling the arrays excluded, as `fit`'s
``move_mb_s`` in a ``rejoin`` event) and its MB/s, and beside it the
receiver's compile and its assembly of the arrays from the received bytes
(the rest of the whole is the barriers that start and end the run); and every
process's peak resident memory (``VmHWM``) above what it held before the
state existed (JAX's own), as a multiple of the state's bytes. A case that
fails says why.

``--sections=save``: one process saves the same state through
`spare_jax.checkpoint.Checkpointer` and restores it, in the two layouts: the
**replica** a multi-process job's writer saves (the state's digest computed
on device, a host copy, then ``replica.npz`` written in the background) and
**orbax**, a lone process's sharded arrays. Printed, medians: the save stall
(what the step loop waits for: the copy off the devices included), the
background write (start to complete, MB/s), the restore (read, checked,
placed; MB/s), the peak resident memory above JAX's own as a multiple of the
state, and the state that the write rate saves inside a preemption notice
(``--preempt_s``, the launcher's default 60 s, less 2 s to leave).
The copy of the state off the devices alone (`multihost.host_copy`, as the
replica's save makes it; timed after the rest) is printed beside the stall:
the floor a save's stall can reach. ``--out`` keeps a JSON of every run (appended).

``--platform=gpu`` puts the state on GPUs: the save section on the first
one, the transfer on one GPU per process (NCCL instead of Gloo; it needs 3
GPUs and says so otherwise).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time

from absl import app, flags

_SIZES = flags.DEFINE_list("sizes_mb", ["64", "512", "2048"], "State sizes, MB (10^6 bytes).")
_LEAVES = flags.DEFINE_integer("leaves", 4, "Matrices the state is made of.", lower_bound=1)
_CHUNK_MB = flags.DEFINE_integer(
    "chunk_mb",
    0,
    "devices: MiB per device and collective; 0: broadcast.CHUNK_BYTES.",
    lower_bound=0,
)
_REPEATS = flags.DEFINE_integer("repeats", 3, "Runs of each case.", lower_bound=1)
_METHODS = flags.DEFINE_list(
    "methods",
    ["devices", "kv"],
    "Transports: devices (the schedule broadcast.pipelined picks), chain or doubling (the "
    "devices with that schedule forced), kv.",
)
_RECEIVERS = flags.DEFINE_integer(
    "receivers",
    2,
    "Processes that receive the state: 2 (two groups return at once), or 1 (one group, as "
    "one killed worker's re-join; process 2 stands by).",
    lower_bound=1,
    upper_bound=2,
)
_KV_MAX = flags.DEFINE_float(
    "kv_max_mb",
    1024,
    "Skip kv above this size: its one message stops near 2 GiB, and its holder peaked at "
    "11x the state's bytes in RAM at 512 MB here.",
)
_OUT = flags.DEFINE_string("out", "", "Directory for state.json (optional).")
_SECTIONS = flags.DEFINE_list("sections", ["transfer", "save"], "transfer, save.")
_PREEMPT_S = flags.DEFINE_float("preempt_s", 60.0, "The preemption notice (launcher's default).")
_PLATFORM = flags.DEFINE_enum(
    "platform",
    "cpu",
    ["cpu", "gpu"],
    "Devices: cpu (one simulated device per process) or gpu (one GPU per process: the "
    "transfer needs 3).",
)
_WORKER = flags.DEFINE_string(
    "worker", "", "Internal: METHOD:MB:PORT:PROCESS or save:LAYOUT:MB:DIR."
)

PROCESSES = 3
_JAX_PLATFORM = {"cpu": "cpu", "gpu": "cuda"}  # JAX's "gpu" would also try ROCm
TIMEOUT_S = 900


def _vm_hwm() -> int:
    """This process's peak resident memory so far, bytes."""
    with open("/proc/self/status", encoding="utf-8") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _side(nbytes: int, leaves: int) -> int:
    """The side of each float32 matrix: a multiple of 8, so that 8 devices can shard it."""
    return int((nbytes / leaves / 4) ** 0.5) // 8 * 8


def _state(nbytes: int, leaves: int):
    """The state's matrices, one at a time (a receiver checks them without holding two copies)."""
    import numpy as np

    rng = np.random.default_rng(0)
    side = _side(nbytes, leaves)
    for _ in range(leaves):
        yield rng.standard_normal((side, side), dtype=np.float32)


def _kv(client, me: int, host, abstract) -> tuple[list, dict]:
    import jax
    import numpy as np

    if me > _RECEIVERS.value:  # standing by
        return [], {}
    if me == 0:
        buf = io.BytesIO()
        np.savez(buf, **{f"a{i}": x for i, x in enumerate(host)})
        client.key_value_set_bytes("bench/state", buf.getvalue())
        del buf
        return [], {}
    data = client.blocking_key_value_get_bytes("bench/state", TIMEOUT_S * 1000)
    with np.load(io.BytesIO(data)) as z:
        leaves = [jax.device_put(z[f"a{i}"], jax.local_devices()[0]) for i in range(len(abstract))]
    del data
    return leaves, {}


def _devices(me: int, host, abstract, schedule: str = "auto") -> tuple[list, dict]:
    """A receiver's leaves and its seconds: compiling the transfer, the collectives alone
    (``move_s``), assembling the arrays from the received bytes."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    from spare_jax import broadcast
    from spare_jax import mesh as mesh_lib

    rows = 1 + _RECEIVERS.value  # the holder and the receivers; a process left out stands by
    devices = sorted(jax.devices(), key=lambda d: d.process_index)[:rows]
    mesh = mesh_lib.make_mesh((1, rows, 1), devices)
    on_mesh = NamedSharding(mesh, PartitionSpec())
    abstract = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=on_mesh) for a in abstract]
    chunk = _CHUNK_MB.value << 20 or broadcast.CHUNK_BYTES
    source = host if me == 0 else None
    start = time.perf_counter()
    moved = broadcast.move(mesh, 0, abstract, source, chunk, schedule)
    jax.block_until_ready(moved.leaves)
    whole, done = time.perf_counter() - start, moved.transfer
    if not moved.leaves:
        return [], {}
    rest = whole - done.seconds - done.compile_s
    return moved.leaves, {"move_s": done.seconds, "compile_s": done.compile_s, "assemble_s": rest}


def _save_work(layout: str, mb: str, directory: str) -> None:
    """One save and one restore in this process: print a JSON line with the figures."""
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    import jax
    import numpy as np
    import optax

    from spare_jax import checkpoint, multihost
    from spare_jax.train_step import TrainState

    jax.config.update("jax_platforms", _JAX_PLATFORM[_PLATFORM.value])
    jax.devices()  # the runtime's own memory is not the state's
    base = _vm_hwm()
    nbytes = int(float(mb) * 1e6)
    params = {f"w{i}": x for i, x in enumerate(_state(nbytes, _LEAVES.value))}
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    state = jax.device_put(TrainState(np.int32(1), params, optax.sgd(0.1).init(params)), sharding)
    del params
    state_bytes = sum(x.nbytes for x in jax.tree.leaves(state))
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), state
    )
    replica = layout == "replica"
    policy = checkpoint.Interval(total=10, pinned=1)
    ckpt = checkpoint.Checkpointer(directory, policy, keep=2, process_local=replica)
    began = time.perf_counter()
    meta = {"step": 1}
    if replica:  # as a multi-process job's writer does (spare_jax.saving)
        saved_state, checks = checkpoint.host_replica(state)
        meta.update(checks)
    else:
        saved_state = state
    stall = ckpt.save(1, saved_state, meta, force=True, started=began)
    (saved,) = ckpt.wait()
    del saved_state
    restored = ckpt.restore_latest(abstract)
    jax.block_until_ready(restored.state)
    restore_s = restored.restore_s
    exact = all(
        np.asarray(a).tobytes() == np.asarray(b).tobytes()
        for a, b in zip(jax.tree.leaves(restored.state), jax.tree.leaves(state), strict=True)
    )
    ckpt.close()
    peak = (_vm_hwm() - base) / state_bytes
    del restored
    copy_start = time.perf_counter()
    jax.tree.map(multihost.host_copy, state)
    copy_s = time.perf_counter() - copy_start
    print(
        json.dumps(
            {
                "copy_s": copy_s,
                "stall_s": stall,
                "write_s": saved.write_s,
                "restore_s": restore_s,
                "state_bytes": state_bytes,
                "peak_over_state": peak,
                "exact": exact,
            }
        ),
        flush=True,
    )


def _layout_work(mb: str) -> None:
    """Bytes each device streams when a group's matrices are sharded over 1, 2, 4, 8 devices."""
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import jax
    from jax.sharding import PartitionSpec

    from spare_jax import broadcast
    from spare_jax import mesh as mesh_lib

    side = _side(int(float(mb) * 1e6), _LEAVES.value)
    abstract = [jax.ShapeDtypeStruct((side, side), jax.numpy.float32)] * _LEAVES.value
    rows = {}
    for inner in (1, 2, 4, 8):
        mesh = mesh_lib.make_mesh((1, 8 // inner, inner))
        specs = [PartitionSpec(None, "model")] * len(abstract)
        plan = broadcast.layout(
            mesh, abstract, specs, _CHUNK_MB.value << 20 or broadcast.CHUNK_BYTES
        )
        rows[inner] = {"per_device": plan.stream_bytes, "per_group": plan.payload_bytes}
    print(json.dumps(rows), flush=True)


def _work(spec: str) -> None:
    """One process of one run: print a JSON line with its figures."""
    method, mb, port, me = spec.split(":")
    me, nbytes = int(me), int(float(mb) * 1e6)
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    import jax
    import numpy as np

    jax.config.update("jax_platforms", _JAX_PLATFORM[_PLATFORM.value])
    if _PLATFORM.value == "gpu":
        jax.distributed.initialize(f"localhost:{port}", PROCESSES, me, local_device_ids=[me])
    else:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(f"localhost:{port}", PROCESSES, me)
    jax.devices()  # every backend starts together (each publishes its devices)
    from spare_jax import jax_internals

    client = jax_internals.client()
    base = _vm_hwm()
    host = list(_state(nbytes, _LEAVES.value)) if me == 0 else None
    side = _side(nbytes, _LEAVES.value)
    abstract = [jax.ShapeDtypeStruct((side, side), jax.numpy.float32)] * _LEAVES.value
    state_bytes = 4 * side * side * _LEAVES.value
    client.wait_at_barrier("bench/start", TIMEOUT_S * 1000)
    start = time.perf_counter()
    if method == "kv":
        leaves, parts = _kv(client, me, host, abstract)
    else:
        leaves, parts = _devices(me, host, abstract, "auto" if method == "devices" else method)
    jax.block_until_ready(leaves)
    client.wait_at_barrier("bench/end", TIMEOUT_S * 1000)
    seconds = time.perf_counter() - start
    peak = (_vm_hwm() - base) / state_bytes
    want = _state(nbytes, _LEAVES.value)
    exact = all(np.asarray(x).tobytes() == next(want).tobytes() for x in leaves)
    print(
        json.dumps(
            {
                "process": me,
                "seconds": seconds,
                **parts,
                "state_bytes": state_bytes,
                "peak_over_state": peak,
                "exact": exact,
            }
        ),
        flush=True,
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _result(code: int, out: str, err: str) -> dict:
    """A worker's JSON line, or {"error": its last line of stderr}."""
    lines = [line for line in out.splitlines() if line.startswith("{")]
    if code != 0 or not lines:
        why = [line for line in err.splitlines() if line.strip()][-1:] or [f"exit {code}"]
        return {"error": why[0][:200]}
    return json.loads(lines[-1])


def _repeat(run, label: str) -> list[dict]:
    """``--repeats`` runs of one case, stopping at the first that fails; each run on one line."""
    rows: list[dict] = []
    for i in range(_REPEATS.value):
        start = time.perf_counter()
        rows.append(run())
        said = {k: round(v, 3) if isinstance(v, float) else v for k, v in rows[-1].items()}
        print(f"  {label} run {i + 1}: {time.perf_counter() - start:.1f} s {said}", flush=True)
        if "error" in rows[-1]:
            break
    return rows


def _run(method: str, mb: str) -> dict:
    port = _free_port()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                f"--worker={method}:{mb}:{port}:{p}",
                f"--leaves={_LEAVES.value}",
                f"--chunk_mb={_CHUNK_MB.value}",
                f"--platform={_PLATFORM.value}",
                f"--receivers={_RECEIVERS.value}",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for p in range(PROCESSES)
    ]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=TIMEOUT_S)
            outs.append((p.returncode, out, err))
    except subprocess.TimeoutExpired:
        return {"error": f"no result in {TIMEOUT_S} s"}
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    figures = {}
    for row in (_result(*o) for o in outs):
        if "error" in row:
            return row
        figures[row["process"]] = row
    slowest = {  # the slowest receiver's part, None without collectives (kv)
        k: max((r[k] for r in figures.values() if k in r), default=None)
        for k in ("move_s", "compile_s", "assemble_s")
    }
    return {
        "seconds": max(r["seconds"] for r in figures.values()),
        **slowest,
        "state_bytes": figures[0]["state_bytes"],
        "peak": [figures[p]["peak_over_state"] for p in sorted(figures)],
        "exact": all(r["exact"] for r in figures.values()),
    }


def main(argv: list[str]) -> None:
    del argv
    if _WORKER.value.startswith("layout:"):
        _layout_work(_WORKER.value.split(":", 1)[1])
        return
    if _WORKER.value.startswith("save:"):
        _save_work(*_WORKER.value.split(":", 3)[1:])
        return
    if _WORKER.value:
        _work(_WORKER.value)
        return
    bad = [s for s in _SECTIONS.value if s not in ("transfer", "save")]
    if bad or not _SECTIONS.value:
        raise app.UsageError(f"--sections: transfer and/or save, got {_SECTIONS.value}")
    bad = [m for m in _METHODS.value if m not in ("devices", "chain", "doubling", "kv")]
    if bad or not _METHODS.value:
        raise app.UsageError(f"--methods: devices, chain, doubling, kv, got {_METHODS.value}")
    try:
        sizes = [float(s) for s in _SIZES.value]
    except ValueError:
        raise app.UsageError(f"--sizes_mb: numbers, got {_SIZES.value}") from None
    if not sizes or min(sizes) <= 0:
        raise app.UsageError(f"--sizes_mb: positive sizes, got {_SIZES.value}")
    from spare_jax import cli

    out_dir = cli.output_dir("out", _OUT.value) if _OUT.value else None
    record: dict = {"time": time.time(), "receivers": _RECEIVERS.value}
    if "transfer" in _SECTIONS.value:
        record["transfer"] = _transfer_section()
    if "save" in _SECTIONS.value:
        record["save"] = _save_section(out_dir)
    if out_dir:
        with open(os.path.join(out_dir, "state.json"), "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")


def _gpus() -> int:
    """GPUs on this machine, asked in a child process (this one never starts a backend)."""
    code = "import jax; print(len(jax.devices('gpu')))"
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False
    )
    return int(out.stdout.split()[-1]) if out.returncode == 0 and out.stdout.split() else 0


def _transfer_section() -> dict:
    from spare_jax import broadcast

    if _PLATFORM.value == "gpu" and (found := _gpus()) < PROCESSES:
        print(f"transfer: skipped, it needs {PROCESSES} GPUs (one per process); found {found}")
        return {"skipped": [{"error": f"{found} GPU(s)"}]}
    print(
        f"{PROCESSES} processes x 1 {_PLATFORM.value.upper()} device, one group each; process 0 "
        f"holds the state ({_LEAVES.value} float32 matrices), "
        f"{'1 receives, 2 stands by' if _RECEIVERS.value == 1 else '1 and 2 receive'}; chunk "
        f"{_CHUNK_MB.value or broadcast.CHUNK_BYTES >> 20} MiB; medians of {_REPEATS.value}",
        flush=True,
    )
    runs: dict[str, list[dict]] = {}
    for mb in _SIZES.value:
        for method in _METHODS.value:
            key = f"{method}:{mb}"
            if method == "kv" and float(mb) > _KV_MAX.value:
                runs[key] = [{"error": f"skipped (--kv_max_mb={_KV_MAX.value:g})"}]
                continue
            runs[key] = _repeat(lambda m=method, mb=mb: _run(m, mb), f"{method} {mb} MB")
    head = f"{'size MB':>8} {'transport':>9} {'seconds':>8} {'MB/s':>8} {'moving':>7} {'MB/s':>6}"
    print(f"\n{head} {'compile':>7} {'assemble':>8}  peak RSS / state (p0 p1 p2)")
    for key, rows in runs.items():
        method, mb = key.split(":")
        good = [r for r in rows if "error" not in r]
        if not good:
            print(f"{mb:>8} {method:>9}  failed: {rows[-1]['error']}")
            continue
        seconds = statistics.median(r["seconds"] for r in good)
        rate = good[0]["state_bytes"] / seconds / 1e6
        part = {
            k: statistics.median(r[k] for r in good) if good[0].get(k) is not None else None
            for k in ("move_s", "compile_s", "assemble_s")
        }
        moving = part["move_s"]
        alone = (
            f"{moving:7.2f} {good[0]['state_bytes'] / moving / 1e6:6.0f} "
            f"{part['compile_s']:7.2f} {part['assemble_s']:8.2f}"
            if moving
            else f"{'-':>7} {'-':>6} {'-':>7} {'-':>8}"
        )
        peaks = [statistics.median(r["peak"][p] for r in good) for p in range(PROCESSES)]
        flag = "" if all(r["exact"] for r in good) else "  NOT EXACT"
        print(
            f"{mb:>8} {method:>9} {seconds:8.2f} {rate:8.0f} {alone}  "
            + " ".join(f"{x:4.2f}" for x in peaks)
            + flag
        )
    for mb in _SIZES.value:
        dev, kv = runs.get(f"devices:{mb}"), runs.get(f"kv:{mb}")
        if dev and kv and all("error" not in r for r in dev + kv):
            ratio = statistics.median(r["seconds"] for r in kv) / statistics.median(
                r["seconds"] for r in dev
            )
            print(f"{mb} MB: devices {ratio:.1f}x faster than kv")
    print("\nbytes each device streams, the matrices sharded over a group's devices:")
    for mb in _SIZES.value:
        cmd = [sys.executable, __file__, f"--worker=layout:{mb}", f"--leaves={_LEAVES.value}"]
        cmd.append(f"--chunk_mb={_CHUNK_MB.value}")
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
        rows = _result(out.returncode, out.stdout, out.stderr)
        if "error" in rows:
            print(f"{mb:>8} MB  failed: {rows['error']}")
            continue
        runs[f"layout:{mb}"] = [rows]
        print(
            f"{mb:>8} MB  "
            + ", ".join(
                f"{k} device(s): {v['per_device'] / 1e6:.0f} MB "
                f"({v['per_device'] / v['per_group']:.2f} of the state)"
                for k, v in rows.items()
            )
        )
    return runs


def _save_run(layout: str, mb: str, directory: str) -> dict:
    """One save and restore in a fresh process, into ``directory`` (removed after)."""
    cmd = [sys.executable, __file__, f"--worker=save:{layout}:{mb}:{directory}"]
    cmd += [f"--leaves={_LEAVES.value}", f"--platform={_PLATFORM.value}"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        return {"error": f"no result in {TIMEOUT_S} s"}
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return _result(out.returncode, out.stdout, out.stderr)


def _save_section(out_dir: str | None) -> dict:
    import tempfile

    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="spare_state_", dir=out_dir) as scratch:
        for mb in _SIZES.value:
            for layout in ("replica", "orbax"):
                directory = os.path.join(scratch, f"{layout}-{mb}")
                runs[f"{layout}:{mb}"] = _repeat(
                    lambda lay=layout, mb=mb, d=directory: _save_run(lay, mb, d),
                    f"{layout} {mb} MB",
                )
    budget = _PREEMPT_S.value - 2.0
    print(
        f"\none process saves and restores the state on {_PLATFORM.value.upper()}; medians of "
        f"{_REPEATS.value}; "
        f"'fits' = the state the write rate saves in a {_PREEMPT_S.value:g} s notice less 2 s"
    )
    head = f"{'size MB':>8} {'layout':>8} {'copy s':>7} {'stall s':>8} {'write s':>8} {'MB/s':>6}"
    print(f"{head} {'restore s':>9} {'MB/s':>6} {'peak':>5} {'fits GB':>8}")
    for key, rows in runs.items():
        layout, mb = key.split(":")
        good = [r for r in rows if "error" not in r]
        if not good:
            print(f"{mb:>8} {layout:>8}  failed: {rows[-1]['error']}")
            continue
        med = {k: statistics.median(r[k] for r in good) for k in good[0] if k != "exact"}
        size = med["state_bytes"]
        write_rate, read_rate = size / med["write_s"], size / med["restore_s"]
        flag = "" if all(r["exact"] for r in good) else "  NOT EXACT"
        print(
            f"{mb:>8} {layout:>8} {med['copy_s']:7.3f} {med['stall_s']:8.3f} {med['write_s']:8.2f} "
            f"{write_rate / 1e6:6.0f} {med['restore_s']:9.2f} {read_rate / 1e6:6.0f} "
            f"{med['peak_over_state']:5.2f} {budget * write_rate / 1e9:8.1f}{flag}"
        )
    return runs


if __name__ == "__main__":
    app.run(main)
