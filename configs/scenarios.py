"""Planning scenarios: the cluster, its failures and costs, every default sourced.

Usage with `experiments/plan.py`:

    --scenario=configs/scenarios.py            the default (600k GPUs)
    --scenario=configs/scenarios.py:llama3     Llama 3 405B's cluster (16,384 GPUs)
    --scenario=configs/scenarios.py:small      a quick 10k-GPU variant (tests, smoke)
    --scenario.gpus=300000                     override any field

Fields mirror `spare_jax.scenario.Scenario`; `to_scenario(config)` converts
(through `Scenario.from_mapping`, as experiments/plan.py does). Sources (the
full table is docs/design.md, section 12, Parameter sources):

* gpus 600,000: the SPARe paper's largest scale (arXiv 2603.00357, abstract).
* gpus_per_group 8: one 8-GPU node per replica group (docs/design.md, 2. Vocabulary).
* gpu_mtbf_hours 5.1e4: derived from "The Llama 3 Herd of Models" (Meta, 2024):
    16,384 GPUs x 1,296 h / 419 unexpected interruptions.
* failure_law exponential; weibull_shape 0.7: Schroeder & Gibson, DSN 2006
    (shape 0.7-0.8 commonly quoted; unverified).
* work_hours 720: one month of failure-free compute (the reference run of
    docs/design.md, 9. Time-to-train model).
* checkpoint_s 60: a 405B model + Adam state is ~6.5 TB, ~3 s at the Llama 3
    report's 2 TB/s if ideal; production saves are far slower (checkpointing
    costs 12% on average, Meta CPR analysis cited by Gemini, SOSP 2023): 60 s is
    our mid value, to be swept.
* restart_s_ref 600 at 100,000 GPUs: ~10 min synchronous restart per failure at
    ~100k GPUs ("Training LLMs with Fault Tolerant HSDP on 100,000 GPUs", arXiv
    2602.00277). restart_exponent 1: linear growth with N (the SPARe paper,
    citing MegaScale 2024 and NCCLX 2025, says quadratic or worse by default:
    sweep 0..2).
* mttr_hours 4: no published figure found; a sweep parameter for hot re-join.
* domain_*: 0 (off). Switch/cable faults were 8.4% of Llama 3 interruptions,
    a proxy only (Llama 3 report).
* microbatch_overhead 0: no published figure; micro-batches assumed free.
"""

from __future__ import annotations

import dataclasses

import ml_collections

from spare_jax.scenario import Scenario

VARIANTS = (None, "default", "llama3", "small")


def default() -> ml_collections.ConfigDict:
    """The 600k-GPU default scenario (field values of `Scenario()`)."""
    return ml_collections.ConfigDict(dataclasses.asdict(Scenario()))


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    """Scenario config; `arg` in {None, "default", "llama3", "small"}."""
    config = default()
    if arg in (None, "", "default"):
        return config
    if arg == "llama3":
        # 16,384 H100 GPUs, 54 days (Llama 3 report); its restart at that scale
        # follows our linear R(N) from the 100k-GPU reference.
        config.gpus = 16_384
        return config
    if arg == "small":
        config.gpus = 10_000
        return config
    raise ValueError(f"unknown scenario {arg!r}; expected default, llama3 or small")


def to_scenario(config: ml_collections.ConfigDict) -> Scenario:
    """A validated `Scenario` from a config (unknown fields or bad values raise ValueError)."""
    return Scenario.from_mapping(config.to_dict())
