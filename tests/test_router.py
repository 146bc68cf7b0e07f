"""The router's options (Megatron-LM's names): softmax or sigmoid scores, the softmax before the top k, the
weights' scaling factor and group-limited routing, checked against megatron-core's own routing function
(``topk_routing_with_score_function``, torch on the CPU) and its load-balancing loss; a model routed that way
trains on 8 fake CPU devices (expert 4 x data 2) as on one.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from harness import assert_same_training, run_layouts
from megatron.core.transformer.moe import moe_utils

from jaxllm import config
from jaxllm.config import ConfigError
from jaxllm.model import hf, moe
from jaxllm.resolve import resolve

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
    c.model.update(num_experts=4, hidden_size=32, num_attention_heads=4, vocab_size=64, activation="swiglu",
                   use_bias=False, norm="rmsnorm", position_embedding="rotary", moe_router_score_function="sigmoid")
    with pytest.raises(hf.ConvertError) as e:
        hf.hf_architecture(resolve(c, num_devices=1, data_files=False).model)
    assert "model.moe_router_score_function" in str(e.value)


DEEPSEEK_ROUTER = {"num_experts": 8, "moe_router_topk": 4, "moe_router_score_function": "sigmoid",
                   "moe_router_topk_scaling_factor": 2.5, "moe_router_num_groups": 4, "moe_router_group_topk": 2,
                   "moe_aux_loss_coeff": 0.01}


@pytest.mark.slow
def test_sigmoid_group_limited_router_trains_as_on_one_device():
    layouts = {name: {"mesh": mesh, "train": {"micro_batch_size": micro}, "model": DEEPSEEK_ROUTER}
               for name, mesh, micro in (("single", {}, 8), ("expert4_data2", {"expert": 4, "data": 2}, 1))}
    results = run_layouts(layouts, timeout=900)
    assert_same_training(results["expert4_data2"], results["single"])
