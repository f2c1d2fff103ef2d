"""The project's demo LM (a small Flax decoder), its token data and its config checks.

Not part of the library: `spare_jax.fit` trains any model; this is the one the
experiment binaries use (``experiments/train.py``). Import it with
``experiments/`` on ``sys.path`` (the binaries there have it).
"""
