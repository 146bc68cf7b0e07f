"""Multi-token prediction (``model.mtp_num_layers``; DeepSeek-V3 section 2.2, Megatron-LM's
``multi_token_prediction.py``): its objective against the formula written out with jax.numpy, its FLOPs, its
refusals, and a model with it training as one without (its layouts: tests/test_sharding.py, tests/test_pipeline.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_model import VARIANTS, reference_hidden, reference_layer, reference_norm, reference_output
from test_train import read_metrics, tiny_shakespeare

from jaxllm import config, train
from jaxllm.model import gpt
from jaxllm.resolve import resolve
from jaxllm.runtime import flops, step


def small_cfg(**model):
    c = config.get_config()
    c.model.update(**{"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "dtype": "float32",
                      "vocab_size": 97, **model})
    c.train.update(seq_length=32, micro_batch_size=4, global_batch_size=4)
    return resolve(c, num_devices=1)


def roll(a, k):
    """Megatron-LM's ``roll_tensor`` applied ``k`` times: ``a`` moved ``k`` places left, the last ``k`` zero."""
    return jnp.concatenate([a[:, k:], jnp.zeros_like(a[:, :k])], axis=1)


def reference_objective(cfg, p, tokens, targets, mask):
    """Main mean loss + scaling / N x the depths' means, and their mean, written out: depth k embeds the token k
    ahead (at its position k ahead), joins [enorm(embedding); hnorm(h)] through eh_proj, one layer, its own norm,
    the shared output layer predicting the target k ahead under the loss mask rolled k places."""
    m = cfg.model
    ce = lambda x, y: optax.softmax_cross_entropy_with_integer_labels(reference_output(cfg, p, x), y)  # noqa: E731
    h = reference_norm(m, reference_hidden(cfg, p, tokens), p["ln_f"])
    main = jnp.sum(ce(h, targets) * mask) / jnp.sum(mask)
    depths = []
    for k in range(1, m.mtp_num_layers + 1):
        P = jax.tree.map(lambda a, k=k: a[k - 1], p["mtp"])
        e = p["wte"][roll(tokens, k)]
        if m.position_embedding == "learned":
            e = e + p["wpe"][roll(jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape), k)]
        joined = jnp.concatenate([reference_norm(m, e, P["enorm"]), reference_norm(m, h, P["hnorm"])], -1)
        x = joined @ jnp.concatenate([P["eh_proj"][0], P["eh_proj"][1]], 0)  # Megatron's eh_proj [2h, h]
        h = reference_norm(m, reference_layer(m, P["block"], x), P["norm"])
        depths.append(jnp.sum(ce(h, roll(targets, k)) * roll(mask, k)) / jnp.sum(roll(mask, k)))
    mtp = jnp.mean(jnp.stack(depths))
    return main + m.mtp_loss_scaling_factor * mtp, mtp


@pytest.mark.parametrize(("overrides", "masked"), zip((VARIANTS[0], dict(VARIANTS[1], remat="full")), (False, True)),
                         ids=["gpt2-style-all-tokens", "llama-style-loss-mask-remat"])
def test_objective_and_gradients_match_the_formula(overrides, masked):
    """Two depths, scaling 0.3: the train step's micro batch objective (main loss + mtp) and the logged mtp_loss
    against :func:`reference_objective`, values and every parameter's gradient; with a loss mask the depths'
    counts are their rolled masks' (and the layers, the depths' too, recomputed: model.remat=full)."""
    cfg = small_cfg(mtp_num_layers=2, mtp_loss_scaling_factor=0.3, **overrides)
    spec, params = gpt.describe(cfg.model), gpt.init(cfg.model, 0)
    tokens = jax.random.randint(jax.random.key(1), (2, 32), 0, 97)
    targets = jnp.roll(tokens, -1, axis=1)
    mask = (jax.random.uniform(jax.random.key(2), tokens.shape) < 0.7 if masked else jnp.ones(tokens.shape)).astype(
        jnp.float32)
    docs = {"loss_mask": mask} if masked else {}
    count = step.counts(cfg.model, targets, docs)
    (ours, (losses, _)), grads = jax.jit(jax.value_and_grad(
        lambda p: step._micro_loss(spec.graphdef, p, tokens, targets, None, docs, None, count), has_aux=True))(params)
    (ref, ref_mtp), ref_grads = jax.jit(jax.value_and_grad(
        lambda p: reference_objective(cfg, p, tokens, targets, mask), has_aux=True))(params)
    np.testing.assert_allclose(ours, ref, rtol=1e-5)
    np.testing.assert_allclose(losses["mtp_loss"], ref_mtp, rtol=1e-5)
    assert float(ours - losses["loss"]) == pytest.approx(0.3 * float(losses["mtp_loss"]), rel=1e-5)
    assert losses["mtp_loss"] > 4.0  # near ln(97) at init: not a comparison of two constants
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), grads, ref_grads)
    assert float(jnp.abs(grads["mtp"]["eh_proj"]).max()) > 0  # the modules learn


def test_flops_count_each_depth_as_a_layer_a_projection_and_an_output_layer():
    """One depth adds, per token, 3 x (a layer of the model's kind + eh_proj's 2 x 2h x h + the output layer's
    2 x h x V): a model with one more layer and the projection and output layer written out."""
    mtp, plain, deeper = small_cfg(mtp_num_layers=1), small_cfg(), small_cfg(num_layers=3)
    h, v = 64, mtp.model.padded_vocab_size
    layer = flops.flops_per_token(deeper.model, 32) - flops.flops_per_token(plain.model, 32)
    assert flops.flops_per_token(mtp.model, 32) - flops.flops_per_token(plain.model, 32) == pytest.approx(
        layer + 3 * (2 * 2 * h * h + 2 * h * v))
    assert flops.hardware_flops_by_kind(mtp)["loss"] == pytest.approx(2 * flops.hardware_flops_by_kind(plain)["loss"])


def test_active_parameters_count_a_mixture_depths_chosen_experts():
    """A depth of a mixture of experts (4 experts, top 2, swiglu, no biases: w1, wg, w2 [4, 64, 32]) adds all its
    parameters to the count and half of its experts' to the active ones."""
    moe = dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, activation="swiglu", use_bias=False)
    plain, mtp = small_cfg(**moe), small_cfg(mtp_num_layers=1, **moe)
    p, q = gpt.describe(plain.model).params, gpt.describe(mtp.model).params
    added = gpt.num_params(q) - gpt.num_params(p)
    assert added == gpt.num_params(q["mtp"]) and q["mtp"]["block"]["mlp"]["w1"].shape == (1, 4, 64, 32)
    assert gpt.active_params(mtp.model, q) - gpt.active_params(plain.model, p) == added - 3 * 4 * 64 * 32 // 2


@pytest.mark.parametrize("overrides", [{"mesh": {"pipeline": 2}, "parallel": {"pipeline_schedule": "1f1b"}},
                                       {"mesh": {"pipeline": 2}, "model": {"num_experts": 4}},
                                       {"mesh": {"sequence": 2}, "parallel": {"sequence_impl": "ring"}}],
                         ids=["pipeline-1f1b", "pipeline-experts", "ring"])
def test_1f1b_experts_in_a_pipeline_and_ring_attention_are_refused(overrides):
    c = config.get_config()
    c.model.update(mtp_num_layers=1, vocab_size=128)
    c.train.update(micro_batch_size=1, global_batch_size=4)
    for section, values in overrides.items():
        getattr(c, section).update(**values)
    with pytest.raises(config.ConfigError, match="model.mtp_num_layers"):
        resolve(c, num_devices=2)


def test_a_model_with_one_depth_trains_as_the_model_without(tmp_path):
    """The acceptance of issue 50: tiny Shakespeare, 50 steps through the training loop with model.mtp_num_layers=1
    and without; the main loss at step 50 within 2 % of the plain model's, and the depth's loss logged and falling."""
    logged = {}
    for depths in (0, 1):
        cfg = tiny_shakespeare(50)
        cfg.model.mtp_num_layers = depths
        cfg.log.samples = 0
        train.train(cfg, str(tmp_path / str(depths)))
        logged[depths] = [m for m in read_metrics(tmp_path / str(depths)) if m["kind"] == "train"]
    plain, mtp = logged[0][-1], logged[1][-1]
    assert plain["step"] == mtp["step"] == 50
    assert mtp["loss"] == pytest.approx(plain["loss"], rel=0.02)
    assert mtp["loss"] < logged[1][0]["loss"] - 0.1 and mtp["mtp_loss"] < logged[1][0]["mtp_loss"] - 0.1
    assert "mtp_loss" not in plain
