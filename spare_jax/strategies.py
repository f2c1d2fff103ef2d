"""The registry of names: strategies, their aliases, policies, and the placement each builds.

Every module and binary takes its names from here, so a strategy or policy
means the same thing in the library, the analysis, the simulator and on the
command line.

**Strategies** say who holds a shard's data:

* ``spare``: stacking. Group ``i`` holds shards ``i, i+1, ..., i+r-1`` of its
  ring (layout ``cyclic``), or shards ``s`` apart (layout ``strided``).
* ``replication``: ``G/r`` disjoint sets of ``r`` groups; every member holds
  and computes its set's one shard, ``r`` times larger than a stacking shard.
* ``dp``: plain data parallelism (``r = 1``). With checkpoints it is the
  checkpoint/restart baseline, hence the alias ``checkpoint_restart``.

**Policies** say who computes a dead group's work (stacking only):

* ``adaptive``: the assignment that minimises the busiest group's load;
* ``fixed``: each shard whole to its first live holder in stack order;
* ``drop``: nobody; the dead groups' data is dropped and the rest averaged.
  This is the *inexact* elastic baseline, offered by the data plane only for
  comparison.

**Variants** are the four configurations the planner and the experiments
compare side by side, each a (strategy, policy) pair with a row name.
"""

from __future__ import annotations

import dataclasses

from spare_jax import checks
from spare_jax import placement as placement_lib

__all__ = [
    "ALIASES",
    "EXACT_POLICIES",
    "LAYOUTS",
    "POLICIES",
    "STRATEGIES",
    "VARIANTS",
    "Variant",
    "canonical",
    "check_policy",
    "placement",
    "variant",
]

STRATEGIES: tuple[str, ...] = ("spare", "replication", "dp")
ALIASES: dict[str, str] = {
    "checkpoint_restart": "dp",
    "data_parallel": "dp",
    "cyclic": "spare",
    "strided": "spare",
}
LAYOUTS: tuple[str, ...] = ("cyclic", "strided")
POLICIES: tuple[str, ...] = ("adaptive", "fixed", "drop")
EXACT_POLICIES: tuple[str, ...] = ("adaptive", "fixed")


def canonical(strategy: str) -> str:
    """The strategy a name (or alias) stands for: ``"spare"``, ``"replication"`` or ``"dp"``."""
    if isinstance(strategy, str) and strategy in STRATEGIES:
        return strategy
    if isinstance(strategy, str) and strategy in ALIASES:
        return ALIASES[strategy]
    names = ", ".join(STRATEGIES + tuple(ALIASES))
    raise ValueError(f"strategy must be one of {names}; got {strategy!r}")


def check_policy(policy: str, *, exact: bool = False) -> str:
    """``policy`` if it is known (and exact, when ``exact``), else ValueError."""
    return checks.choice("policy", policy, EXACT_POLICIES if exact else POLICIES)


def placement(
    strategy: str,
    groups: int,
    redundancy: int,
    *,
    layout: str | None = None,
    ring_size: int | None = None,
) -> placement_lib.Placement:
    """The placement a strategy builds over ``groups`` groups.

    Args:
        strategy: a strategy name or alias. The aliases ``cyclic`` and
            ``strided`` also choose the stacking layout.
        groups: G.
        redundancy: r (must be 1 for ``dp``).
        layout: ``cyclic`` (default) or ``strided``, for ``spare``.
        ring_size: groups per cyclic ring (consecutive ids); default one ring.

    Raises:
        ValueError: naming the bad argument.
    """
    kind = canonical(strategy)
    if layout is None:
        layout = strategy if strategy in LAYOUTS else "cyclic"
    checks.choice("layout", layout, LAYOUTS)
    if kind == "dp":
        if checks.integer("redundancy", redundancy, low=1) != 1:
            raise ValueError(f"strategy {strategy!r} has redundancy 1, got {redundancy}")
        return placement_lib.data_parallel(groups)
    if kind == "replication":
        return placement_lib.replication(groups, redundancy)
    if layout == "strided":
        if ring_size is not None:
            raise ValueError("ring_size applies to the cyclic layout only")
        return placement_lib.strided(groups, redundancy)
    return placement_lib.cyclic(groups, redundancy, ring_size=ring_size)


@dataclasses.dataclass(frozen=True)
class Variant:
    """One compared configuration: a row name, a label for figures, strategy and policy."""

    name: str
    label: str
    strategy: str
    policy: str


VARIANTS: tuple[Variant, ...] = (
    Variant("checkpoint_restart", "checkpoint/restart", "dp", "adaptive"),
    Variant("replication", "replication", "replication", "adaptive"),
    Variant("spare_fixed", "SPARe fixed order", "spare", "fixed"),
    Variant("spare_adaptive", "SPARe adaptive", "spare", "adaptive"),
)


def variant(name: str) -> Variant:
    """The variant with this row name."""
    for v in VARIANTS:
        if v.name == name:
            return v
    raise ValueError(f"variant must be one of {', '.join(v.name for v in VARIANTS)}; got {name!r}")
