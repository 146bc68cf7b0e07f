"""Layer groups (jaxllm.model.gpt.layer_groups): dense and mixture-of-experts layers in one stack, placed by
``model.moe_layer_freq`` (Megatron-LM's ``--moe-layer-freq``).

A stack of 2 dense layers then 2 MoE layers (with Qwen3-MoE's attention) trains on 8 fake CPU devices (expert x
data x tensor, and pipeline x data x expert under the fused 1F1B loop and GPipe's forward loop) as on one device,
float32, three steps with dropout (tests/multidevice.py); the grouped scan equals the layers applied one by one;
parameter count, active parameters and FLOPs equal a count by hand; bad patterns are refused with the key.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from harness import assert_same_training, run_layouts

from jaxllm import config
from jaxllm.config import ConfigError, moe_layer_pattern
from jaxllm.families import llama, qwen3_moe
from jaxllm.formats import hf
from jaxllm.model import gpt, layers
from jaxllm.resolve import resolve
from jaxllm.runtime import flops

MOE = {"num_experts": 4, "moe_router_topk": 2, "moe_aux_loss_coeff": 0.01, "moe_z_loss_coeff": 0.001,
       "num_layers": 4, "moe_layer_freq": "([0]*2+[1]*2)"}


def layout(mesh, micro, **parallel):
    """2 micro batches of 8 rows per step: ``micro`` rows per data-parallel replica; dropout on (each layer's keys
    follow it into its group and pipeline stage); Qwen3-MoE's attention: an RMSNorm of each head's queries and keys
    (a LayerNorm's bias on the keys would shift every score of a query alike: no gradient, only rounding noise that
    Adam scales up), heads of 32 where hidden / heads is 16 (model.kv_channels)."""
    return {"mesh": mesh, "parallel": parallel, "train": {"micro_batch_size": micro},
            "model": {**MOE, "dropout": 0.1, "norm": "rmsnorm", "qk_layernorm": True, "kv_channels": 32}}


LAYOUTS = {
    "single": layout({}, 8),
    "expert2_data2_tensor2": layout({"expert": 2, "data": 2, "tensor": 2}, 2),
    "pipeline2_data2_expert2_1f1b": layout({"pipeline": 2, "data": 2, "expert": 2}, 2, pipeline_schedule="1f1b"),
    "pipeline2_data2_expert2_gpipe": layout({"pipeline": 2, "data": 2, "expert": 2}, 2),
}


@pytest.fixture(scope="module")
def results():
    return run_layouts(LAYOUTS, timeout=900)


@pytest.mark.parametrize("name", [n for n in LAYOUTS if n != "single"])
def test_dense_then_moe_layers_train_as_on_one_device(results, name):
    got, ref = results[name], results["single"]
    assert_same_training(got, ref)
    assert {k.split("]")[0] for k in ref["params"]} == {"['layers_0'", "['layers_1'", "['ln_f'", "['wpe'", "['wte'"}
    for g, r in zip(got["moe"], ref["moe"], strict=True):  # the MoE layers' routing statistics of each step
        assert g.keys() == r.keys() == set(gpt.MOE_STATS)
        for k in r:
            np.testing.assert_allclose(g[k], r[k], rtol=1e-5, atol=1e-7, err_msg=k)


def _resolved(**model):
    c = config.get_config()
    c.model.update(**{"hidden_size": 32, "num_attention_heads": 4, "vocab_size": 64, "dtype": "float32", **model})
    c.train.update(seq_length=16, micro_batch_size=2, global_batch_size=2)
    return resolve(c, num_devices=1, vocab_size=c.model.vocab_size)


@pytest.mark.parametrize("freq,kinds", [("([0]*2+[1]*2)", [False, False, True, True]),
                                        ("2", [True, False, True, False])])
@pytest.mark.parametrize("loop", ["scan", "unrolled"])
def test_groups_run_the_layers_in_order(freq, kinds, loop):
    """The loss (with dropout) equals the embedding, each layer as its own Block with its slice of its group's
    parameters and its row keys, then the output loss."""
    cfg = _resolved(**{**MOE, "moe_layer_freq": freq, "dropout": 0.1, "layer_loop": loop}).model
    assert [g.kind.moe for g in gpt.layer_groups(cfg) for _ in range(g.num_layers)] == kinds
    spec, params = gpt.describe(cfg), gpt.init(cfg, 0)
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, 64)
    key = jax.random.key(2)
    got, stats = gpt.loss(spec.graphdef, params, tokens, tokens, dropout_key=key, with_stats=True)

    model = nnx.merge(spec.graphdef, params)
    x, keys = model.embed(tokens, jnp.broadcast_to(jnp.arange(16), (2, 16)), key)
    positions, aux = jnp.broadcast_to(jnp.arange(16), (2, 16)), []
    for group in gpt.layer_groups(cfg):
        for i in range(group.num_layers):
            block = nnx.eval_shape(lambda g=group: layers.Block(cfg, nnx.Rngs(0), model.ops, kind=g.kind))
            block = nnx.merge(nnx.graphdef(block), jax.tree.map(lambda a, i=i: a[i], params[group.name]))
            x, out = block(x, positions, keys[group.first + i])
            aux += [out["aux_loss"]] if group.kind.moe else []
    want = model.output_loss(x, tokens)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    np.testing.assert_allclose(stats["moe_aux_loss"], np.mean(aux), rtol=1e-6)


def test_parameters_and_flops_equal_a_count_by_hand():
    """2 dense then 2 MoE layers, SwiGLU, grouped-query attention, a shared expert, untied embeddings."""
    h, n, kv, f, fm, fs, E, k, V, L, s = 64, 4, 2, 96, 32, 48, 4, 2, 256, 4, 16
    cfg = _resolved(num_layers=L, hidden_size=h, num_attention_heads=n, num_kv_heads=kv, ffn_hidden_size=f,
                    moe_ffn_hidden_size=fm, moe_shared_expert_intermediate_size=fs, num_experts=E, moe_router_topk=k,
                    **llama.PRESET, tie_embeddings=False, vocab_size=V, make_vocab_size_divisible_by=1,
                    moe_layer_freq="[0,0,1,1]")
    d = h // n
    attention = h * n * d * 2 + h * kv * d * 2 + 2 * h  # wq, wo; wk, wv; the two norms
    dense, shared, experts = 3 * h * f, 3 * h * fs, E * 3 * h * fm
    total = 2 * V * h + h + L * attention + 2 * dense + 2 * (h * E + experts + shared)
    params = gpt.init(cfg.model, 0)
    assert gpt.num_params(params) == total
    assert gpt.active_params(cfg.model, params) == total - 2 * experts * (E - k) // E

    mlp_dense = 2 * h * f * 2 + 2 * f * h
    mlp_moe = k * (2 * h * fm * 2 + 2 * fm * h) + 2 * h * fs * 2 + 2 * fs * h + 2 * h * E
    forward = L * (2 * h * (n + 2 * kv) * d + 2 * s * n * d + 2 * n * d * h) + 2 * mlp_dense + 2 * mlp_moe
    assert math.isclose(flops.flops_per_token(cfg.model, s), 3 * forward + 3 * 2 * h * V, rel_tol=1e-12)
    assert math.isclose(flops.flops_per_token(cfg.model, s, recompute=True), 4 * forward + 3 * 2 * h * V,
                        rel_tol=1e-12)


@pytest.mark.parametrize("text,want", [
    ("1", [1, 1, 1, 1]), ("3", [1, 0, 0, 1]), ("[0,1,0,1]", [0, 1, 0, 1]), ("([0]*3+[1]*1)", [0, 0, 0, 1]),
    ("[1]*4", [1, 1, 1, 1]), ("0", None), ("[0,1]", None), ("[0,2,0,1]", None), ("__import__('os')", None),
    ("([0]*3+[1])", [0, 0, 0, 1])])
def test_moe_layer_freq_reads_megatrons_forms(text, want):
    got = moe_layer_pattern(text, 4)
    assert (None if got is None else [int(x) for x in got]) == want


@pytest.mark.parametrize("model,mesh,key", [
    ({**MOE, "moe_layer_freq": "[0,1]"}, {}, "model.moe_layer_freq"),  # 2 entries for 4 layers
    ({**MOE, "moe_layer_freq": "[0,0,0,0]"}, {}, "model.moe_layer_freq"),  # no MoE layer
    ({"moe_layer_freq": "2"}, {}, "model.moe_layer_freq"),  # no experts
    ({**MOE, "moe_layer_freq": "[1,1,0,0]"}, {"pipeline": 2}, "model.moe_layer_freq"),  # MoE before the pipelined group
    ({**MOE, "moe_layer_freq": "[0,0,0,1]"}, {"pipeline": 2}, "model.moe_layer_freq"),  # 1 pipelined layer, 2 stages
    ({**MOE, "num_layers": 3, "moe_layer_freq": "[0,1,1]"}, {"pipeline": 2}, "model.moe_layer_freq"),  # 1 dense layer
])
def test_bad_patterns_are_refused_with_the_key(model, mesh, key):
    c = config.get_config()
    c.model.update(hidden_size=32, num_attention_heads=4, vocab_size=64, **model)
    c.mesh.update(**mesh)
    c.train.update(seq_length=16, micro_batch_size=1, global_batch_size=2)
    with pytest.raises(ConfigError) as e:
        resolve(c, num_devices=math.prod(mesh.values()) if mesh else 1, data_files=False)
    assert e.value.key.split(" ")[0] == key


def test_mixed_stack_exports_as_qwen3_moe():
    """Mixtral makes every layer a mixture of experts, Qwen3-MoE may keep some dense (mlp_only_layers): a mixed stack
    of Llama's layer is refused on export, naming the key for each; with Qwen3's query/key norms it is Qwen3-MoE."""
    llama_moe = dict(MOE, **llama.PRESET)
    with pytest.raises(hf.ConvertError) as e:
        hf.hf_architecture(_resolved(**llama_moe).model)
    assert "for MixtralForCausalLM change model.moe_layer_freq=" in str(e.value)
    assert "for Qwen3MoeForCausalLM change model.qk_layernorm=False (needs True)" in str(e.value)
    assert hf.hf_architecture(_resolved(**llama_moe, qk_layernorm=True).model) is qwen3_moe.QWEN3_MOE
