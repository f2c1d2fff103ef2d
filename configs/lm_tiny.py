"""Tiny decoder-only LM on the synthetic Markov stream: the default training config.

Usage: ``--config=configs/lm_tiny.py`` (default) or ``--config=configs/lm_tiny.py:smoke``
for a seconds-long smoke run; override fields with ``--config.model.d_model=128``.

The mesh is (data, redundancy, model) = (1, 4, 2) over 8 simulated CPU devices:
one ring of 4 groups along the redundancy axis, each group spanning 2 model
devices. ``--config.mesh_axes=data:1,redundancy:4,fsdp:2,tensor:1`` names the
axes instead (HSDP): the last inner axis shards attention heads and the MLP
(tensor-style), a first of two or more splits each micro-batch's rows.
"""

import ml_collections

VARIANTS = (None, "smoke")


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    """The config; ``arg="smoke"`` gives the tiny smoke variant."""
    config = ml_collections.ConfigDict()
    config.mesh = (1, 4, 2)
    config.mesh_axes = ""  # named axes, e.g. "data:1,redundancy:4,fsdp:2,tensor:1"; overrides mesh
    config.strategy = "spare"
    config.redundancy = 2
    config.microbatches = 2
    config.policy = "adaptive"
    config.slot_bound = 0  # 0: a group's whole stack (never recompiles)
    config.batch = 8  # sequences per micro-batch
    config.steps = 200
    config.seed = 0
    config.learning_rate = 3e-3
    config.warmup_steps = 20
    config.weight_decay = 0.01
    config.clip_norm = 1.0
    config.log_every = 20

    config.model = ml_collections.ConfigDict()
    config.model.vocab = 64
    config.model.seq_len = 32
    config.model.d_model = 64
    config.model.heads = 4
    config.model.layers = 2
    config.model.d_ff = 256
    config.model.dtype = "float32"

    # Checkpoints (Orbax, under WORKDIR/checkpoints). steps=0: the interval is the
    # optimum of spare_jax.analysis for the measured step time and save stall and
    # the configured failure rate. Without a failure rate the model uses
    # gpu_mtbf_hours: 5.1e4 h per GPU, derived from "The Llama 3 Herd of Models"
    # (Meta, 2024): 16,384 GPUs x 1,296 h / 419 unexpected interruptions.
    config.checkpoint = ml_collections.ConfigDict()
    config.checkpoint.steps = 0
    config.checkpoint.keep = 3  # the newest 3 complete checkpoints are kept (KeepIntact)
    config.checkpoint.warmup_steps = 3  # steps timed before the first (calibration) save
    config.checkpoint.gpu_mtbf_hours = 5.1e4
    config.checkpoint.max_rollbacks = 100  # give up (exit 3) past this many rollbacks

    config.data = ml_collections.ConfigDict()
    config.data.kind = "markov"  # or "file": uint16 .bin tokens at data.path
    config.data.path = ""
    config.data.branching = 3

    if arg == "smoke":
        config.steps = 8
        config.batch = 2
        config.warmup_steps = 2
        config.log_every = 2
        config.checkpoint.warmup_steps = 2
        config.model.seq_len = 8
        config.model.d_model = 16
        config.model.heads = 2
        config.model.layers = 1
        config.model.d_ff = 32
    elif arg not in (None, ""):
        raise ValueError(f"unknown lm_tiny variant {arg!r}; expected nothing or 'smoke'")
    return config
