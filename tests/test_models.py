"""Tests for models/: shapes, parameter counts, causality, GQA, RoPE, dtypes and remat."""

import math
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import PRESETS, Llama, LlamaConfig, get_preset, loss_fn, matmul, param_count
from models.llama import _rope

TINY = PRESETS["tiny"]

# Shapes that exercise edge cases of the parameter formula: MQA (1 kv head), MHA, a single layer,
# odd vocabulary and FFN sizes.
_ODD_CONFIGS = (
    ("mqa_odd_vocab", LlamaConfig(97, 48, 1, 6, 1, 100, 32)),
    ("mha_3_layers", LlamaConfig(300, 32, 3, 2, 2, 72, 16)),
)


def _count_params(model: nnx.Module) -> int:
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


# Eager NNX runs op by op (seconds per tiny forward on 2 CPU cores); jitted calls keep tests fast.
@nnx.jit
def _forward(model: Llama, tokens: jax.Array) -> jax.Array:
    return model(tokens)


@nnx.jit
def _loss(model: Llama, tokens: jax.Array) -> jax.Array:
    return loss_fn(model, tokens)


@nnx.jit
def _value_and_grad(model: Llama, tokens: jax.Array):
    return nnx.value_and_grad(loss_fn)(model, tokens)


def _tokens(batch: int, seq: int, vocab: int = 256, seed: int = 0) -> jax.Array:
    return jax.random.randint(jax.random.key(seed), (batch, seq), 0, vocab, dtype=jnp.int32)


@pytest.mark.parametrize(
    "config",
    [PRESETS["tiny"], PRESETS["small"]] + [c for _, c in _ODD_CONFIGS],
    ids=["tiny", "small"] + [n for n, _ in _ODD_CONFIGS],
)
def test_param_count_matches_instantiated_model(config):
    # eval_shape builds the model abstractly: the same parameter tree, nothing allocated.
    abstract = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0)))
    assert param_count(config) == _count_params(abstract)


def test_param_count_of_large_presets_is_analytic_and_near_the_name():
    # analytic: no model is built, not even abstractly
    with mock.patch.object(Llama, "__init__", side_effect=AssertionError("a model was built")):
        counts = {name: param_count(cfg) for name, cfg in PRESETS.items()}
    # Independent references: Meta's LLaMA-1 7B / 13B and TinyLlama-1.1B have these exact sizes.
    assert counts["7B"] == 6_738_415_616
    assert counts["13B"] == 13_015_864_320
    assert counts["1B"] == 1_100_048_384
    suffix = {"M": 1e6, "B": 1e9}
    for name, count in counts.items():
        if name in ("tiny", "small"):
            continue
        nominal = float(name[:-1]) * suffix[name[-1]]
        # The paper's names are rounded labels: with SwiGLU and GQA-4 its "40B" shape has 48.0e9
        # parameters, "52B" 44.0e9 and "120B" 106.4e9, hence the -20%/+25% band.
        assert 0.8 * nominal <= count <= 1.25 * nominal, (name, count)
    assert 35e9 <= counts["52B"] <= 50e9 and 40e9 <= counts["40B"] <= 50e9


def test_small_preset_is_a_few_million_parameters():
    assert 1e6 <= param_count(PRESETS["small"]) <= 1e7


def test_paper_shapes_match_reference():
    # mlp-offload.md "Model shapes": layers x hidden x FFN x heads, GQA-4, seq 2048, vocab 32000.
    expected = {
        "40B": (128, 5120, 20480, 40),
        "52B": (64, 8192, 21824, 64),
        "70B": (80, 8192, 28672, 64),
        "100B": (124, 8192, 28672, 64),
        "120B": (96, 10240, 28672, 80),
    }
    for name, shape in expected.items():
        cfg = get_preset(name)
        assert (cfg.layers, cfg.hidden, cfg.ffn, cfg.heads) == shape, name
        assert (cfg.kv_heads, cfg.max_seq_len, cfg.vocab_size) == (4, 2048, 32000), name


def test_get_preset_unknown_name_lists_valid_names():
    with pytest.raises(ValueError, match=r"unknown model preset 'huge'.*tiny, small, 125M"):
        get_preset("huge")


def test_forward_shapes_and_dtype():
    logits = _forward(Llama(TINY), _tokens(3, 17))
    assert logits.shape == (3, 17, 256)
    assert logits.dtype == jnp.float32
    assert bool(jnp.all(jnp.isfinite(logits)))


def test_causality_future_tokens_do_not_change_earlier_logits():
    model = Llama(TINY, rngs=nnx.Rngs(1))
    tokens = _tokens(2, 16)
    changed = tokens.at[:, 10:].set((tokens[:, 10:] + 7) % 256)
    a, b = _forward(model, tokens), _forward(model, changed)
    np.testing.assert_array_equal(np.asarray(a[:, :10]), np.asarray(b[:, :10]))
    assert not np.allclose(np.asarray(a[:, 10:]), np.asarray(b[:, 10:]))


@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_gqa_equals_mha_with_repeated_kv_heads(kv_heads):
    # Independent reference: a GQA model is an MHA model whose k/v projections repeat each kv head
    # for its heads // kv_heads query heads (query head h reads kv head h // group).
    gqa_cfg = TINY.replace(kv_heads=kv_heads)
    gqa = Llama(gqa_cfg, rngs=nnx.Rngs(2))
    mha = Llama(TINY.replace(kv_heads=TINY.heads), rngs=nnx.Rngs(3))
    group, hd = TINY.heads // kv_heads, TINY.head_dim
    nnx.update(mha.embed, nnx.state(gqa.embed))
    nnx.update(mha.final_norm, nnx.state(gqa.final_norm))
    nnx.update(mha.lm_head, nnx.state(gqa.lm_head))
    for src, dst in zip(gqa.blocks, mha.blocks, strict=True):
        for name in ("attn_norm", "mlp_norm", "mlp"):
            nnx.update(getattr(dst, name), nnx.state(getattr(src, name)))
        for name in ("q", "o"):
            nnx.update(getattr(dst.attn, name), nnx.state(getattr(src.attn, name)))
        for name in ("k", "v"):
            kernel = getattr(src.attn, name).kernel[...].reshape(TINY.hidden, kv_heads, hd)
            repeated = jnp.repeat(kernel, group, axis=1).reshape(TINY.hidden, TINY.hidden)
            getattr(dst.attn, name).kernel[...] = repeated
    tokens = _tokens(2, 12)
    np.testing.assert_allclose(
        np.asarray(_forward(gqa, tokens)), np.asarray(_forward(mha, tokens)), rtol=1e-5, atol=1e-6
    )


def test_rope_scores_depend_only_on_relative_position():
    q = jax.random.normal(jax.random.key(0), (1, 1, 1, 16))
    k = jax.random.normal(jax.random.key(1), (1, 1, 1, 16))
    seq = 12
    qr = _rope(jnp.broadcast_to(q, (1, seq, 1, 16)), 10000.0)[0, :, 0]
    kr = _rope(jnp.broadcast_to(k, (1, seq, 1, 16)), 10000.0)[0, :, 0]
    scores = np.asarray(qr @ kr.T)  # scores[i, j] = <rope(q, i), rope(k, j)>
    for offset in (0, 1, 5):
        diag = np.diagonal(scores, offset=-offset)
        np.testing.assert_allclose(diag, diag[0], rtol=1e-5, atol=1e-5)
    # Position 0 is not rotated.
    np.testing.assert_allclose(np.asarray(qr[0]), np.asarray(q[0, 0, 0]), rtol=1e-6)


def test_untrained_loss_is_about_log_vocab():
    loss = float(_loss(Llama(TINY), _tokens(4, 64)))
    assert abs(loss - math.log(256)) <= 0.1 * math.log(256)


def test_bf16_params_and_compute():
    cfg = TINY.replace(param_dtype="bfloat16", dtype="bfloat16")
    model = Llama(cfg)
    dtypes = {x.dtype for x in jax.tree.leaves(nnx.state(model, nnx.Param))}
    assert dtypes == {jnp.dtype(jnp.bfloat16)}
    tokens = _tokens(2, 32)
    loss, grads = _value_and_grad(model, tokens)
    assert loss.dtype == jnp.float32
    assert abs(float(loss) - math.log(256)) <= 0.1 * math.log(256)
    for g in jax.tree.leaves(grads):
        assert g.dtype == jnp.bfloat16 and bool(jnp.all(jnp.isfinite(g)))
    # bf16 params with fp32 compute (mixed precision the other way round) also run.
    assert _forward(Llama(cfg.replace(dtype="float32")), tokens).dtype == jnp.float32


def test_remat_gives_same_loss_and_grads():
    tokens = _tokens(2, 32)
    plain = Llama(TINY, rngs=nnx.Rngs(4))
    remat = Llama(TINY.replace(remat=True), rngs=nnx.Rngs(4))
    loss_a, grads_a = _value_and_grad(plain, tokens)
    loss_b, grads_b = _value_and_grad(remat, tokens)
    # Same program up to recomputation; float32 reassociation is the only allowed difference.
    np.testing.assert_allclose(float(loss_a), float(loss_b), rtol=1e-6)
    flat_a, flat_b = jax.tree.leaves(grads_a), jax.tree.leaves(grads_b)
    assert len(flat_a) == len(flat_b)
    for a, b in zip(flat_a, flat_b, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
    # And remat is really there: one rematerialised region (primitive remat2) per block.
    assert _grad_jaxpr(plain, tokens).count("remat") == 0
    assert _grad_jaxpr(remat, tokens).count("remat") == TINY.layers


@pytest.mark.parametrize("remat", [False, True], ids=["plain", "remat"])
def test_scanned_layers_are_the_unrolled_model_stacked(remat):
    """scan_layers stacks the unrolled model's initial params along a leading layer axis, and
    the scan computes the unrolled model's loss and gradients."""
    cfg = TINY.replace(layers=3, remat=remat)
    tokens = _tokens(2, 32)
    unrolled = Llama(cfg, rngs=nnx.Rngs(4))
    scanned = Llama(cfg.replace(scan_layers=True), rngs=nnx.Rngs(4))
    assert param_count(cfg) == _count_params(scanned)
    blocks = nnx.to_pure_dict(nnx.state(scanned.blocks, nnx.Param))
    layers = [nnx.to_pure_dict(nnx.state(b, nnx.Param)) for b in unrolled.blocks]
    for stacked, *per_layer in zip(*map(jax.tree.leaves, [blocks, *layers]), strict=True):
        assert stacked.shape[0] == cfg.layers
        np.testing.assert_array_equal(np.asarray(stacked), np.stack(per_layer))
    loss_a, grads_a = _value_and_grad(unrolled, tokens)
    loss_b, grads_b = _value_and_grad(scanned, tokens)
    np.testing.assert_allclose(float(loss_a), float(loss_b), rtol=1e-6)
    grads_a, grads_b = nnx.to_pure_dict(grads_a), nnx.to_pure_dict(grads_b)
    per_layer = [grads_a["blocks"][k] for k in range(cfg.layers)]
    stacked = jax.tree.map(lambda *xs: np.stack(xs), *per_layer)
    for a, b in zip(jax.tree.leaves(stacked), jax.tree.leaves(grads_b["blocks"]), strict=True):
        np.testing.assert_allclose(a, np.asarray(b), rtol=1e-5, atol=1e-7)
    for key in ("embed", "final_norm", "lm_head"):
        for a, b in zip(jax.tree.leaves(grads_a[key]), jax.tree.leaves(grads_b[key]), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
    # one scan over the blocks, and with remat one rematerialised body
    jaxpr = _grad_jaxpr(scanned, tokens)
    assert jaxpr.count("scan[") == 2  # the forward scan and its transpose
    assert jaxpr.count("remat") == (1 if remat else 0)


def _grad_jaxpr(model: Llama, tokens: jax.Array) -> str:
    graphdef, state = nnx.split(model)
    grad = jax.grad(lambda s: loss_fn(nnx.merge(graphdef, s), tokens))
    return str(jax.make_jaxpr(grad)(state))


def test_jitted_step_does_not_recompile():
    model = Llama(TINY)
    graphdef, state = nnx.split(model)

    traces = []

    @jax.jit
    def step(state, tokens):
        traces.append(1)  # runs only when jax traces (and so compiles) the function
        return jax.value_and_grad(lambda s: loss_fn(nnx.merge(graphdef, s), tokens))(state)

    step(state, _tokens(2, 16, seed=0))
    step(state, _tokens(2, 16, seed=1))
    assert len(traces) == 1


def test_sequence_longer_than_max_seq_len_raises():
    with pytest.raises(ValueError, match="exceeds LlamaConfig.max_seq_len=128"):
        Llama(TINY)(jnp.zeros((1, 129), jnp.int32))


@pytest.mark.parametrize(
    ("changes", "pattern"),
    [
        ({"hidden": 66}, r"hidden=66 is not divisible by heads=4"),
        ({"kv_heads": 3}, r"heads=4 is not divisible by kv_heads=3"),
        ({"layers": 0}, r"LlamaConfig.layers must be a positive int, got 0"),
        ({"vocab_size": -1}, r"LlamaConfig.vocab_size must be a positive int"),
        ({"hidden": 12, "heads": 4, "kv_heads": 2}, r"head size .* = 3 is odd"),
        ({"param_dtype": "float16"}, r"param_dtype='float16' is not supported"),
        ({"dtype": "int8"}, r"LlamaConfig.dtype='int8' is not supported"),
        ({"norm_eps": 0.0}, r"must both be positive"),
    ],
    ids=["hidden_heads", "heads_kv", "layers", "vocab", "odd_head", "param_dtype", "dtype", "eps"],
)
def test_config_validation(changes, pattern):
    with pytest.raises(ValueError, match=pattern):
        TINY.replace(**changes)


# -- models.matmul: the dense layers' bfloat16 contraction ------------------------------------


def _bf16(shape, seed):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(jnp.bfloat16)


def _within_one_bf16_ulp(actual, reference):
    """Each element of bfloat16 ``actual`` is ``reference`` (float64) rounded either way."""
    actual = np.asarray(actual, np.float64)
    ulp = np.spacing(np.abs(reference).astype(np.float32)) * 2.0**16  # bf16 keeps 8 of 24 bits
    assert np.all(np.abs(actual - reference) <= ulp), np.max(np.abs(actual - reference) / ulp)


def test_matmul_forward_and_gradients_are_float32_accumulated():
    x, w, g = _bf16((2, 16, 48), 0), _bf16((48, 40), 1), _bf16((2, 16, 40), 2)
    dims = (((2,), (0,)), ((), ()))
    y, vjp = jax.vjp(lambda x, w: matmul.dot_general(x, w, dims), x, w)
    dx, dw = vjp(g)
    assert (y.dtype, dx.dtype, dw.dtype) == (jnp.bfloat16,) * 3
    x64, w64, g64 = (np.asarray(a, np.float64) for a in (x, w, g))
    _within_one_bf16_ulp(y, x64 @ w64)
    _within_one_bf16_ulp(dx, g64 @ w64.T)
    _within_one_bf16_ulp(dw, np.einsum("btk,btn->kn", x64, g64))
    # the same values as autodiff of XLA's plain bfloat16 dot, but for the order of the sums
    y_ref, vjp_ref = jax.vjp(lambda x, w: jax.lax.dot_general(x, w, dims), x, w)
    for a, b in zip((y, *vjp(g)), (y_ref, *vjp_ref(g)), strict=True):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.mean(a != b) < 0.02
        np.testing.assert_allclose(a, b, rtol=2**-7, atol=1e-6)


def test_matmul_gradient_dots_all_accumulate_in_float32():
    x, w, g = _bf16((4, 48), 0), _bf16((48, 40), 1), _bf16((4, 40), 2)

    def fwd_bwd(x, w, g):
        y, vjp = jax.vjp(lambda x, w: matmul.dot_general(x, w, (((1,), (0,)), ((), ()))), x, w)
        return y, vjp(g)

    text = str(jax.make_jaxpr(fwd_bwd)(x, w, g))
    dots = [line for line in text.splitlines() if "dot_general[" in line]
    # bfloat16 operands, float32 results: each product is summed in float32
    assert len(dots) == 3 and all(":f32[" in line for line in dots), text


@pytest.mark.parametrize(
    "lhs, rhs, dims",
    [
        ((4, 8), (8, 3), (((1,), (0,)), ((), ()))),  # float32: XLA's own path
        ((2, 4, 8), (2, 8, 3), (((2,), (1,)), ((0,), (0,)))),  # batched
        ((8, 4), (8, 3), (((0,), (0,)), ((), ()))),  # another contraction
    ],
)
def test_matmul_other_contractions_are_lax_dot_general(lhs, rhs, dims):
    dtype = jnp.float32 if len(lhs) == 2 and dims[0][0] == (1,) else jnp.bfloat16
    a, b = _bf16(lhs, 0).astype(dtype), _bf16(rhs, 1).astype(dtype)
    np.testing.assert_array_equal(
        np.asarray(matmul.dot_general(a, b, dims), np.float32),
        np.asarray(jax.lax.dot_general(a, b, dims), np.float32),
    )


def test_bf16_model_trains_the_same_with_plain_xla_dots():
    cfg = TINY.replace(param_dtype="bfloat16", dtype="bfloat16")
    fast = Llama(cfg, rngs=nnx.Rngs(3))
    plain = Llama(cfg, rngs=nnx.Rngs(3))
    for _, module in nnx.iter_modules(plain):
        if isinstance(module, nnx.Linear):
            module.dot_general = jax.lax.dot_general
    tokens = _tokens(2, 32)
    loss_a, grads_a = _value_and_grad(fast, tokens)
    loss_b, grads_b = _value_and_grad(plain, tokens)
    np.testing.assert_allclose(float(loss_a), float(loss_b), rtol=1e-3)
    for a, b in zip(jax.tree.leaves(grads_a), jax.tree.leaves(grads_b), strict=True):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        # bf16 activations: one rounding of a sum taken in another order can move later ones
        assert np.max(np.abs(a - b)) <= 0.05 * np.max(np.abs(b)), np.max(np.abs(a - b))
