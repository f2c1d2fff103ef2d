"""A small decoder-only transformer language model in Flax NNX.

Owns the model (`TransformerLM`), its size configuration (`ModelConfig`), the
logical axis names of every parameter (`param_logical_axes`, turned into mesh
shardings by `spare_jax.mesh`), and the next-token loss used by the train step.

Pre-LayerNorm blocks, learned position embeddings, causal multi-head attention
and a GELU MLP. Parameters are always float32; ``dtype="bfloat16"`` runs the
activations and matmuls in bfloat16 while the logits, softmax and loss stay in
float32.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from spare_jax import mesh as mesh_lib

__all__ = [
    "ModelConfig",
    "TransformerLM",
    "init_params",
    "loss_fn",
    "next_token_loss",
    "param_initializer",
    "param_logical_axes",
    "param_specs",
]

Params = dict


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Model size.

    Attributes:
        vocab: vocabulary size.
        seq_len: context length (tokens per example fed to the model).
        d_model: residual width.
        heads: attention heads; must divide ``d_model``.
        layers: transformer blocks.
        d_ff: MLP hidden width.
        dtype: ``"float32"`` or ``"bfloat16"`` compute dtype.
    """

    vocab: int = 64
    seq_len: int = 32
    d_model: int = 64
    heads: int = 4
    layers: int = 2
    d_ff: int = 256
    dtype: str = "float32"

    def validate(self) -> ModelConfig:
        """Raise ValueError on an inconsistent size; return self."""
        for name in ("vocab", "seq_len", "d_model", "heads", "layers", "d_ff"):
            if getattr(self, name) < 1:
                raise ValueError(f"model.{name} must be >= 1, got {getattr(self, name)}")
        if self.d_model % self.heads:
            raise ValueError(f"model.heads={self.heads} must divide model.d_model={self.d_model}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"model.dtype must be float32 or bfloat16, got {self.dtype!r}")
        return self

    @property
    def compute_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.dtype)


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], std: float) -> nnx.Param:
    return nnx.Param(std * jax.random.normal(rngs.params(), shape, jnp.float32))


class _LayerNorm(nnx.Module):
    def __init__(self, width: int):
        self.scale = nnx.Param(jnp.ones((width,), jnp.float32))
        self.bias = nnx.Param(jnp.zeros((width,), jnp.float32))

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        mean = x32.mean(-1, keepdims=True)
        var = jnp.square(x32 - mean).mean(-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + 1e-5) * self.scale[...] + self.bias[...]
        return y.astype(x.dtype)


class _Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, h = cfg.d_model, cfg.heads
        std = d**-0.5
        self.query = _param(rngs, (d, h, d // h), std)
        self.key = _param(rngs, (d, h, d // h), std)
        self.value = _param(rngs, (d, h, d // h), std)
        self.out = _param(rngs, (h, d // h, d), std / (2 * cfg.layers) ** 0.5)
        self.dtype = cfg.compute_dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        cast = lambda p: p[...].astype(self.dtype)
        q = jnp.einsum("btd,dhk->bhtk", x, cast(self.query))
        k = jnp.einsum("btd,dhk->bhtk", x, cast(self.key))
        v = jnp.einsum("btd,dhk->bhtk", x, cast(self.value))
        scores = jnp.einsum("bhqk,bhsk->bhqs", q, k).astype(jnp.float32) * q.shape[-1] ** -0.5
        t = x.shape[1]
        causal = jnp.tril(jnp.ones((t, t), bool))
        scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(self.dtype)
        ctx = jnp.einsum("bhqs,bhsk->bhqk", probs, v)
        return jnp.einsum("bhqk,hkd->bqd", ctx, cast(self.out))


class _Mlp(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.up = _param(rngs, (cfg.d_model, cfg.d_ff), cfg.d_model**-0.5)
        self.up_bias = nnx.Param(jnp.zeros((cfg.d_ff,), jnp.float32))
        self.down = _param(rngs, (cfg.d_ff, cfg.d_model), cfg.d_ff**-0.5 / (2 * cfg.layers) ** 0.5)
        self.down_bias = nnx.Param(jnp.zeros((cfg.d_model,), jnp.float32))
        self.dtype = cfg.compute_dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        hidden = x @ self.up[...].astype(self.dtype) + self.up_bias[...].astype(self.dtype)
        hidden = jax.nn.gelu(hidden)
        return hidden @ self.down[...].astype(self.dtype) + self.down_bias[...].astype(self.dtype)


class _Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.ln_attn = _LayerNorm(cfg.d_model)
        self.attn = _Attention(cfg, rngs)
        self.ln_mlp = _LayerNorm(cfg.d_model)
        self.mlp = _Mlp(cfg, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.ln_attn(x))
        return x + self.mlp(self.ln_mlp(x))


class TransformerLM(nnx.Module):
    """Decoder-only transformer: tokens int[B, T] -> logits float32[B, T, vocab]."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        cfg.validate()
        self.cfg = cfg
        self.embed = _param(rngs, (cfg.vocab, cfg.d_model), 0.02)
        self.pos = _param(rngs, (cfg.seq_len, cfg.d_model), 0.02)
        self.blocks = nnx.List([_Block(cfg, rngs) for _ in range(cfg.layers)])
        self.ln_final = _LayerNorm(cfg.d_model)
        self.head = _param(rngs, (cfg.d_model, cfg.vocab), 0.02)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        dtype = self.cfg.compute_dtype
        t = tokens.shape[-1]
        x = (jnp.take(self.embed[...], tokens.astype(jnp.int32), axis=0) + self.pos[:t]).astype(
            dtype
        )
        for block in self.blocks:
            x = block(x)
        x = self.ln_final(x)
        return jnp.einsum("btd,dv->btv", x, self.head[...].astype(dtype)).astype(jnp.float32)


# Parameter path (joined with "/") -> logical names of its dimensions.
_AXES_BY_NAME: list[tuple[str, tuple[str | None, ...]]] = [
    (r"(^|/)embed$", ("vocab", "embed")),
    (r"(^|/)pos$", ("seq", "embed")),
    (r"(^|/)head$", ("embed", "vocab")),
    (r"attn/(query|key|value)$", ("embed", "heads", "head_dim")),
    (r"attn/out$", ("heads", "head_dim", "embed")),
    (r"mlp/up$", ("embed", "mlp")),
    (r"mlp/up_bias$", ("mlp",)),
    (r"mlp/down$", ("mlp", "embed")),
    (r"mlp/down_bias$", ("embed",)),
    (r"(scale|bias)$", ("embed",)),
]


def _path_name(path: tuple) -> str:
    parts = []
    for key in path:
        parts.append(str(getattr(key, "key", getattr(key, "idx", getattr(key, "name", key)))))
    return "/".join(parts)


def init_params(cfg: ModelConfig, seed: int) -> tuple[nnx.GraphDef, Params]:
    """A fresh model as its graph definition plus a plain nested dict of arrays.

    The train step works on the plain dict (a pytree optax and the shardings
    understand directly) and rebuilds the module with ``nnx.merge(graphdef, params)``.
    """
    graphdef, state = nnx.split(TransformerLM(cfg, nnx.Rngs(params=seed)))
    return graphdef, nnx.to_pure_dict(state)


def param_initializer(cfg: ModelConfig, seed: int) -> tuple[nnx.GraphDef, Callable[[], Params]]:
    """The graph definition, and a function of no arguments that builds the parameters.

    The same parameters as `init_params`, but not built yet: `spare_jax.fit`
    runs the function as one program whose outputs are born in their shards,
    and only where their values are needed (a resumed job or a replacement
    takes the state from a checkpoint or a live group instead).
    """
    model = lambda: TransformerLM(cfg, nnx.Rngs(params=seed))
    return nnx.graphdef(nnx.eval_shape(model)), lambda: nnx.to_pure_dict(nnx.state(model()))


def param_logical_axes(params: Params) -> Params:
    """Logical axis names (a tuple per leaf) of every parameter, by path rules.

    Raises:
        KeyError: for a parameter that no rule names (so a new parameter cannot be
            left unsharded by accident).
    """

    def axes_of(path: tuple, leaf: jax.Array) -> tuple[str | None, ...]:
        name = _path_name(path)
        for pattern, axes in _AXES_BY_NAME:
            if re.search(pattern, name):
                if len(axes) != len(leaf.shape):
                    raise ValueError(
                        f"rule {pattern!r} names {len(axes)} axes for {name} of shape {leaf.shape}"
                    )
                return axes
        raise KeyError(f"no logical-axis rule for parameter {name}")

    return jax.tree.map_with_path(axes_of, params)


def param_specs(params: Params) -> Params:
    """The mesh ``PartitionSpec`` of every parameter (its logical axes through `mesh.RULES`)."""
    is_axes = lambda x: isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x)
    return jax.tree.map(mesh_lib.logical_spec, param_logical_axes(params), is_leaf=is_axes)


def next_token_loss(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """Mean cross-entropy of predicting ``tokens[:, 1:]`` from ``logits[:, :-1]``-aligned inputs.

    Args:
        logits: float32[B, T, V] for the inputs ``tokens[:, :-1]``.
        tokens: int[B, T + 1].

    Returns:
        The mean over all B * T target tokens, float32 scalar.
    """
    targets = tokens[:, 1:].astype(jnp.int32)
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return -picked.mean()


def loss_fn(graphdef: nnx.GraphDef, params: Params, tokens: jax.Array) -> jax.Array:
    """Next-token loss of the model ``(graphdef, params)`` on one micro-batch int[B, T + 1]."""
    model = nnx.merge(graphdef, params)
    return next_token_loss(model(tokens[:, :-1]), tokens)
