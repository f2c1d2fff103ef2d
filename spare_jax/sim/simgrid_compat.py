"""Everything that touches SimGrid: its Python API, the platform, collectives, processes.

`spare_jax.sim.simgrid` is the model of a training run; this module owns what
it runs on: the simulated machine (`Cluster`, `star`, `fat_tree`), the
transfers a collective is made of (`allreduce`), the activities of the one
driver actor, and the fresh process each simulation needs. The differences
between SimGrid versions stay here:

* Debian's ``python3-simgrid`` (3.32) builds zones with
    ``NetZone.create_star_zone`` / ``create_fatTree_zone`` and hosts with
    ``create_host``; SimGrid 4.x (PyPI) uses ``netzone_root.add_netzone_star``
    and ``add_host`` (and ``Host.turn_off``, which we never use: 4.1 kills the
    simulation on a transfer to a host that is off).
* 3.32 waits on a list of transfers with ``Comm.wait_all_for``; 4.x with an
    ``ActivitySet``. 3.32 never starts a zero-byte transfer waited that way.

SimGrid keeps one engine per process and its clock never resets, so
simulations run in fresh Python processes (`run_isolated`), several of one
platform in a row (`play`), which then checks that every run completed: a
deadlock ends ``Engine.run()`` normally. An exception escaping an actor aborts
the whole process, so drivers catch everything at their top (``BaseException``,
which ``ActorKilled`` also is; no actor is ever killed) and return the
traceback as data. The 4.x branches follow the 4.1 documentation; CI and the
tests exercise 3.32.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import importlib
import importlib.util
import itertools
import math
import os
import pickle
import subprocess
import sys
import traceback
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import numpy as np

from spare_jax import checks

__all__ = [
    "ALLREDUCE",
    "INSTALL_HINT",
    "NETWORK_MODELS",
    "TOPOLOGIES",
    "Cluster",
    "SimGridError",
    "SimGridMissing",
    "allreduce",
    "available",
    "cancel",
    "load",
    "run_isolated",
    "run_many",
    "version",
]

INSTALL_HINT = (
    "SimGrid is not installed: apt-get install python3-simgrid, then link its module into "
    "the venv as .ci/run does (or pip install simgrid, a source build)"
)
NETWORK_MODELS = ("CM02", "LV08")
TOPOLOGIES = ("star", "fat_tree")
ALLREDUCE = ("ring", "tree", "ring_rounds")


class SimGridMissing(ImportError):
    """The ``simgrid`` module cannot be imported."""


class SimGridError(RuntimeError):
    """A simulation failed, deadlocked or did not complete."""


@contextlib.contextmanager
def _quiet_stderr():
    """Silence file descriptor 2: SimGrid logs its configuration on import."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def load() -> ModuleType:
    """The ``simgrid`` module, imported on first use; SimGridMissing with the install hint."""
    if "simgrid" in sys.modules and sys.modules["simgrid"] is not None:
        return sys.modules["simgrid"]
    try:
        with _quiet_stderr():
            return importlib.import_module("simgrid")
    except ImportError as error:
        raise SimGridMissing(INSTALL_HINT) from error


def available() -> bool:
    """Whether SimGrid can be imported."""
    try:
        load()
    except SimGridMissing:
        return False
    return True


def version() -> str:
    """SimGrid's version string, e.g. ``"3.32.0"``."""
    sg = load()
    found = getattr(sg, "simgrid_version", None) or getattr(sg, "__version__", None)
    return str(found) if found else "unknown"


def _v4(sg: ModuleType) -> bool:
    return not hasattr(sg.NetZone, "create_star_zone")


# ---------------------------------------------------------------- engine and platform


@dataclasses.dataclass(frozen=True)
class Cluster:
    """The simulated machine: hosts, network and SimGrid's network model.

    Defaults: a group of 8 GPUs at 400 TFLOP/s sustained, one 400 Gb/s NIC
    per GPU (400 GB/s per group), 2 us per link, 100 GB/s to storage. Both
    network models share a link max-min fairly; ``LV08`` also scales latency
    (x13.01) and bandwidth (x0.97). `crosstraffic` is SimGrid's default
    accounting of TCP acknowledgements on the reverse path (5% of a flow);
    off, a contention-free route costs exactly latency + bytes / bandwidth.
    `leaf_size` is also the block of the two-level tree all-reduce.
    """

    network: str = "LV08"
    topology: str = "star"
    group_flops: float = 3.2e15
    bandwidth_Bps: float = 400e9
    latency_s: float = 2e-6
    storage_bandwidth_Bps: float = 100e9
    leaf_size: int = 32
    spines: int = 8
    crosstraffic: bool = True

    def validate(self) -> Cluster:
        """`self`, or ValueError naming the first bad field."""
        checks.choice("network", self.network, NETWORK_MODELS)
        checks.choice("topology", self.topology, TOPOLOGIES)
        for name in ("group_flops", "bandwidth_Bps", "storage_bandwidth_Bps"):
            checks.number(name, getattr(self, name), low=0.0, low_open=True)
        checks.number("latency_s", self.latency_s, low=0.0)
        checks.integer("leaf_size", self.leaf_size, low=1)
        checks.integer("spines", self.spines, low=1)
        return self


def engine(network_model: str, extra: Sequence[str] = ()) -> Any:
    """A SimGrid engine with the given network model ("CM02" or "LV08", SimGrid's default)."""
    sg = load()
    if network_model not in NETWORK_MODELS:
        raise ValueError(f"network model must be one of {', '.join(NETWORK_MODELS)}")
    args = ["spare_jax", f"--cfg=network/model:{network_model}", "--log=root.thres:warning"]
    return sg.Engine(args + list(extra))


def _duplex(sg: ModuleType, zone: Any, name: str, bandwidth: float, latency: float) -> Any:
    make = zone.create_split_duplex_link if hasattr(zone, "create_split_duplex_link") else None
    link = make(name, bandwidth) if make else zone.add_split_duplex_link(name, bandwidth)
    return link.set_latency(latency).seal()


def _host(zone: Any, name: str, flops: float) -> Any:
    make = zone.create_host if hasattr(zone, "create_host") else zone.add_host
    return make(name, flops).seal()


def star(
    groups: int, flops: float, bandwidth: float, latency: float, storage_bandwidth: float
) -> tuple[list[Any], Any]:
    """Star network: every host has a private split-duplex link to a non-blocking switch.

    Returns:
        (the group hosts in id order, the storage host).
    """
    sg = load()
    if _v4(sg):
        zone = sg.Engine.instance.netzone_root.add_netzone_star("cluster")
    else:
        zone = sg.NetZone.create_star_zone("cluster")
    up = sg.LinkInRoute.Direction.UP
    hosts = []
    for i in range(groups + 1):
        host = _host(zone, f"group-{i}" if i < groups else "storage", flops)
        bw = bandwidth if i < groups else storage_bandwidth
        link = _duplex(sg, zone, f"nic-{i}", bw, latency)
        if _v4(sg):
            zone.add_route(host, None, [sg.LinkInRoute(link, up)], True)
        else:
            zone.add_route(host.netpoint, None, None, None, [sg.LinkInRoute(link, up)], True)
        hosts.append(host)
    zone.seal()
    return hosts[:groups], hosts[groups]


def fat_tree(
    groups: int,
    flops: float,
    bandwidth: float,
    latency: float,
    storage_bandwidth: float,
    leaf_size: int,
    spines: int,
) -> tuple[list[Any], Any]:
    """Two-level fat tree: leaves of `leaf_size` hosts, `spines` uplinks per leaf switch.

    Every link carries `bandwidth` each way; a leaf switch is oversubscribed
    `leaf_size / spines` times. The storage host is the leaf after the last
    group, behind a limiter of `storage_bandwidth`. SimGrid's limiter links
    are shared by both directions, so a group's is `2 * bandwidth`; it also
    asks for one per switch, which gets infinite capacity. Routes across
    leaves have 4 links: SimGrid's TCP window (``network/TCP-gamma``) caps a
    flow at gamma / (2 x route latency).
    """
    sg = load()
    if _v4(sg):
        raise NotImplementedError("the fat tree is built for SimGrid 3.32 only; use the star")
    leaves = -(-(groups + 1) // leaf_size)
    nodes = leaf_size * leaves
    made: dict[int, Any] = {}

    def netpoint(zone: Any, coord: list[int], ident: int) -> tuple[Any, None]:
        made[ident] = _host(zone, f"group-{ident}" if ident < groups else f"spare-{ident}", flops)
        return made[ident].netpoint, None

    def limiter(zone: Any, coord: list[int], ident: int) -> Any:
        if ident == groups:
            rate = storage_bandwidth
        elif ident < nodes:
            rate = 2 * bandwidth  # one shared limiter for both directions of a duplex NIC
        else:
            rate = 1e20  # a switch: no limit of its own
        return zone.create_link(f"limiter-{ident}", rate).seal()

    params = sg.FatTreeParams(2, [leaf_size, leaves], [1, spines], [1, 1])
    callbacks = sg.ClusterCallbacks(netpoint, None, limiter)
    sg.NetZone.create_fatTree_zone(
        "cluster", None, params, callbacks, bandwidth, latency, sg.Link.SharingPolicy.SPLITDUPLEX
    ).seal()
    return [made[i] for i in range(groups)], made[groups]


# ---------------------------------------------------------------- collectives as transfers
#
# A round-by-round ring all-reduce is 2(n-1) rounds of n messages: O(n^2). We
# simulate each collective as two parts with O(n) messages: the *data wave*,
# every link's whole volume at once (each live group sends its 2(n-1)/n share
# of the gradient to its ring successor; or each tree edge carries the gradient
# up and down), then the *latency chain*, a one-byte token along the critical
# path (2(n-1) - 1 ring hops; up and down the deepest tree path, one hop less).
# On a contention-free network the ring's two parts cost exactly the
# round-by-round ring (`ring_rounds`, kept for that check: tests/test_simgrid.py);
# SimGrid's network model decides the sharing of links and per-message costs.


def _ring(live: np.ndarray, nbytes: float, rounds: bool) -> list[list[tuple[int, int, float]]]:
    n = live.size
    if n < 2:
        return []
    nxt = np.roll(live, -1).tolist()
    ids = live.tolist()
    if rounds:
        return [[(a, b, nbytes / n) for a, b in zip(ids, nxt)] for _ in range(2 * (n - 1))]
    wave = [[(a, b, 2.0 * (n - 1) / n * nbytes) for a, b in zip(ids, nxt)]]
    chain = [[(ids[i % n], nxt[i % n], 0.0)] for i in range(2 * (n - 1) - 1)]
    return wave + chain


def _heap_path(last: int) -> list[int]:
    """Indices from `last` up to the root of a binary heap."""
    path = [last]
    while path[-1] > 0:
        path.append((path[-1] - 1) // 2)
    return path


def _tree(live: np.ndarray, nbytes: float, block: int) -> list[list[tuple[int, int, float]]]:
    n = live.size
    if n < 2:
        return []
    ids = live.tolist()
    starts = list(range(0, n, block))
    edges = []  # (child, parent) as indices into `ids`
    for s in starts:
        size = min(block, n - s)
        edges += [(s + j, s + (j - 1) // 2) for j in range(1, size)]
    edges += [(starts[j], starts[(j - 1) // 2]) for j in range(1, len(starts))]
    wave = [(ids[c], ids[p], nbytes) for c, p in edges]
    wave += [(ids[p], ids[c], nbytes) for c, p in edges]
    # Critical path: the block whose deepest member is deepest overall, up to the root.
    best, path = -1, []
    for j, s in enumerate(starts):
        size = min(block, n - s)
        inner = [s + i for i in _heap_path(size - 1)]
        outer = [starts[i] for i in _heap_path(j)][1:]
        if len(inner) + len(outer) > best:
            best, path = len(inner) + len(outer), inner + outer
    hops = list(itertools.pairwise(path))
    up_down = hops + [(b, a) for a, b in reversed(hops)]
    return [wave] + [[(ids[a], ids[b], 0.0)] for a, b in up_down[1:]]


def allreduce(kind: str, live: np.ndarray, nbytes: float, block: int) -> list:
    """The transfer phases of an all-reduce of `nbytes` among `live`: (src, dst, bytes) lists."""
    if kind == "tree":
        return _tree(live, nbytes, block)
    return _ring(live, nbytes, rounds=kind == "ring_rounds")


# ---------------------------------------------------------------- activities


def now() -> float:
    """The simulated clock, seconds."""
    sg = load()
    clock = sg.Engine.clock
    return float(clock() if callable(clock) else clock)


def sleep_until(t: float) -> None:
    """Advance the calling actor to time `t` (no-op if `t` is not in the future)."""
    if t > now():
        load().this_actor.sleep_until(t)


def execute(host: Any, flops: float) -> Any:
    """Start `flops` of computation on `host` from the calling actor; return the execution."""
    activity = load().this_actor.exec_init(float(flops))
    activity.host = host
    activity.start()
    return activity


def transfer(src: Any, dst: Any, nbytes: float) -> Any:
    """Start a host-to-host transfer of `nbytes` (no mailbox, no receiving actor).

    At least one byte: 3.32 never starts a zero-byte transfer that is waited
    with ``Comm.wait_all_for`` (it stays STARTING until the timeout).
    """
    return load().Comm.sendto_async(src, dst, max(1, round(nbytes)))


def _wait_comms(sg: ModuleType, comms: list[Any], timeout: float) -> None:
    if _v4(sg):
        group = sg.ActivitySet(comms)
        group.wait_all() if math.isinf(timeout) else group.wait_all_for(timeout)
    elif math.isinf(timeout):
        sg.Comm.wait_all(comms)
    else:
        sg.Comm.wait_all_for(comms, timeout)


def cancel(activities: list[Any]) -> None:
    """Cancel every activity that has not finished."""
    for activity in activities:
        if not activity.test():
            activity.cancel()


def wait_all(
    execs: list[Any], comms: list[Any], deadline: float = math.inf, cancel_late: bool = True
) -> bool:
    """Wait for every activity until `deadline`; False if some did not finish by then.

    On a timeout the unfinished activities are cancelled, unless `cancel_late`
    is False (they then keep running and can be waited on again).
    """
    sg = load()
    try:
        for activity in execs:
            left = deadline - now()
            if math.isinf(left):
                activity.wait()
            elif left <= 0.0 and not activity.test():
                raise sg.TimeoutException("deadline")
            elif left > 0.0:
                activity.wait_for(left)
        if comms:
            left = deadline - now()
            if left > 0.0:
                _wait_comms(sg, comms, left)
            if not all(c.test() for c in comms):
                raise sg.TimeoutException("deadline")
    except sg.TimeoutException:
        if cancel_late:
            cancel(list(execs) + list(comms))
        return False
    return True


# ---------------------------------------------------------------- isolated runs


def play(cluster: Any, groups: int, drivers: Sequence[Callable[[list, Any], Any]]) -> list[dict]:
    """Build `cluster`'s platform and play `drivers` one after the other in one actor.

    `cluster` is a `simgrid.Cluster`. Each `drivers[i](hosts, storage)` returns
    a callable actor body that leaves its result in `.out`: ``"completed"``
    once it finished, ``"error"`` (a traceback) if it failed. Runs measure
    times from their own start, so sharing one engine (and one import of
    everything) changes nothing but the cost.

    Raises:
        SimGridError: a driver failed, or the engine stopped before every driver
            completed (a deadlock also ends ``Engine.run()`` normally).
    """
    sg = load()
    e = engine(cluster.network, [f"--cfg=network/crosstraffic:{int(cluster.crosstraffic)}"])
    args = (groups, cluster.group_flops, cluster.bandwidth_Bps, cluster.latency_s)
    if cluster.topology == "star":
        hosts, storage = star(*args, cluster.storage_bandwidth_Bps)
    else:
        hosts, storage = fat_tree(
            *args, cluster.storage_bandwidth_Bps, cluster.leaf_size, cluster.spines
        )
    outs: list[dict] = []

    def body() -> None:
        for make in drivers:
            driver = make(hosts, storage)
            driver()
            outs.append(driver.out)
            if "error" in driver.out:
                return

    sg.Actor.create("driver", storage, body)
    e.run()
    for out in outs:
        if "error" in out:
            raise SimGridError(out["error"])
    if len(outs) < len(drivers) or not all(out.get("completed") for out in outs):
        raise SimGridError("the simulated run did not complete (deadlock?)")
    return outs


def _resolve(entry: str) -> Callable[[dict], dict]:
    """``"module:function"`` or ``"/path/file.py:function"`` to the function."""
    where, name = entry.rsplit(":", 1)
    if where.endswith(".py"):
        spec = importlib.util.spec_from_file_location("_simgrid_entry", where)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    return getattr(module, name)


def _child() -> int:
    """Child process: read (entry, payload) on stdin, write the pickled result on stdout.

    Anything else the process prints (SimGrid writes from C) goes to stderr:
    file descriptor 1 is pointed there once the result's pipe is set aside.
    """
    entry, payload = pickle.load(sys.stdin.buffer)
    result_pipe = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    try:
        load()
        result = {"ok": _resolve(entry)(payload)}
    except BaseException:  # noqa: BLE001 - reported by the parent as one error
        result = {"error": traceback.format_exc()}
    with result_pipe:
        pickle.dump(result, result_pipe)
    return 0


def run_isolated(entry: str, payload: dict, timeout_s: float | None = None) -> dict:
    """Run `entry(payload)` in a fresh Python process (one SimGrid engine) and return its dict.

    Arguments and result travel through pipes: nothing is written to disk.

    Raises:
        SimGridMissing: SimGrid cannot be imported here.
        SimGridError: the child failed, timed out or returned no result; the
            message carries its traceback or the tail of its stderr.
    """
    load()
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in [env.get("PYTHONPATH")] if p])
    cmd = [sys.executable, "-m", "spare_jax.sim.simgrid_compat"]
    try:
        proc = subprocess.run(
            cmd,
            input=pickle.dumps((entry, payload)),
            capture_output=True,
            timeout=timeout_s,
            env=env,
            check=False,
        )
    except subprocess.TimeoutExpired as error:
        raise SimGridError(f"SimGrid run timed out after {timeout_s} s") from error
    try:
        result = pickle.loads(proc.stdout)
    except (pickle.UnpicklingError, EOFError):
        tail = " | ".join(proc.stderr.decode(errors="replace").strip().splitlines()[-5:])
        raise SimGridError(f"SimGrid process exited {proc.returncode}: {tail}") from None
    if "error" in result:
        raise SimGridError(result["error"].strip().splitlines()[-1] + "\n" + result["error"])
    return result["ok"]


def run_many(entry: str, payloads: list[dict], processes: int = 1) -> list[dict]:
    """`run_isolated` over payloads, `processes` child processes at a time, in order."""
    if processes <= 1 or len(payloads) <= 1:
        return [run_isolated(entry, p) for p in payloads]
    with concurrent.futures.ThreadPoolExecutor(processes) as pool:
        return list(pool.map(lambda p: run_isolated(entry, p), payloads))


if __name__ == "__main__":
    sys.exit(_child())
