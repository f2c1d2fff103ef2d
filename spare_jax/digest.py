"""A per-leaf digest of a state's bits, the same on device and on the host.

A checkpoint stores it at save time and checks it at restore: any array
altered in place (a flipped bit, a changed word, same file size), lost or
swapped is caught, not only the parameters and not only changes big
enough to move a sum of squares. For each leaf, its bytes read as unsigned
32-bit words ``w_i`` (narrower items widened, 64-bit items split in two)
give ``sum_i (2 i + 1) * w_i mod 2**32``: changing any single word changes
it (the weights are odd, hence invertible mod 2**32), and every word's
position counts. Device arrays are digested by one jitted program where
they lie; host arrays with NumPy in blocks (no upload, no full-size
temporary).

`param_checksum` is a coarser fingerprint of the parameters alone (a sum of
squares) that every checkpoint's record carries as well.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["check_digest", "param_checksum", "state_digest"]

_BLOCK = 1 << 22  # words per NumPy block


def _words_np(x: np.ndarray) -> np.ndarray:
    x = np.ascontiguousarray(x).reshape(-1)
    size = x.dtype.itemsize
    if size in (4, 8):
        return x.view(np.uint32)
    return x.view({1: np.uint8, 2: np.uint16}[size]).astype(np.uint32)


def _digest_np(x: np.ndarray) -> int:
    words = _words_np(np.asarray(x))
    total = 0
    for start in range(0, words.size, _BLOCK):
        block = words[start : start + _BLOCK]
        index = np.arange(block.size, dtype=np.uint64) + np.uint64(start)
        weights = (index * np.uint64(2) + np.uint64(1)).astype(np.uint32)
        total += int(np.sum(block * weights, dtype=np.uint32))
    return total % (1 << 32)


def _words_jnp(x: jax.Array) -> jax.Array:
    size = x.dtype.itemsize
    if x.dtype == jnp.bool_:
        return x.reshape(-1).astype(jnp.uint32)
    if size in (4, 8):  # a 64-bit item becomes its two words, low first, as in NumPy
        return jax.lax.bitcast_convert_type(x, jnp.uint32).reshape(-1)
    narrow = jax.lax.bitcast_convert_type(x, {1: jnp.uint8, 2: jnp.uint16}[size])
    return narrow.reshape(-1).astype(jnp.uint32)


@jax.jit
def _digest_device(leaves: list[jax.Array]) -> jax.Array:
    out = []
    for x in leaves:
        words = _words_jnp(x)
        weights = jnp.arange(words.size, dtype=jnp.uint32) * jnp.uint32(2) + jnp.uint32(1)
        out.append(jnp.sum(words * weights, dtype=jnp.uint32))
    return jnp.stack(out) if out else jnp.zeros((0,), jnp.uint32)


def state_digest(state: Any) -> list[int]:
    """One digest per leaf of ``state`` (device arrays, host arrays, or a mix)."""
    leaves = jax.tree.leaves(state)
    on_device = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array)]
    digests: list[int] = [0] * len(leaves)
    if on_device:
        sums = _digest_device([leaves[i] for i in on_device])
        host = np.asarray(sums.addressable_shards[0].data)
        for i, value in zip(on_device, host, strict=True):
            digests[i] = int(value)
    for i, x in enumerate(leaves):
        if not isinstance(x, jax.Array):
            digests[i] = _digest_np(np.asarray(x))
    return digests


@jax.jit
def _leaf_sums(params: Any) -> jax.Array:
    return jnp.stack([jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(params)])


def param_checksum(params: Any) -> float:
    """Sum of squares of every parameter, added up in float64 (a fingerprint of the model).

    Each leaf's sum is computed on device in float32 (one compiled program) and
    the per-leaf sums are added on the host in float64.
    """
    sums = _leaf_sums(params)
    return float(np.asarray(sums.addressable_shards[0].data, np.float64).sum())


def check_digest(state: Any, saved: list[int]) -> None:
    """Every array's bits against the digest saved with it."""
    got = state_digest(state)
    if len(got) != len(saved):
        raise ValueError(f"the state has {len(got)} arrays, the saved digest {len(saved)}")
    bad = [i for i, (a, b) in enumerate(zip(got, saved, strict=True)) if a != b]
    if bad:
        paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
        names = ", ".join(paths[i] for i in bad[:3]) + (" ..." if len(bad) > 3 else "")
        raise ValueError(f"{len(bad)} array(s) differ from the digest saved with them: {names}")
