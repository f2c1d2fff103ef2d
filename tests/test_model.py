"""The Flax LM: shapes, causality, initial loss, parameter axes, bf16."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from lm import model as model_lib

CFG = model_lib.ModelConfig(vocab=32, seq_len=8, d_model=16, heads=2, layers=2, d_ff=32)


def test_forward_shape_and_initial_loss():
    graphdef, params = model_lib.init_params(CFG, seed=0)
    tokens = jax.random.randint(jax.random.key(0), (3, CFG.seq_len + 1), 0, CFG.vocab)
    loss = jax.jit(lambda p, t: model_lib.loss_fn(graphdef, p, t))(params, tokens)
    assert loss.shape == ()
    assert abs(float(loss) - np.log(CFG.vocab)) < 0.1  # near-uniform predictions at init


def test_causal():
    from flax import nnx

    graphdef, params = model_lib.init_params(CFG, seed=0)
    lm = nnx.merge(graphdef, params)
    tokens = jnp.arange(CFG.seq_len)[None] % CFG.vocab
    changed = tokens.at[0, -1].set((tokens[0, -1] + 1) % CFG.vocab)
    a, b = lm(tokens), lm(changed)
    assert a.shape == (1, CFG.seq_len, CFG.vocab)
    np.testing.assert_allclose(a[:, :-1], b[:, :-1], atol=1e-6)
    assert not np.allclose(a[:, -1], b[:, -1])


def test_every_parameter_has_logical_axes():
    _, params = model_lib.init_params(CFG, seed=0)
    axes = model_lib.param_logical_axes(params)
    is_axes = lambda x: isinstance(x, tuple)
    leaves = jax.tree.leaves(axes, is_leaf=is_axes)
    assert len(leaves) == len(jax.tree.leaves(params))
    assert axes["blocks"][0]["mlp"]["up"] == ("embed", "mlp")
    assert axes["blocks"][1]["attn"]["out"] == ("heads", "head_dim", "embed")


def test_bfloat16_compute_keeps_fp32_params_and_loss():
    cfg = model_lib.ModelConfig(**{**CFG.__dict__, "dtype": "bfloat16"})
    graphdef, params = model_lib.init_params(cfg, seed=0)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(params))
    tokens = jnp.zeros((2, cfg.seq_len + 1), jnp.int32)
    loss, grads = jax.jit(jax.value_and_grad(lambda p: model_lib.loss_fn(graphdef, p, tokens)))(
        params
    )
    assert loss.dtype == jnp.float32 and np.isfinite(float(loss))
    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))


def test_config_validation():
    with pytest.raises(ValueError, match="must divide"):
        model_lib.ModelConfig(d_model=10, heads=3).validate()
    with pytest.raises(ValueError, match="dtype"):
        model_lib.ModelConfig(dtype="float16").validate()
