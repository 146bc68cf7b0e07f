"""The GPT against an independent plain-jax.numpy forward, its masking, its size table, its training."""

import contextlib
import importlib.util
import io
import math
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxllm import config
from jaxllm.families import deepseek_v3, llama
from jaxllm.model import attention, gpt, layers
from jaxllm.parallel import context_parallel, sharding
from jaxllm.resolve import resolve
from jaxllm.runtime import cpu, optim, step
from jaxllm_kernels import reference

ROOT = Path(__file__).resolve().parents[1]


def small_cfg(train=None, **model_overrides):
    c = config.get_config()
    c.model.update(num_layers=2, hidden_size=64, num_attention_heads=4, dtype="float32", vocab_size=97)
    c.model.update(**model_overrides)
    c.train.update(seq_length=32, micro_batch_size=4, global_batch_size=4, warmup_iters=0, lr=1e-3, min_lr=1e-3)
    c.train.update(**(train or {}))
    return resolve(c, num_devices=1)


def loss_and_grads(graphdef, params, tokens):
    """Mean next-token loss of ``tokens`` [batch, seq] and its gradients."""
    loss_fn = lambda p: gpt.loss(graphdef, p, tokens, jnp.roll(tokens, -1, axis=1)) / tokens.size  # noqa: E731
    return jax.value_and_grad(loss_fn)(params)


def reference_norm(m, x, w):
    """``model.norm`` of ``x`` with the parameters ``w`` (``scale``, ``bias``), written out."""
    if m.norm == "layernorm":
        x = (x - x.mean(-1, keepdims=True)) / jnp.sqrt(x.var(-1, keepdims=True) + m.norm_eps)
    else:
        x = x / jnp.sqrt((x**2).mean(-1, keepdims=True) + m.norm_eps)
    return x * w["scale"] + (w["bias"] if "bias" in w else 0)


@pytest.mark.parametrize("norm, bias", [("layernorm", True), ("layernorm", False), ("rmsnorm", False)])
def test_norm_gradient_is_autodiffs_of_the_written_out_norm(norm, bias):
    """layers.norm's own backward pass (it keeps the bfloat16 input and each row's statistics) against autodiff of
    reference_norm in float32, for a bfloat16 input as the model's."""
    k = jax.random.split(jax.random.key(0), 4)
    x = (3 * jax.random.normal(k[0], (2, 8, 64)) + 1).astype(jnp.bfloat16)
    w = {"scale": jax.random.normal(k[1], (64,)), **({"bias": jax.random.normal(k[2], (64,))} if bias else {})}
    dy = jax.random.normal(k[3], (2, 8, 64))
    m = config.Model(norm=norm, norm_eps=1e-5)
    ours = jax.grad(lambda x, w: (layers.norm(x, w["scale"], w.get("bias"), norm == "layernorm", 1e-5)
                                  .astype(jnp.float32) * dy).sum(), (0, 1))(x, w)
    # the output in bfloat16 as ours: both backward passes get the same bfloat16 cotangent
    ref = jax.grad(lambda x, w: (reference_norm(m, x.astype(jnp.float32), w).astype(jnp.bfloat16)
                                 .astype(jnp.float32) * dy).sum(), (0, 1))(x, w)
    np.testing.assert_allclose(ours[0].astype(jnp.float32), ref[0].astype(jnp.float32), rtol=2e-2, atol=2e-2)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5), ours[1], ref[1])
    assert ours[0].dtype == jnp.bfloat16 and ours[1]["scale"].dtype == jnp.float32


@pytest.mark.parametrize("center", [True, False])
def test_norm_over_two_axes_and_one_plus_is_autodiffs(center):
    """The same backward over the last two axes (OLMo 2's query/key norm over all heads, ``[heads, head_dim]``) with
    a (1 + w) scale (Gemma's), in float32 against autodiff of the norm written out with jax.numpy."""
    k = jax.random.split(jax.random.key(1), 3)
    x, w, dy = (jax.random.normal(k[0], (2, 5, 4, 8)), 0.1 * jax.random.normal(k[1], (4, 8)),
                jax.random.normal(k[2], (2, 5, 4, 8)))

    def written_out(x, w):
        x = x - x.mean((-2, -1), keepdims=True) if center else x
        return x * jax.lax.rsqrt((x * x).mean((-2, -1), keepdims=True) + 1e-6) * (1 + w)

    ours = jax.grad(lambda x, w: (layers.norm(x, 1 + w, None, center, 1e-6, 2) * dy).sum(), (0, 1))(x, w)
    ref = jax.grad(lambda x, w: (written_out(x, w) * dy).sum(), (0, 1))(x, w)
    for a, b in zip(ours, ref):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def reference_layer(m, L, x):
    """One pre-norm transformer layer (parameters ``L``: ``attn``, ``mlp``, ``ln1``, ``ln2``) of ``x`` [batch, seq,
    hidden] at positions ``arange(seq)``, written out with jax.numpy."""
    h, nh, nkv = m.hidden_size, m.num_attention_heads, m.num_kv_heads
    d, s = h // nh, x.shape[1]

    def rope(x):
        half = d // 2
        freq = 1.0 / m.rotary_base ** (np.arange(half) / half)
        ang = np.arange(s)[:, None] * freq[None]
        cos, sin = np.cos(ang)[None, :, None], np.sin(ang)[None, :, None]
        a, b = x[..., :half], x[..., half:]
        return jnp.concatenate([a * cos - b * sin, b * cos + a * sin], -1)

    causal = np.tril(np.ones((s, s), bool))
    a, y = L["attn"], reference_norm(m, x, L["ln1"])
    q = jnp.einsum("bse,ehd->bshd", y, a["wq"]) + a.get("bq", 0)
    k = jnp.einsum("bse,ehd->bshd", y, a["wk"]) + a.get("bk", 0)
    v = jnp.einsum("bse,ehd->bshd", y, a["wv"]) + a.get("bv", 0)
    if m.position_embedding == "rotary":
        q, k = rope(q), rope(k)
    k, v = jnp.repeat(k, nh // nkv, axis=2), jnp.repeat(v, nh // nkv, axis=2)
    att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d)
    att = jax.nn.softmax(jnp.where(causal, att, -jnp.inf), axis=-1)
    o = jnp.einsum("bhqk,bkhd->bqhd", att, v)
    x = x + jnp.einsum("bshd,hde->bse", o, a["wo"]) + a.get("bo", 0)
    f, y = L["mlp"], reference_norm(m, x, L["ln2"])
    u = y @ f["w1"] + f.get("b1", 0)
    u = jax.nn.silu(y @ f["wg"]) * u if m.activation == "swiglu" else 0.5 * u * (
        1 + jnp.tanh(math.sqrt(2 / math.pi) * (u + 0.044715 * u**3)))
    return x + u @ f["w2"] + f.get("b2", 0)


def reference_hidden(cfg, p, tokens):
    """The GPT's last layer's output [batch, seq, hidden], written out with jax.numpy, sharing no code with
    jaxllm.model."""
    m = cfg.model
    x = p["wte"][tokens]
    if m.position_embedding == "learned":
        x = x + p["wpe"][:tokens.shape[1]]
    for i in range(m.num_layers):
        x = reference_layer(m, jax.tree.map(lambda a, i=i: a[i], p["layers"]), x)
    return x


def reference_output(cfg, p, x):
    """The output layer's logits over the ``vocab_size`` real tokens (the tables' padded rows left out) of the
    final-normed ``x``."""
    m = cfg.model
    return (x @ (p["wte"].T if m.tie_embeddings else p["lm_head"]))[..., :m.vocab_size]


def reference_logits(cfg, p, tokens):
    """GPT forward written out with jax.numpy, layer by layer, sharing no code with jaxllm.model;
    logits over the ``vocab_size`` real tokens (the tables' padded rows left out)."""
    return reference_output(cfg, p, reference_norm(cfg.model, reference_hidden(cfg, p, tokens), p["ln_f"]))


VARIANTS = [
    {},
    dict(**llama.PRESET, num_kv_heads=2, tie_embeddings=False),
]


MATMULS = {"dense": layers.dense, "row_major_dense": cpu.row_major_dense}
# multi-head latent attention (DeepSeek-V2/V3) in a tiny Llama-style model: query latent 12, key/value latent 16,
# per head 8 query/key dimensions without position and 4 rotary ones, values 6 wide
MLA = dict(**deepseek_v3.PRESET, q_lora_rank=12, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6)


@pytest.mark.parametrize("matmuls", MATMULS)
@pytest.mark.parametrize("layer_loop", ["scan", "unrolled"])
@pytest.mark.parametrize("overrides", VARIANTS, ids=["gpt2-style", "llama-style"])
def test_loss_matches_plain_jax_reference(overrides, layer_loop, matmuls):
    """Loss and gradients of every parameter against the plain jax.numpy model, with the layers
    scanned or written out and the matmuls' gradients as autodiff's or the row-major ones (CPUs')."""
    cfg = small_cfg(layer_loop=layer_loop, **overrides)
    graphdef = gpt.describe(cfg.model, gpt.Ops(dense=MATMULS[matmuls])).graphdef
    params = gpt.init(cfg.model, 0)
    assert params["wte"].shape[0] == cfg.model.padded_vocab_size == 128  # 97 padded: the padding is masked
    tokens = jax.random.randint(jax.random.key(1), (2, 32), 0, 97)
    targets = jnp.roll(tokens, -1, axis=1)
    ours, grads = jax.value_and_grad(lambda p: gpt.loss(graphdef, p, tokens, targets) / targets.size)(params)
    ref, ref_grads = jax.value_and_grad(lambda p: optax.softmax_cross_entropy_with_integer_labels(
        reference_logits(cfg, p, tokens), targets).mean())(params)
    np.testing.assert_allclose(ours, ref, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), grads, ref_grads)
    assert ours > 4.0  # near ln(97) = 4.57 at init: the comparison is not between two constants


def test_unrolled_layers_gradients_are_stacked_not_padded_and_summed():
    """The written-out layers' gradients reach the stacked parameters as one stack per array, not as
    each layer's gradient padded to the whole stack and the pads summed (L^2 work: on an H200 XLA fused
    GPT1_5B's 48 pads per array into kernels that took 42 % of the step, docs/performance.md)."""
    cfg = small_cfg(layer_loop="unrolled", num_layers=3, **VARIANTS[0])
    graphdef, params = gpt.describe(cfg.model).graphdef, gpt.init(cfg.model, 0)
    tokens = jnp.zeros((2, 32), jnp.int32)
    jaxpr = str(jax.make_jaxpr(jax.grad(lambda p: gpt.loss(graphdef, p, tokens, tokens)))(params))
    stacked = len(jax.tree.leaves(params["layers"]))
    assert len(re.findall(r"= pad\[", jaxpr)) == 0, re.findall(r".*= pad\[.*", jaxpr)[:3]
    assert len(re.findall(r"= stack\[", jaxpr)) == stacked  # the transpose of the one unstack per array


@pytest.mark.parametrize("overrides", VARIANTS, ids=["gpt2-style", "llama-style"])
def test_vocabulary_padding_does_not_change_the_model(overrides):
    """97 tokens in tables of 97, 128 or 392 rows (the padding tensor parallelism asks for): the same
    initial values and the same loss and gradients of the real rows; the padded rows stay zero."""
    results = []
    for divisible_by in (1, 128, 392):
        cfg = small_cfg(make_vocab_size_divisible_by=divisible_by, **overrides)
        graphdef, params = gpt.describe(cfg.model).graphdef, gpt.init(cfg.model, 0)
        tokens = jax.random.randint(jax.random.key(1), (2, 32), 0, 97)
        loss, grads = loss_and_grads(graphdef, params, tokens)
        for table, axis in (("wte", 0), ("lm_head", 1)):
            if table in params:
                assert params[table].shape[axis] == cfg.model.padded_vocab_size
                pad = (slice(None),) * axis + (slice(97, None),)
                assert not np.any(params[table][pad]) and not np.any(grads[table][pad])
                params[table], grads[table] = params[table][(slice(None),) * axis + (slice(0, 97),)], \
                    grads[table][(slice(None),) * axis + (slice(0, 97),)]
        results.append((loss, params, grads))
    for loss, params, grads in results[1:]:
        np.testing.assert_allclose(loss, results[0][0], rtol=1e-6)
        jax.tree.map(np.testing.assert_array_equal, params, results[0][1])
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-7), grads, results[0][2])


def test_initialization_scales():
    cfg = small_cfg(num_layers=8, hidden_size=256)
    p = gpt.init(cfg.model, 0)
    p["wte"] = p["wte"][:97]  # the real rows (the padding is zeros)
    np.testing.assert_allclose(np.std(p["wte"]), 0.02, rtol=0.05)
    np.testing.assert_allclose(np.std(p["layers"]["mlp"]["w1"]), 0.02, rtol=0.05)
    np.testing.assert_allclose(np.std(p["layers"]["attn"]["wo"]), 0.02 / math.sqrt(16), rtol=0.05)
    np.testing.assert_allclose(np.std(p["layers"]["mlp"]["w2"]), 0.02 / math.sqrt(16), rtol=0.05)


@pytest.mark.parametrize("overrides", VARIANTS, ids=["gpt2-style", "llama-style"])
def test_causal_masking(overrides):
    cfg = small_cfg(**overrides)
    graphdef = gpt.describe(cfg.model).graphdef
    params = gpt.init(cfg.model, 0)
    fwd = jax.jit(lambda t: gpt.forward(graphdef, params, t))
    tokens = jax.random.randint(jax.random.key(2), (1, 32), 0, 97)
    base = fwd(tokens)
    for pos in (5, 20, 31):
        changed = fwd(tokens.at[0, pos].set((tokens[0, pos] + 1) % 97))
        np.testing.assert_array_equal(changed[0, :pos], base[0, :pos])
        assert not np.allclose(changed[0, pos], base[0, pos])


@pytest.mark.parametrize("layer_loop, window, overrides", [("scan", 0, {"num_kv_heads": 2}),
                                                       ("unrolled", 0, {"num_kv_heads": 2}),
                                                       ("scan", 5, {"num_kv_heads": 2}), ("scan", 0, MLA)],
                         ids=["scan", "unrolled", "window", "mla"])
def test_kv_cache_decoding_matches_full_forward(layer_loop, window, overrides):
    """Decoding with the cache gives the full forward's logits (with a sliding window of 5: positions 8-11 see
    none of the first tokens, which the cache still holds; with multi-head latent attention the cache holds its
    keys and values decompressed, of different widths)."""
    cfg = small_cfg(**{"position_embedding": "rotary", "layer_loop": layer_loop, "sliding_window": window,
                       **overrides})
    graphdef = gpt.describe(cfg.model).graphdef
    params = gpt.init(cfg.model, 0)
    tokens = jax.random.randint(jax.random.key(3), (2, 12), 0, 97)
    full = gpt.forward(graphdef, params, tokens)
    cache = gpt.init_cache(cfg.model, 2, 32)
    pos = jnp.broadcast_to(jnp.arange(8), (2, 8))
    logits, cache = gpt.forward(graphdef, params, tokens[:, :8], positions=pos, cache=cache)
    np.testing.assert_allclose(logits, full[:, :8], atol=1e-5)
    for i in range(8, 12):
        logits, cache = gpt.forward(graphdef, params, tokens[:, i:i + 1], positions=jnp.full((2, 1), i), cache=cache)
        np.testing.assert_allclose(logits[:, 0], full[:, i], atol=1e-5)


def test_overfits_one_batch():
    cfg = small_cfg(train=dict(lr=3e-3, min_lr=3e-3, weight_decay=0.0))
    spec = gpt.describe(cfg.model)
    opt = optim.make_optimizer(cfg.train, spec.decay)
    state = step.init_state(gpt.init(cfg.model, 0), opt)
    train_step = jax.jit(step.make_train_step(cfg, spec, opt))
    tokens = np.random.default_rng(0).integers(0, 97, (1, 4, 33)).astype(np.int32)
    for _ in range(150):
        state, m = train_step(state, tokens[..., :-1], tokens[..., 1:])
    assert float(m["loss"]) < 0.1


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_gradient_accumulation_equals_one_big_batch(dropout):
    """One step on 8 rows as 1 micro batch and as 4 laid out as the training loop lays them out
    (row r in micro batch r % 4): the same loss and update, with dropout too (each row's masks
    follow its index in the global batch, not its micro batch).  Plain SGD at lr 1: the parameters
    compare the gradients (Adam's first step, g / (|g| + eps), turns a gradient near 0, whose float32
    rounding the split moves, into updates that differ by percents of lr)."""
    cfg = small_cfg(train={"optimizer": "sgd", "sgd_momentum": 0.0, "lr": 1.0, "min_lr": 1.0}, dropout=dropout)
    spec = gpt.describe(cfg.model)
    opt = optim.make_optimizer(cfg.train, spec.decay)
    train_step = jax.jit(step.make_train_step(cfg, spec, opt))
    tokens = np.random.default_rng(0).integers(0, 97, (8, 33)).astype(np.int32)
    x, y = tokens[:, :-1], tokens[:, 1:]
    split = lambda a: a.reshape(2, 4, 32).swapaxes(0, 1)  # noqa: E731  (jaxllm.runtime.run.Run.global_batch)
    one, m1 = train_step(step.init_state(gpt.init(cfg.model, 0), opt), x[None], y[None])
    four, m4 = train_step(step.init_state(gpt.init(cfg.model, 0), opt), split(x), split(y))
    np.testing.assert_allclose(m1["loss"], m4["loss"], rtol=1e-6)
    np.testing.assert_allclose(m1["grad_norm"], m4["grad_norm"], rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-8), one["params"], four["params"])
    if dropout:  # it dropped something: the loss is not the deterministic one
        plain = gpt.loss(spec.graphdef, gpt.init(cfg.model, 0), x, y) / y.size
        assert abs(float(m1["loss"]) - float(plain)) > 1e-4, (m1["loss"], plain)


def test_one_dropout_key_is_one_key_per_row_folded_in():
    """The model takes one dropout key (other programs) or one per row (the train step): the same masks."""
    cfg = small_cfg(dropout=0.1)
    spec, params = gpt.describe(cfg.model), gpt.init(cfg.model, 0)
    tokens = np.random.default_rng(0).integers(0, 97, (3, 32)).astype(np.int32)
    key = jax.random.key(5)
    per_row = jax.vmap(jax.random.fold_in, (None, 0))(key, jnp.arange(3))
    one = gpt.loss(spec.graphdef, params, tokens, tokens, dropout_key=key)
    np.testing.assert_array_equal(one, gpt.loss(spec.graphdef, params, tokens, tokens, dropout_key=per_row))
    assert abs(float(one - gpt.loss(spec.graphdef, params, tokens, tokens))) > 1e-2  # it dropped something


def test_row_major_dense_is_dense_with_its_gradients():
    """Every layer matmul's spec, with and without a bias, both transposition branches (the
    contracted size below and above the output size): the same values and gradients as autodiff
    of the einsum."""
    keys = jax.random.split(jax.random.key(0), 4)
    for spec, x_shape, w_shape in [("bse,ehd->bshd", (3, 5, 8), (8, 2, 4)), ("bshd,hde->bse", (3, 5, 2, 4), (2, 4, 8)),
                                   ("bse,ef->bsf", (3, 5, 8), (8, 32)), ("bsf,fe->bse", (3, 5, 32), (32, 8))]:
        x, w = jax.random.normal(keys[0], x_shape), jax.random.normal(keys[1], w_shape)
        y_shape = jnp.einsum(spec, x, w).shape
        dy = jax.random.normal(keys[3], y_shape)
        for b in (None, jax.random.normal(keys[2], y_shape[2:])):
            ref, ref_vjp = jax.vjp(lambda x, w, b, s=spec: layers.dense(x, w, b, s, jnp.float32), x, w, b)
            out, out_vjp = jax.vjp(lambda x, w, b, s=spec: cpu.row_major_dense(x, w, b, s, jnp.float32), x, w,
                                   b)
            np.testing.assert_allclose(out, ref, rtol=1e-6)
            for got, want in zip(out_vjp(dy), ref_vjp(dy)):
                assert (got is None) == (want is None)
                if want is not None:
                    assert got.shape == want.shape
                    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_attention_in_batch_chunks_is_attention():
    """CPUs' attention in independent slices of the batch (jaxllm.runtime.cpu.BatchSlices; 4 asked for, 3
    taken: they divide 6 rows) against one call of the plain reference: values and gradients, with and without
    segment ids."""
    cfg = small_cfg()
    layout = sharding.Layout(sharding.make_mesh(cfg, jax.devices()[:1]), sharding.rules(cfg))
    keys = jax.random.split(jax.random.key(0), 5)
    q = jax.random.normal(keys[0], (6, 16, 4, 8))
    k, v = jax.random.normal(keys[1], (6, 16, 2, 8)), jax.random.normal(keys[2], (6, 16, 2, 8))
    dout = jax.random.normal(keys[3], q.shape)
    segments = jnp.cumsum(jax.random.bernoulli(keys[4], 0.2, (6, 16)), axis=1).astype(jnp.int32)
    for segment_ids in (None, segments):
        ours, ours_vjp = jax.vjp(lambda q, k, v, s=segment_ids: cpu.BatchSlices(context_parallel.Attention(layout), 4)(
            q, k, v, segment_ids=s), q, k, v)
        ref, ref_vjp = jax.vjp(lambda q, k, v, s=segment_ids: reference.attention(
            q, k, v, causal=True, q_segment_ids=s, kv_segment_ids=s), q, k, v)
        np.testing.assert_allclose(ours, ref, rtol=1e-6, atol=1e-6)
        for got, want in zip(ours_vjp(dout), ref_vjp(dout)):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert float(jnp.abs(ours - context_parallel.Attention(layout)(q, k, v)).max()) > 1e-3  # the segments count
    chunked = jax.make_jaxpr(cpu.BatchSlices(context_parallel.Attention(layout), 4))(q, k, v)
    assert str(chunked).count("dot_general") == 2 * 3  # scores and output per slice


def test_layer_loop_auto_follows_the_backend_and_remat():
    for backend, remat, loop in (("cpu", "none", "unrolled"), ("cpu", "full", "scan"), ("cuda", "none", "unrolled"),
                                 ("cuda", "save_dots", "scan"), ("rocm", "none", "scan")):
        c = config.get_config()
        c.model.remat = remat
        cfg = resolve(c, num_devices=1, vocab_size=97, backend=backend, data_files=False)
        assert (cfg.backend, cfg.model.layer_loop) == (backend, loop)


def test_weight_decay_spares_norms_and_biases():
    mask = gpt.describe(small_cfg().model).decay
    assert mask["wte"] and mask["wpe"] and mask["layers"]["attn"]["wq"] and mask["layers"]["mlp"]["w2"]
    assert not mask["layers"]["ln1"]["scale"] and not mask["layers"]["attn"]["bq"] and not mask["ln_f"]["bias"]
    mla = gpt.describe(small_cfg(**MLA).model).decay["layers"]["attn"]  # the latent projections are decayed too
    assert all(mla[k] for k in ("wq_a", "wq_b", "wkv_a", "wkv_b", "wo"))
    assert not mla["q_a_norm"]["scale"] and not mla["kv_a_norm"]["scale"]


@pytest.mark.parametrize("q_lora_rank, interleave", [(0, False), (12, False), (12, True)])
def test_latent_attention_matches_transformers_deepseek_v3(q_lora_rank, interleave):
    """Multi-head latent attention against transformers' DeepseekV3Attention (eager, float32) with the same random
    weights and norm scales; with a query latent (q_a_proj, q_a_layernorm, q_b_proj) and without (q_proj, as
    DeepSeek-V2-Lite and Moonlight).  jaxllm's rotary is the half-split layout; DeepSeek's checkpoints pair
    neighbours (``rope_interleave``, transformers' default): their rotary rows of the query and kv_a projections
    are ours with rotary dimension ``j`` at ``2j`` for ``j < dr/2``, else at ``2(j - dr/2) + 1``."""
    import torch
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

    m = small_cfg(**{**MLA, "q_lora_rank": q_lora_rank, "init_std": 0.3, "norm_eps": 1e-6}).model
    ops = gpt.Ops(attention=gpt.PlainAttention(attention.implementation(m)))
    ours = layers.LatentAttention(m, nnx.Rngs(0), ops)
    for norm in (n for n in (getattr(ours, "q_a_norm", None), ours.kv_a_norm) if n is not None):
        norm.scale[...] = 1 + 0.5 * jax.random.normal(jax.random.key(norm.scale.shape[0]), norm.scale.shape)
    hf_cfg = DeepseekV3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
                              q_lora_rank=q_lora_rank or None, kv_lora_rank=16, qk_nope_head_dim=8,
                              qk_rope_head_dim=4, v_head_dim=6, rope_interleave=interleave, rms_norm_eps=1e-6,
                              attention_bias=False, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    hf_cfg._attn_implementation = "eager"
    theirs = hf.DeepseekV3Attention(hf_cfg, 0).float()
    order = np.argsort([0, 2, 1, 3] if interleave else [0, 1, 2, 3])  # where each of dr = 4 rotary columns goes

    def as_linear(w):  # [in, ..., out]: columns ..., the last 4 of each rotary, in HF's order -> torch [out, in]
        w = np.asarray(w)
        return torch.tensor(np.concatenate([w[..., :-4], w[..., -4:][..., order]], -1).reshape(w.shape[0], -1).T)

    weights = {"kv_a_proj_with_mqa.weight": as_linear(ours.wkv_a),
               "kv_b_proj.weight": torch.tensor(np.asarray(ours.wkv_b).reshape(16, -1).T.copy()),
               "kv_a_layernorm.weight": torch.tensor(np.asarray(ours.kv_a_norm.scale[...])),
               "o_proj.weight": torch.tensor(np.asarray(ours.wo).reshape(-1, 64).T.copy())}
    if q_lora_rank:
        weights.update({"q_a_proj.weight": torch.tensor(np.asarray(ours.wq_a).T.copy()),
                        "q_b_proj.weight": as_linear(ours.wq_b),
                        "q_a_layernorm.weight": torch.tensor(np.asarray(ours.q_a_norm.scale[...]))})
    else:
        weights["q_proj.weight"] = as_linear(ours.wq)
    assert theirs.load_state_dict(weights, strict=True)
    x = jax.random.normal(jax.random.key(1), (2, 16, 64))
    positions = jnp.broadcast_to(jnp.arange(16), (2, 16))
    got, _ = ours(x, positions)
    cos_sin = hf.DeepseekV3RotaryEmbedding(hf_cfg)(torch.zeros(1), torch.arange(16)[None].expand(2, 16))
    mask = torch.triu(torch.full((16, 16), float("-inf")), 1)[None, None]
    with torch.no_grad():
        want, _ = theirs(torch.tensor(np.asarray(x)), cos_sin, mask)
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-4, atol=1e-5)
    assert np.abs(want.numpy()).mean() > 0.1  # not a comparison of near-zeros


def _gpt3_sizes():
    spec = importlib.util.spec_from_file_location("gpt3", ROOT / "configs" / "gpt3.py")
    gpt3 = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpt3)
    return gpt3


@pytest.mark.parametrize("key", list(_gpt3_sizes().SIZES))
def test_gpt3_parameter_counts(key):
    cfg = resolve(_gpt3_sizes().get_config(key), num_devices=1, vocab_size=50257)
    n = gpt.num_params(gpt.describe(cfg.model).params)
    layers, h, _ = _gpt3_sizes().SIZES[key]
    expected = 12 * layers * h * h + cfg.model.padded_vocab_size * h
    assert abs(n - expected) / expected < 0.03, (key, n, expected)


@pytest.mark.parametrize("overrides", [{"num_kv_heads": 2}, MLA], ids=["gqa", "mla"])
def test_pallas_attention_gives_the_xla_loss(overrides):
    """The whole model with model.attention_impl=pallas (interpreted on CPU) against xla, float32; with multi-head
    latent attention the kernel takes its values (6 wide) padded to the queries' 12."""
    losses = []
    for impl in ("xla", "pallas"):
        cfg = small_cfg(attention_impl=impl, **overrides)
        graphdef = gpt.describe(cfg.model).graphdef
        params = gpt.init(cfg.model, 0)
        tokens = jax.random.randint(jax.random.key(1), (2, 32), 0, 97)
        losses.append(loss_and_grads(graphdef, params, tokens))
    np.testing.assert_allclose(losses[1][0], losses[0][0], rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5), losses[1][1], losses[0][1])


POLICIES = config.choices("model.remat")


@pytest.mark.parametrize("layer_loop, overrides, policies", [
    ("scan", VARIANTS[1], POLICIES), ("scan", MLA, ("full", "minimal", "save_qkv_proj"))], ids=["llama", "mla"])
def test_every_remat_policy_gives_the_same_loss_and_gradients(layer_loop, overrides, policies):
    """Every ``model.remat`` policy (offloaded ones included: the CPU has pinned host memory) against no
    remat, llama-style (the swiglu gate too), and those that keep projections by name with multi-head latent
    attention (its latents named as the projections), the layers scanned (as on GPUs; written out, remat is
    checked by test_loss_matches_plain_jax_reference)."""
    tokens = jax.random.randint(jax.random.key(1), (4, 32), 0, 97)
    ref_cfg = small_cfg(layer_loop=layer_loop, **overrides)
    params = gpt.init(ref_cfg.model, 0)
    ref_loss, ref_grads = loss_and_grads(gpt.describe(ref_cfg.model).graphdef, params, tokens)
    for remat in policies:
        cfg = small_cfg(layer_loop=layer_loop, remat=remat, **overrides)
        graphdef = gpt.describe(cfg.model).graphdef
        loss, grads = jax.jit(lambda p, t, g=graphdef: loss_and_grads(g, p, t))(params, tokens)
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-6, err_msg=remat)
        for (path, g), want in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref_grads)):
            np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-7, err_msg=f"{remat} {path}")


@pytest.mark.parametrize("remat, kept", [
    ("full", set()),
    ("save_qkv_proj", {"query_proj", "key_proj", "value_proj"}),
    ("save_dots_except_mlp", {"query_proj", "key_proj", "value_proj", "out_proj"}),
    ("minimal", {"query_proj", "key_proj", "value_proj", "out_proj", "mlpwi", "mlpwi_gate"}),
    ("minimal_with_context", {"query_proj", "key_proj", "value_proj", "out_proj", "mlpwi", "mlpwi_gate", "context"}),
])
def test_remat_policies_keep_their_named_activations(remat, kept):
    """What each named policy keeps for the backward pass, read off JAX's own list of saved residuals
    (``mlpwo`` is allowed but never kept: only its sum with the residual stream is needed, the layer's
    output)."""
    assert set(re.findall(r"named '(\w+)'", saved_residuals(remat, "unrolled"))) == kept


def saved_residuals(remat, layer_loop):
    """JAX's list of what the small model's loss keeps for its backward pass, one line per array."""
    cfg = small_cfg(remat=remat, layer_loop=layer_loop, **VARIANTS[1])
    spec = gpt.describe(cfg.model)
    tokens = jnp.zeros((2, 32), jnp.int32)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        jax.ad_checkpoint.print_saved_residuals(lambda p: gpt.loss(spec.graphdef, p, tokens, tokens),
                                                gpt.init(cfg.model, 0))
    return out.getvalue()


def test_offload_keeps_the_layer_inputs_in_host_memory():
    """``model.remat=offload``: the layers' stacked inputs ``[layers, batch, seq, embed]`` are kept in host
    memory and nothing else of the layers is kept, where ``full`` keeps the same array on the device."""
    stacked = "[2,2,32,64] output of scan"  # 2 layers of [2, 32, 64]
    full, offload = saved_residuals("full", "scan"), saved_residuals("offload", "scan")
    assert f"f32{stacked}" in full and "<host>" not in full
    assert f"f32<host>{stacked}" in offload and f"f32{stacked}" not in offload
    assert offload.replace("f32<host>", "f32") == full


@pytest.mark.parametrize("remat", ["none", "full"])
def test_mlp_chunks_give_the_same_loss_and_gradients_in_less_memory(remat):
    """``model.mlp_chunks=4``: the MLP over 4 strided chunks of the sequence, each recomputed, against the
    whole MLP (float32, swiglu); and the compiled step's temporaries shrink, as only one chunk's
    ``[batch, seq / 4, ffn]`` intermediates are live (the model's widest buffers here: ffn 1024 = 16 x embed)."""
    tokens = jax.random.randint(jax.random.key(1), (4, 256), 0, 97)
    results = {}
    for chunks in (1, 4):
        cfg = small_cfg(remat=remat, layer_loop="scan", mlp_chunks=chunks, ffn_hidden_size=1024,
                        train={"seq_length": 256}, **VARIANTS[1])
        graphdef = gpt.describe(cfg.model).graphdef
        step = jax.jit(lambda p, t, g=graphdef: loss_and_grads(g, p, t))
        params = gpt.init(cfg.model, 0)
        results[chunks] = (step(params, tokens), step.lower(params, tokens).compile().memory_analysis())
    (loss, grads), memory = results[4]
    (ref_loss, ref_grads), ref_memory = results[1]
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    for (path, g), want in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-7, err_msg=str(path))
    assert memory.temp_size_in_bytes < 0.6 * ref_memory.temp_size_in_bytes, (memory, ref_memory)


@pytest.mark.parametrize("extra", [dict(qk_layernorm=True), dict(multi_latent_attention=True, kv_lora_rank=8,
                                                                 q_lora_rank=8, qk_head_dim=8, qk_pos_emb_head_dim=4,
                                                                 v_head_dim=8)])
def test_cast_layers_keeps_the_norms_float32(extra):
    """A bfloat16 step casts the layers' weights once (gpt.cast_layers), but not what the model reads in float32:
    every norm's scale (Qwen3's per-head query/key norms and MLA's latent norms included)."""
    c = config.get_config()
    c.model.update(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, dtype="bfloat16",
                   **llama.PRESET, **extra)
    m = resolve(c, num_devices=1).model
    cast = gpt.cast_layers(m, gpt.init(m, 0))
    leaves = {jax.tree_util.keystr(p): v.dtype for p, v in jax.tree_util.tree_flatten_with_path(cast["layers"])[0]}
    norms = {k for k in leaves if "norm" in k or "ln" in k}
    assert len(norms) == 4 and all(leaves[k] == jnp.float32 for k in norms), leaves  # ln1, ln2 and two more
    assert all(v == jnp.bfloat16 for k, v in leaves.items() if k not in norms), leaves
