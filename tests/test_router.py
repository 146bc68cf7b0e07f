"""The router's options (Megatron-LM's names): softmax or sigmoid scores, the softmax before the top k, the
weights' scaling factor and group-limited routing, checked against megatron-core's own routing function
(``topk_routing_with_score_function``, torch on the CPU) and its load-balancing loss; DeepSeek-V3's router
(sigmoid, group-limited, scaled, with expert bias) trains on 8 fake CPU devices (expert 4 x data 2; expert 2 x
pipeline 2 x data 2 under 1f1b) as on one; the expert bias keeps the loads nearer balance with no auxiliary loss.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import run_python
from harness import assert_same_training, run_layouts
from megatron.core.transformer.moe import moe_utils

from jaxllm import config
from jaxllm.config import ConfigError
from jaxllm.families import llama
from jaxllm.formats import hf
from jaxllm.model import moe
from jaxllm.resolve import resolve
from jaxllm.runtime import step

OPTIONS = {
    "softmax": {},
    "pre_softmax": {"pre_softmax": True},
    "sigmoid": {"score_function": "sigmoid"},
    "sigmoid_scaled": {"score_function": "sigmoid", "scaling_factor": 2.5},
    "softmax_groups": {"num_groups": 4, "group_topk": 2},
    "sigmoid_groups_scaled": {"score_function": "sigmoid", "num_groups": 4, "group_topk": 2, "scaling_factor": 2.5},
}


def _megatron(logits, topk, score_function="softmax", pre_softmax=False, scaling_factor=0.0, num_groups=0,
              group_topk=0):
    probs, routing_map = moe_utils.topk_routing_with_score_function(
        torch.from_numpy(logits), topk, use_pre_softmax=pre_softmax, num_groups=num_groups or None,
        group_topk=group_topk or None, scaling_factor=scaling_factor or None, score_function=score_function)
    return probs.numpy(), routing_map.numpy()


@pytest.mark.parametrize("name", OPTIONS)
def test_routing_is_megatrons(name):
    """The combine weights of every (token, expert) and the routing map of 64 tokens over 16 experts, top 4."""
    options = OPTIONS[name]
    logits = np.asarray(jax.random.normal(jax.random.key(7), (64, 16)), np.float32) * 2
    ids, weights, stats = moe.route(jnp.asarray(logits)[None], 4, **options)
    got = np.zeros((64, 16), np.float32)
    np.put_along_axis(got, np.asarray(ids[0]), np.asarray(weights[0]), -1)
    want, routing_map = _megatron(logits, 4, **options)
    np.testing.assert_array_equal(got > 0, routing_map)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)

    # the load-balancing loss: Megatron's switch_load_balancing_loss_func over its scores for the aux loss
    aux_map, scores = moe_utils.compute_routing_scores_for_aux_loss(torch.from_numpy(logits), 4,
                                                                    options.get("score_function", "softmax"))
    aux = moe_utils.switch_load_balancing_loss_func(scores, aux_map.sum(0), 64, 4, 16, 1.0)
    np.testing.assert_allclose(stats["aux_loss"], aux.item(), rtol=1e-5)


def test_groups_limit_each_token_to_its_best_groups():
    """Group 0 holds the largest single score, but groups 2 and 3 the largest top-2 sums: the token's 4 experts
    come from groups 2 and 3 only."""
    logits = np.full((1, 1, 16), -4.0, np.float32)
    logits[0, 0, 0] = 5.0  # group 0: 5 + (-4)
    logits[0, 0, 8:10] = 3.0  # group 2: 3 + 3
    logits[0, 0, 12:14] = 2.0  # group 3: 2 + 2
    ids, _, _ = moe.route(jnp.asarray(logits), 4, num_groups=4, group_topk=2)
    assert sorted(np.asarray(ids).ravel().tolist()) == [8, 9, 12, 13]


@pytest.mark.parametrize("model,key", [
    ({"moe_router_num_groups": 4}, "model.moe_router_group_topk"),
    ({"moe_router_num_groups": 3, "moe_router_group_topk": 1}, "model.moe_router_group_topk"),  # 4 experts
    ({"moe_router_num_groups": 2, "moe_router_group_topk": 2, "moe_router_topk": 3}, "model.moe_router_group_topk"),
    ({"moe_router_pre_softmax": True, "moe_router_score_function": "sigmoid"}, "model.moe_router_pre_softmax"),
])
def test_inconsistent_router_options_are_refused(model, key):
    c = config.get_config()
    c.model.update(**{"num_experts": 4, "hidden_size": 32, "num_attention_heads": 4, "vocab_size": 64, **model})
    with pytest.raises(ConfigError) as e:
        resolve(c, num_devices=1, data_files=False)
    assert e.value.key == key


def test_mixtral_export_needs_its_router():
    c = config.get_config()
    c.model.update(num_experts=4, hidden_size=32, num_attention_heads=4, vocab_size=64, **llama.PRESET,
                   moe_router_score_function="sigmoid")
    with pytest.raises(hf.ConvertError) as e:
        hf.hf_architecture(resolve(c, num_devices=1, data_files=False).model)
    assert "model.moe_router_score_function" in str(e.value)


# DeepSeek-V3's router (sigmoid, group-limited, scaled, expert bias), a fast bias for three steps
DEEPSEEK_ROUTER = {"num_experts": 8, "moe_router_topk": 4, "moe_router_score_function": "sigmoid",
                   "moe_router_topk_scaling_factor": 2.5, "moe_router_num_groups": 4, "moe_router_group_topk": 2,
                   "moe_aux_loss_coeff": 0.01, "moe_router_enable_expert_bias": True,
                   "moe_router_bias_update_rate": 0.01}


@pytest.mark.slow
def test_deepseek_router_trains_as_on_one_device():
    """The expert biases too: each layout's summed loads give the single device's bias steps."""
    layouts = {name: {"mesh": mesh, "train": {"micro_batch_size": micro}, "model": DEEPSEEK_ROUTER,
                      "parallel": parallel}
               for name, mesh, micro, parallel in (
                   ("single", {}, 8, {}), ("expert4_data2", {"expert": 4, "data": 2}, 1, {}),
                   ("expert2_pipeline2_data2_1f1b", {"expert": 2, "pipeline": 2, "data": 2}, 2,
                    {"pipeline_schedule": "1f1b"}))}
    results = run_layouts(layouts, timeout=900)
    biases = [v for k, v in results["single"]["params"].items() if "expert_bias" in k]
    assert len(biases) == 1 and np.abs(biases[0]).max() > 0  # [layers, experts], moved
    for name in ("expert4_data2", "expert2_pipeline2_data2_1f1b"):
        assert_same_training(results[name], results["single"])


@pytest.mark.parametrize("groups", [{}, {"num_groups": 4, "group_topk": 2}])
def test_expert_bias_picks_as_megatrons_and_weighs_unbiased(groups):
    logits = np.asarray(jax.random.normal(jax.random.key(8), (64, 16)), np.float32)
    bias = np.asarray(jax.random.normal(jax.random.key(9), (16,)), np.float32) * 0.3
    ids, weights, _ = moe.route(jnp.asarray(logits)[None], 4, score_function="sigmoid", bias=jnp.asarray(bias),
                                **groups)
    got = np.zeros((64, 16), np.float32)
    np.put_along_axis(got, np.asarray(ids[0]), np.asarray(weights[0]), -1)
    want, routing_map = moe_utils.topk_routing_with_score_function(
        torch.from_numpy(logits), 4, num_groups=groups.get("num_groups"), group_topk=groups.get("group_topk"),
        score_function="sigmoid", expert_bias=torch.from_numpy(bias))
    np.testing.assert_array_equal(got > 0, routing_map.numpy())
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-6, atol=1e-7)


def test_expert_bias_update_is_megatrons():
    """The loads reach the bias as its gradient (load - mean, summed like any gradient), and the step moves it as
    megatron-core's get_updated_expert_bias does (its formula after the all-reduce of the loads, which needs
    torch.distributed's groups: ``bias + sign(mean - tokens) x rate``)."""
    loads = [np.asarray([3.0, 9.0, 0.0, 4.0]), np.asarray([5.0, 1.0, 2.0, 4.0])]  # two micro batches
    bias = jnp.asarray([0.1, -0.2, 0.0, 0.05])
    grad = sum(jax.grad(lambda b, load=load: moe.balance_bias(jnp.ones(3), b, jnp.asarray(load)).sum())(bias)
               for load in loads)
    params, grads = step._balanced({"layers": {"mlp": {"expert_bias": bias, "router": jnp.ones(2)}}},
                                   {"layers": {"mlp": {"expert_bias": grad, "router": jnp.full(2, 7.0)}}}, 1e-3)
    tokens = sum(loads)
    want = np.asarray(bias) + np.sign(tokens.mean() - tokens) * 1e-3
    np.testing.assert_allclose(params["layers"]["mlp"]["expert_bias"], want, rtol=1e-6)
    np.testing.assert_array_equal(grads["layers"]["mlp"]["expert_bias"], 0)  # the optimizer leaves it
    np.testing.assert_array_equal(grads["layers"]["mlp"]["router"], 7.0)
    np.testing.assert_array_equal(params["layers"]["mlp"]["router"], 1.0)


@pytest.mark.slow
def test_expert_bias_balances_without_an_auxiliary_loss(tmp_path):
    """configs/moe.py:tiny on 8 devices (expert 4 x data 2), sigmoid router, no auxiliary or z loss, 100 steps: without
    the bias the busiest expert drifts to about twice the mean load (measured 1.99 over the last 5 logged steps);
    with it (rate 0.01) the loads stay nearer balance (1.49)."""
    late = {}
    for bias in (True, False):
        workdir = tmp_path / str(bias)
        run_python("-m", "jaxllm.train", "--config=configs/moe.py:tiny", f"--workdir={workdir}",
                   "--config.mesh.expert=4", "--config.mesh.data=2", "--config.train.micro_batch_size=1",
                   "--config.model.moe_router_score_function=sigmoid",
                   f"--config.model.moe_router_enable_expert_bias={bias}",
                   "--config.model.moe_router_bias_update_rate=0.01", "--config.model.moe_aux_loss_coeff=0",
                   "--config.model.moe_z_loss_coeff=0", "--config.train.train_iters=100",
                   "--config.train.log_interval=10", "--config.train.eval_interval=1000", "--config.log.samples=0",
                   env={**os.environ, "JAX_PLATFORMS": "cpu",
                        "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}, timeout=600)
        rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
        late[bias] = np.mean([r["moe_max_load"] for r in rows if r["kind"] == "train"][-5:])
    assert late[True] < 0.85 * late[False], late


@pytest.mark.parametrize("model,mesh", [
    ({"moe_router_enable_expert_bias": True}, {}),  # softmax scores
    ({"moe_router_enable_expert_bias": True, "moe_router_score_function": "sigmoid"}, {"pipeline": 2}),  # gpipe
])
def test_expert_bias_is_refused_where_it_cannot_work(model, mesh):
    c = config.get_config()
    c.model.update(**{"num_experts": 4, "hidden_size": 32, "num_attention_heads": 4, "vocab_size": 64, **model})
    c.mesh.update(**mesh)
    c.train.update(micro_batch_size=1, global_batch_size=2)
    with pytest.raises(ConfigError) as e:
        resolve(c, num_devices=2 if mesh else 1, data_files=False)
    assert e.value.key == "model.moe_router_enable_expert_bias"
