"""Mixture of experts: the layer against a dense reference, and expert parallelism computing what one device computes.

The layer (jaxllm.model.moe, jaxllm.model.layers.MoE) is checked against every expert applied to every token in plain
jax.numpy, weighted by the softmax of the top-k logits; its losses against Megatron-LM's formulas written out.  The
layouts run on 8 fake CPU devices, float32, three steps (tests/multidevice.py), with the load-balancing and z losses
on: each layout's step has the single-device run's micro batches (2 per step), so the router's statistics are taken
over the same tokens.
"""

import functools
import json
import math
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ROOT, run_python, xla_flags
from harness import assert_same_training, run_layouts

from jaxllm import config, tune
from jaxllm.analysis import layouts
from jaxllm.config import ConfigError
from jaxllm.model import gpt, layers, moe
from jaxllm.parallel import experts
from jaxllm.resolve import resolve
from jaxllm.runtime import flops
from jaxllm_kernels import grouped_matmul as grouped_gemm
from jaxllm_kernels import lowering

MOE = {"num_experts": 4, "moe_router_topk": 2, "moe_aux_loss_coeff": 0.01, "moe_z_loss_coeff": 0.001}
SWIGLU = {**MOE, "activation": "swiglu", "use_bias": False, "moe_shared_expert_intermediate_size": 64}
A2A = {"moe_token_dispatcher_type": "alltoall"}
RAGGED = {"moe_token_dispatcher_type": "ragged"}


def layout(mesh, micro, model_extra=None, **parallel):
    """A layout with 2 micro batches of 8 rows per step: ``micro`` rows per data-parallel replica."""
    return {"mesh": mesh, "parallel": parallel, "train": {"micro_batch_size": micro},
            "model": {**MOE, **(model_extra or {})}}


LAYOUTS = {
    "single": {**layout({}, 8), "eval": True},
    "single_swiglu": layout({}, 8, SWIGLU),
    "single_capacity": layout({}, 8, {"moe_capacity_factor": 1.0}),
    "expert4_data2": {**layout({"expert": 4, "data": 2}, 1), "eval": True},
    "expert2_tensor2_data2_megatron_sp": layout({"expert": 2, "tensor": 2, "data": 2}, 2, megatron_sp=True),
    "expert2_tensor2_data2_swiglu": layout({"expert": 2, "tensor": 2, "data": 2}, 2, SWIGLU),
    "expert4_fsdp2_zero3": layout({"expert": 4, "fsdp": 2}, 1, zero_stage=3),
    "expert2_pipeline2_data2_1f1b": layout({"expert": 2, "pipeline": 2, "data": 2}, 2, pipeline_schedule="1f1b"),
    "expert2_pipeline2_data2_gpipe": {**layout({"expert": 2, "pipeline": 2, "data": 2}, 2), "eval": True},
    "expert2_pipeline2_data2_zb_h1": layout({"expert": 2, "pipeline": 2, "data": 2}, 2, pipeline_schedule="zb_h1"),
    "expert2_sequence2_data2_ring": layout({"expert": 2, "sequence": 2, "data": 2}, 2, sequence_impl="ring"),
    "expert4_data2_capacity": layout({"expert": 4, "data": 2}, 1, {"moe_capacity_factor": 1.0}),
    # the alltoall dispatcher (jaxllm.parallel.experts)
    "single_experts8": layout({}, 8, {"num_experts": 8}),
    "expert8_alltoall_experts8": layout({"expert": 8}, 1, {**A2A, "num_experts": 8}),
    "expert4_data2_alltoall": layout({"expert": 4, "data": 2}, 1, A2A),
    "expert2_tensor2_data2_alltoall": layout({"expert": 2, "tensor": 2, "data": 2}, 2, A2A),
    "expert2_pipeline2_data2_1f1b_alltoall": layout({"expert": 2, "pipeline": 2, "data": 2}, 2, A2A,
                                                    pipeline_schedule="1f1b"),
    "expert4_data2_alltoall_capacity": layout({"expert": 4, "data": 2}, 1, {**A2A, "moe_capacity_factor": 1.0}),
    # the ragged dispatcher (on CPUs the emulated jax.lax.ragged_all_to_all)
    "expert8_ragged_experts8": layout({"expert": 8}, 1, {**RAGGED, "num_experts": 8}),
    "expert4_data2_ragged": layout({"expert": 4, "data": 2}, 1, RAGGED),
    "expert2_tensor2_data2_ragged": layout({"expert": 2, "tensor": 2, "data": 2}, 2, RAGGED),
    "expert2_pipeline2_data2_1f1b_ragged": layout({"expert": 2, "pipeline": 2, "data": 2}, 2, RAGGED,
                                                  pipeline_schedule="1f1b"),
    # mesh.expert_tensor=1: whole experts over expert x tensor, each tensor device dispatching half its tokens
    "expert2_tensor2_data2_etp1": layout({"expert": 2, "tensor": 2, "data": 2, "expert_tensor": 1}, 2),
    "expert2_tensor2_data2_etp1_alltoall": layout({"expert": 2, "tensor": 2, "data": 2, "expert_tensor": 1}, 2, A2A),
}
REFERENCE = {"swiglu": "single_swiglu", "capacity": "single_capacity", "experts8": "single_experts8"}


@pytest.fixture(scope="module")
def results():
    return run_layouts(LAYOUTS, timeout=900)


@pytest.mark.parametrize("name", [n for n in LAYOUTS if not n.startswith("single")])
def test_expert_parallel_layout_matches_single_device(results, name):
    ref = results[next((r for k, r in REFERENCE.items() if name.endswith(k)), "single")]
    got = results[name]
    assert_same_training(got, ref)
    for g, r in zip(got["moe"], ref["moe"], strict=True):  # the logged routing statistics of each step
        assert g.keys() == r.keys() == set(gpt.MOE_STATS)
        for k in r:
            np.testing.assert_allclose(g[k], r[k], rtol=1e-5, atol=1e-7, err_msg=k)
    if got["eval_loss"] is not None:
        np.testing.assert_allclose(got["eval_loss"], ref["eval_loss"], rtol=1e-5)


@pytest.mark.parametrize("allgather, other", [("expert4_data2", "alltoall"), ("expert4_data2_capacity", "alltoall"),
                                              ("expert4_data2", "ragged")])
def test_alltoall_and_allgather_dispatchers_train_alike(results, allgather, other):
    """The dispatchers on the same layout: the same losses and routing statistics."""
    alltoall = results[allgather.replace("data2", f"data2_{other}")]
    np.testing.assert_allclose(alltoall["losses"], results[allgather]["losses"], rtol=1e-5)
    for a, b in zip(alltoall["moe"], results[allgather]["moe"], strict=True):
        np.testing.assert_allclose(list(a.values()), list(b.values()), rtol=1e-5, atol=1e-7)


def test_capacity_drops_tokens(results):
    """A capacity factor of 1 drops some copies of these random batches; dropless drops none."""
    assert all(m["moe_dropped"] > 0 for m in results["single_capacity"]["moe"])
    assert all(m["moe_dropped"] == 0 for m in results["single"]["moe"])


def _resolved(**extra):
    c = config.get_config()
    c.model.update(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, **{**MOE, **extra})
    c.train.update(seq_length=16, micro_batch_size=2, global_batch_size=2)
    return resolve(c, num_devices=1, vocab_size=64)


@pytest.mark.parametrize("extra", [{}, {"activation": "swiglu", "use_bias": False}])
def test_layer_matches_every_expert_on_every_token(extra):
    """jax.numpy reference: each expert on every token, weighted by the softmax over the token's top-k logits."""
    cfg = _resolved(**extra)
    p = jax.tree.map(lambda a: a[0], gpt.init(cfg.model, 0)["layers"]["mlp"])
    keys = jax.random.split(jax.random.key(1), 4)
    p = {k: (jax.random.normal(keys[i % 4], v.shape) * 0.5 if k.startswith("b") else v)  # nonzero biases
         for i, (k, v) in enumerate(p.items())}
    x = jax.random.normal(jax.random.key(2), (2, 16, 32))
    logits = x @ p["router"]
    ids, weights, _ = moe.route(logits, 2)
    y = moe.local_experts(x, ids, weights, p["w1"], p.get("wg"), p["w2"], p.get("b1"), p.get("b2"),
                          activation=layers.gelu, dtype=jnp.float32)
    top_logits, top_ids = jax.lax.top_k(logits, 2)
    gates = jax.nn.softmax(top_logits, -1)
    ref = jnp.zeros_like(x)
    for e in range(4):
        h = x @ p["w1"][e] + (p["b1"][e] if "b1" in p else 0)
        h = jax.nn.silu(x @ p["wg"][e]) * h if "wg" in p else jax.nn.gelu(h, approximate=True)
        h = h @ p["w2"][e] + (p["b2"][e] if "b2" in p else 0)
        ref = ref + (gates * (top_ids == e)).sum(-1)[..., None] * h
    np.testing.assert_allclose(y, ref, atol=1e-5)


def test_router_losses_are_megatrons():
    """switch_load_balancing_loss_func and z_loss_func of Megatron-LM's moe_utils.py, written out with numpy."""
    logits = np.asarray(jax.random.normal(jax.random.key(3), (2, 8, 4)), np.float64)
    ids, weights, stats = moe.route(jnp.asarray(logits, jnp.float32), 2)
    flat = logits.reshape(16, 4)
    probs = np.exp(flat) / np.exp(flat).sum(-1, keepdims=True)
    routing_map = np.zeros((16, 4))
    np.put_along_axis(routing_map, np.argsort(-flat, -1)[:, :2], 1, -1)
    tokens_per_expert = routing_map.sum(0)
    aux = np.sum(probs.sum(0) * tokens_per_expert) * 4 / (16 * 16 * 2)
    z = np.mean(np.log(np.exp(flat).sum(-1)) ** 2)
    np.testing.assert_allclose(stats["aux_loss"], aux, rtol=1e-6)
    np.testing.assert_allclose(stats["z_loss"], z, rtol=1e-6)
    np.testing.assert_allclose(stats["max_load"], tokens_per_expert.max() / 8, rtol=1e-6)
    top2 = np.argsort(-flat, -1)[:, :2].reshape(2, 8, 2)
    np.testing.assert_array_equal(np.sort(np.asarray(ids), -1), np.sort(top2, -1))
    np.testing.assert_allclose(weights.sum(-1), 1.0, rtol=1e-6)


def test_capacity_keeps_each_experts_most_probable_tokens():
    """Capacity 2 per expert (factor 1, 4 tokens, top-1 of 2 experts): the two highest-probability tokens stay."""
    logits = jnp.asarray([[[3.0, 0.0], [2.0, 0.0], [1.0, 0.0], [0.0, 5.0]]])  # tokens 0-2 pick expert 0
    ids, weights, stats = moe.route(logits, 1, capacity_factor=1.0)
    np.testing.assert_array_equal(ids[0, :, 0], [0, 0, 2, 1])  # token 2 (lowest probability for expert 0) dropped
    np.testing.assert_array_equal(weights[0, :, 0], [1, 1, 0, 1])
    np.testing.assert_allclose(stats["dropped"], 0.25)


def test_attached_loss_gets_its_scale_as_gradient():
    g = jax.grad(lambda x, l: (moe.attach_loss(x, l, 0.25) * 3).sum(), argnums=(0, 1))(jnp.ones(3), jnp.float32(7))
    np.testing.assert_allclose(g[0], 3.0)
    np.testing.assert_allclose(g[1], 0.25)


@pytest.mark.parametrize("extra, mesh, key", [
    ({"moe_router_topk": 5}, {"expert": 2}, "model.moe_router_topk"),
    ({"num_experts": 0}, {"expert": 2}, "mesh.expert"),
    ({"num_experts": 6}, {"expert": 4, "data": 1}, "model.num_experts"),  # 6 experts over 4 devices
    ({"moe_ffn_hidden_size": 30}, {"tensor": 4}, "model.moe_ffn_hidden_size"),
    ({"moe_shared_expert_intermediate_size": 30}, {"tensor": 4}, "model.moe_shared_expert_intermediate_size"),
    ({"mlp_chunks": 2}, {"expert": 2}, "model.mlp_chunks")])
def test_config_errors(extra, mesh, key):
    """One line naming the key, before anything compiles."""
    c = config.get_config()
    c.model.update(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, **{**MOE, **extra})
    c.train.update(micro_batch_size=1, global_batch_size=8)
    c.mesh.update(**mesh)
    with pytest.raises(ConfigError) as e:
        resolve(c, num_devices=math.prod(mesh.values()), vocab_size=64)
    assert e.value.key == key


def test_router_losses_reach_the_router_gradient():
    """The router's gradient moves by exactly coeff x the gradient of the layers' summed losses: linear in the
    coefficients, and nonzero (the losses are joined to the objective, not only logged)."""
    tokens = jax.random.randint(jax.random.key(5), (2, 16), 0, 64)

    def router_grad(aux, z):
        cfg = _resolved(moe_aux_loss_coeff=aux, moe_z_loss_coeff=z)
        spec, params = gpt.describe(cfg.model), gpt.init(cfg.model, 0)
        grad = jax.jit(jax.grad(lambda p: gpt.loss(spec.graphdef, p, tokens, tokens)))
        return grad(params)["layers"]["mlp"]["router"]

    base, aux, both = router_grad(0.0, 0.0), router_grad(0.1, 0.0), router_grad(0.2, 0.05)
    assert np.abs(aux - base).max() > 1e-4
    z_part = both - base - 2 * (aux - base)
    np.testing.assert_allclose(router_grad(0.0, 0.1) - base, 2 * z_part, atol=1e-6)


def test_flops_count_the_active_experts():
    """Per token and layer the MLP counts its top-k experts and the router, nothing of the other experts: the
    mixture's step minus the dense model's (FFN of one expert) is 3 x layers x ((k - 1) experts' up and down
    matmuls + the router's 2 h E)."""
    moe_cfg, dense_cfg = _resolved(moe_ffn_hidden_size=96), _resolved(num_experts=0, ffn_hidden_size=96)
    h, f, k, e, layers = 32, 96, 2, 4, 2
    extra = 3 * layers * ((k - 1) * (2 * h * f + 2 * f * h) + 2 * h * e)
    assert flops.flops_per_token(moe_cfg.model, 16) - flops.flops_per_token(dense_cfg.model, 16) == extra


@pytest.mark.parametrize("impl", ["cpu", "gpu_kernels"])
def test_grouped_matmul_and_its_gradients_are_each_groups_matmul(impl):
    """Groups of 0, 1, 8, 9 and 30 rows and rows past the groups, against each group's rows times its weight in
    jax.numpy; the gradients of both, and under vmap (the pipeline's stages).  ``cpu``: moe.grouped_matmul as
    this CPU runs it (the tiled loops, tiles of 8 rows); ``gpu_kernels``: the GPUs' grouped GEMM kernels
    (jaxllm_kernels.grouped_matmul) in Pallas's interpret mode, tiles of 16 rows past group ends and the array's."""
    sizes = jnp.array([9, 0, 30, 1, 8], jnp.int32)
    rows, groups = 56, len(sizes)  # 48 rows in groups, 8 past them
    k = jax.random.split(jax.random.key(0), 3)
    x, w = jax.random.normal(k[0], (rows, 12)), jax.random.normal(k[1], (groups, 12, 7))
    dy = jax.random.normal(k[2], (rows, 7))
    group = np.repeat(np.arange(groups + 1), [*sizes.tolist(), rows - int(sizes.sum())])  # groups: past the groups

    def reference(x, w):
        return jnp.einsum("ri,rio->ro", x, jnp.concatenate([w, jnp.zeros_like(w[:1])])[group])

    def value_and_grads(f, x, dy):
        y, vjp = jax.vjp(f, x, w)
        return y, *vjp(dy)

    kernels = lambda x, w, s: grouped_gemm.gmm(x, w, s, grouped_gemm.Tiles(16, 16, 16), True)  # noqa: E731
    matmul = moe.grouped_matmul if impl == "cpu" else kernels
    ours = jax.jit(jax.vmap(functools.partial(value_and_grads, lambda x, w: matmul(x, w, sizes))))
    got = ours(jnp.stack([x, -x]), jnp.stack([dy, 2 * dy]))
    for i, (xi, dyi) in enumerate([(x, dy), (-x, 2 * dy)]):
        for g, r in zip(got, value_and_grads(reference, xi, dyi), strict=True):
            np.testing.assert_allclose(g[i], r, rtol=1e-5, atol=1e-4)


def _experts_temp_bytes(num_experts: int, gpu: str | None = None) -> int:
    """Temporary bytes of the compiled forward and backward of :func:`moe.local_experts` (2,048 tokens routed to
    the top 8, hidden 64, SwiGLU experts of 128, float32), compiled for this CPU or by XLA:GPU for ``gpu``."""
    from jax.sharding import SingleDeviceSharding

    from jaxllm.platform import xla_gpu

    sharding = SingleDeviceSharding(xla_gpu.devices(gpu, 1)[0] if gpu else jax.devices("cpu")[0])
    shape = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32, sharding=sharding)  # noqa: E731
    e, t, h, f = num_experts, 2048, 64, 128

    def loss(x, w1, wg, w2, logits):
        ids, weights, _ = moe.route(logits, 8)
        return moe.local_experts(x, ids, weights, w1, wg, w2, None, None, activation=None, dtype=jnp.float32).sum()

    with lowering.without_gpu():  # the Pallas kernels lowered for a GPU that is not here, as jaxllm.plan does
        lowered = jax.jit(jax.grad(loss, argnums=range(4))).lower(shape(1, t, h), shape(e, h, f), shape(e, h, f),
                                                                  shape(e, f, h), shape(1, t, e))
    compiled = lowered.compile(compiler_options=xla_gpu.compiler_options()) if gpu else lowered.compile()
    return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("gpu", [None, "H100"])
def test_experts_memory_is_linear_in_routed_tokens(gpu):
    """From 8 to 64 experts at the same 2,048 tokens x top 8, the compiled temporaries grow by at most the
    experts' weights (the gradients' float32 accumulators, 3 x 56 x 64 x 128 x 4 bytes) and 5 % (the tiles
    padded per expert).  jax.lax.ragged_dot compiled to buffers of experts x routed rows: on the CPU 409 MiB
    and 3,100 MiB."""
    if gpu:  # XLA:GPU without a GPU: in a process that starts JAX with JAX_PLATFORMS=cpu (tests/gpu_program.py)
        pytest.importorskip("jax_plugins.xla_cuda12", reason='JAX\'s CUDA plugin (pip install -e ".[test]")')
        code = ("import json, sys; sys.path.insert(0, 'tests'); from test_moe import _experts_temp_bytes as b; "
                f"print(json.dumps([b(8, {gpu!r}), b(64, {gpu!r})]))")
        few, many = json.loads(run_python("-c", code).stdout.splitlines()[-1])
    else:
        few, many = _experts_temp_bytes(8), _experts_temp_bytes(64)
    assert many - few <= 3 * 56 * 64 * 128 * 4 + 0.05 * few, (few, many)


def test_mixtral_recipe_plans_its_parameters_on_64_h100s():
    """configs/moe.py:Mixtral-8x7B: 46.7B parameters, 12.9B active (Mixtral's), planned for expert 8 x tensor 8."""
    out = run_python("-m", "jaxllm.plan", "--config=configs/moe.py:Mixtral-8x7B", "--devices=64", "--device=H100",
                     "--config.mesh.expert=8", "--config.mesh.tensor=8", "--config.data.tokenizer=byte").stdout
    assert "46.709B parameters (12.886B active per token)" in out and "FITS in H100" in out, out  # 32768 rows


def test_the_tuner_lays_out_experts():
    """tune's default axes take expert for a mixture of experts only; 4 experts do not split over 8 devices."""
    base = config.get_config()
    base.model.update(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, **MOE)
    base.train.update(seq_length=16, micro_batch_size=1, global_batch_size=8)
    cands = layouts.space(base, 8, axes=["data", "expert"], micro_batches=[1], remats=["none"], attentions=["xla"],
                          virtual_stages=[1], sequence_impls=["allgather"], schedules=["gpipe"])
    why = {c.mesh_text(): tune.constraint(layouts.candidate_config(base, c), 8) for c in cands}
    assert why == {"data8": None, "data4 expert2": None, "data2 expert4": None, "expert8": "model.num_experts"}


def test_the_tiny_recipe_trains_on_two_expert_devices(tmp_path):
    """configs/moe.py:tiny as a user runs it, its experts over 2 devices: the routing statistics on the log
    line and in metrics.jsonl, the evaluation loss, and the startup line's active parameters."""
    (tmp_path / "t.txt").write_text("=== doc\nthe experts of a mixture route each token to two of four.\n" * 400)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAXLLM_", "XLA_"))}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags("--xla_force_host_platform_device_count=2"))
    out = run_python("-m", "jaxllm.train", "--config=configs/moe.py:tiny", f"--workdir={tmp_path / 'w'}",
                     f"--config.data.input={tmp_path / 't.txt'}", "--config.data.document_marker====",
                     "--config.mesh.expert=2",
                     "--config.train.train_iters=4", "--config.train.eval_interval=4", "--config.train.log_interval=2",
                     "--config.log.tensorboard=False", "--config.log.progress_bar=False", "--config.log.samples=0",
                     env=env).stdout
    assert "M active per token)" in out and " aux " in out and "max load" in out, out
    assert re.search(r"^experts' token dispatcher: (allgather|alltoall|ragged) \(", out, re.M), out  # auto resolved
    records = [json.loads(line) for line in (tmp_path / "w" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [2, 4]
    assert all(set(gpt.MOE_STATS) <= set(r) and r["moe_dropped"] == 0 and r["moe_max_load"] >= 1 for r in train)
    assert any(r["kind"] == "eval" and r["step"] == 4 and np.isfinite(r["eval_loss"]) for r in records)


DISPATCH = """
import itertools, json, os, re, sys
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax
import jax.numpy as jnp
import numpy as np
from jaxllm import config
from jaxllm.model import layers, moe
from jaxllm.parallel import experts, sharding
from jaxllm.resolve import resolve
from jaxllm.runtime.run import Run


def resolved(mesh, **model):  # 8 experts of hidden 32, top-2; 8 rows of 8 tokens
    c = config.get_config()
    c.model.update(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, dtype="float32",
                   num_experts=8, moe_router_topk=2, **model)
    c.train.update(seq_length=8, micro_batch_size=1, global_batch_size=8)
    c.mesh.update(**mesh)
    return resolve(c, num_devices=8)


out = {}
keys = jax.random.split(jax.random.key(0), 6)
x, cot = jax.random.normal(keys[0], (8, 8, 32)), jax.random.normal(keys[5], (8, 8, 32))
params = (jax.random.normal(keys[1], (8, 32, 48)) * 0.2, jax.random.normal(keys[2], (8, 48, 32)) * 0.2,
          jax.random.normal(keys[3], (8, 48)), jax.random.normal(keys[4], (8, 32)))
# skewed: most copies to expert 0, none to experts 5-7
logits = jax.random.normal(jax.random.key(1), (8, 8, 8)) + jnp.asarray([4.0, 1, 1, 0, 0, -30, -30, -30])
meshes = {"expert8": {"expert": 8}, "expert2_tensor2_data2": {"expert": 2, "tensor": 2, "data": 2}}
for (name, mesh), factor, dispatcher in itertools.product(meshes.items(), (0.0, 1.0), ("alltoall", "ragged")):
    cfg = resolved(mesh, moe_capacity_factor=factor)
    layout = sharding.Layout(sharding.make_mesh(cfg), sharding.rules(cfg))
    ids, weights, stats = moe.route(logits, 2, factor)

    def loss(op, x, w1, w2, b1, b2):
        y = op(x, ids, weights, w1, None, w2, b1, b2, activation=layers.gelu, dtype=jnp.float32)
        return (y * cot).sum(), y

    grad = lambda op: jax.value_and_grad(lambda *a: loss(op, *a), (0, 1, 2, 3, 4), has_aux=True)  # noqa: E731
    (_, got), got_grads = jax.jit(grad(experts.Experts(layout, dispatcher, factor)))(x, *params)
    (_, ref), ref_grads = grad(moe.local_experts)(x, *params)
    out[f"{dispatcher}_{name}_capacity{factor}"] = {
        "load": np.bincount(np.asarray(ids).ravel(), minlength=9).tolist(), "dropped": float(stats["dropped"]),
        "error": max(float(np.max(np.abs(g - r)) / np.max(np.abs(r)))
                     for g, r in zip((got, *got_grads), (ref, *ref_grads)))}
for dispatcher in ("allgather", "alltoall"):  # the compiled train step's all-gathers and all-to-alls
    cfg = resolved({"expert": 8}, moe_token_dispatcher_type=dispatcher)
    run = Run(cfg)
    batch = jax.ShapeDtypeStruct(cfg.batch_shape, "int32", sharding=run.batch_sharding)
    hlo = run.train_step.lower(run.abstract_state, batch, batch).compile().as_text()
    output = r"^\\s*%\\S+ = \\(?(\\w+\\[[\\d,]*\\])[^\\n]* "  # an instruction's (first) output shape
    out[dispatcher] = {kind: re.findall(output + kind + r"(?:-start)?\\(", hlo, re.M)
                       for kind in ("all-gather", "all-to-all")}
sys.stdout.write(json.dumps(out))
"""


@pytest.fixture(scope="module")
def dispatched():
    r = subprocess.run([sys.executable, "-c", DISPATCH], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


@pytest.mark.parametrize("dispatcher", ["alltoall", "ragged"])
@pytest.mark.parametrize("case", ["expert8_capacity0.0", "expert8_capacity1.0", "expert2_tensor2_data2_capacity0.0",
                                  "expert2_tensor2_data2_capacity1.0"])
def test_alltoall_dispatch_matches_one_device_under_a_skewed_router(dispatched, dispatcher, case):
    """The alltoall and ragged experts operations on 8 devices: their output and gradients (input, weights,
    biases) those of one device's, with most copies routed to expert 0 and none to experts 5-7, dropless and with
    the router's drops (ragged: on CPUs the emulated jax.lax.ragged_all_to_all, experts.ragged_all_to_all)."""
    got = dispatched[f"{dispatcher}_{case}"]
    load = got["load"]  # copies per expert, then dropped ones
    assert load[0] == max(load[:8]) and load[5:8] == [0, 0, 0]
    assert (got["dropped"] > 0) == case.endswith("1.0")
    assert got["error"] < 1e-5


def test_alltoall_step_exchanges_copies_not_gathered_tokens(dispatched):
    """In the compiled train step (expert 8, hidden 32), the tokens [.., 32] go by all-to-all, never all-gathered;
    the allgather dispatcher gathers them."""
    gathered = lambda shapes: [s for s in shapes if s.endswith(",32]")]  # noqa: E731
    assert gathered(dispatched["alltoall"]["all-to-all"]) and not gathered(dispatched["alltoall"]["all-gather"])
    assert gathered(dispatched["allgather"]["all-gather"]) and not dispatched["allgather"]["all-to-all"]


@pytest.mark.parametrize("topk, factor, expected", [(2, 0.0, "ragged"), (2, 0.25, "ragged"), (8, 0.0, "allgather")])
def test_auto_dispatcher_sends_fewer_rows(topk, factor, expected):
    """64 experts, expert 8, 16 tokens per device: alltoall's buffer per rank is min(topk, 8 local experts) rows a
    token, or the 8 local experts' capacities, 8 x ceil(factor x 128 x topk / 64); ragged sends a balanced
    router's copies, 16 x topk / 8 a rank; allgather the 16 tokens.  Top 2: ragged (4 rows a rank against 16 and
    32 or 8); top 8: ragged's 16 equal allgather's, which wins the tie."""
    c = config.get_config()
    c.model.update(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, num_experts=64,
                   moe_router_topk=topk, moe_capacity_factor=factor, moe_token_dispatcher_type="auto")
    c.train.update(seq_length=16, micro_batch_size=1, global_batch_size=8)
    c.mesh.update(expert=8)
    assert resolve(c, num_devices=8, vocab_size=64).model.moe_token_dispatcher_type == expected
    rows = {d: experts.dispatch_rows(d, tokens=16, micro_tokens=128, experts=64, expert_size=8, topk=topk,
                                     capacity_factor=factor) for d in experts.DISPATCHERS}
    alltoall = {(2, 0.0): 32, (2, 0.25): 8, (8, 0.0): 128}[(topk, factor)]
    assert rows == {"allgather": 7 * 16, "alltoall": 7 * alltoall, "ragged": 7 * 2 * topk}


def test_ragged_dispatch_sends_a_quarter_of_allgathers_rows():
    """64 experts, top 8, expert 32 (2 experts a rank), 256 tokens a device, a router of random logits: the rows
    each device's ragged exchange sends to the other ranks (experts.send_sizes, the step's exchange sizes, less
    the copies it keeps) are its copies routed to other ranks, counted here from the expert ids, and on average
    a quarter of allgather's 31 x 256 (7.75 x 256: 8 copies a token, 1/32 of them kept)."""
    ranks, tokens, num_experts = 32, 256, 64
    ids, _, _ = moe.route(jax.random.normal(jax.random.key(0), (ranks, tokens, num_experts)), 8)
    _, sizes = jax.vmap(lambda i: experts.send_sizes(i, ranks, num_experts // ranks))(ids)
    sent = np.asarray(sizes).sum(1) - np.diagonal(np.asarray(sizes))
    np.testing.assert_array_equal(sent, (np.asarray(ids) // 2 != np.arange(ranks)[:, None, None]).sum((1, 2)))
    allgather = experts.dispatch_rows("allgather", tokens=tokens, micro_tokens=ranks * tokens, experts=num_experts,
                                      expert_size=ranks, topk=8, capacity_factor=0.0)
    assert allgather == 31 * tokens and sent.mean() <= allgather / 4, (sent.mean(), sent.max(), allgather)


RAGGED_GPU = """
import json, os, re, sys
os.environ["JAX_PLATFORMS"] = "cpu"  # JAX's CUDA plugin without a GPU (jaxllm.platform.xla_gpu)
import jax
import jax.numpy as jnp
from jaxllm import config
from jaxllm.model import layers, moe
from jaxllm.parallel import experts, sharding
from jaxllm.platform import xla_gpu
from jaxllm.resolve import resolve

out = {}
for dispatcher in ("allgather", "ragged"):  # 64 experts of 128, top 8, expert 32: 64 tokens of hidden 64 a GPU
    c = config.get_config()
    c.model.update(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=64, num_experts=64,
                   moe_router_topk=8)
    c.train.update(seq_length=64, micro_batch_size=1, global_batch_size=32)
    c.mesh.update(expert=32)
    cfg = resolve(c, num_devices=32, backend="cuda")
    mesh = sharding.make_mesh(cfg, xla_gpu.devices("H100", 32))
    layout = sharding.Layout(mesh, sharding.rules(cfg))
    arg = lambda shape, dtype, axes: jax.ShapeDtypeStruct(shape, dtype,  # noqa: E731
                                                          sharding=jax.NamedSharding(mesh, layout.spec(axes)))

    def loss(x, logits, w1, w2):
        ids, weights, _ = moe.route(logits, 8)
        y = experts.Experts(layout, dispatcher)(x, ids, weights, w1, None, w2, None, None, activation=layers.gelu,
                                                dtype=jnp.bfloat16)
        return y.astype(jnp.float32).sum()

    tokens = ("batch", "expert_length", None)
    hlo = jax.jit(jax.grad(loss, (0, 2, 3))).lower(
        arg((32, 64, 64), jnp.bfloat16, tokens), arg((32, 64, 64), jnp.float32, tokens),
        arg((64, 64, 128), jnp.bfloat16, ("experts", None, "expert_mlp")),
        arg((64, 128, 64), jnp.bfloat16, ("experts", "expert_mlp", None))).compile(
            compiler_options=xla_gpu.compiler_options()).as_text()
    # the rows of the arrays of hidden 64 (tokens) each collective reads or writes
    out[dispatcher] = {kind: sorted({int(n) for line in re.findall(r"^.* " + kind + r"-start\\(.*$", hlo, re.M)
                                     for n in re.findall(r"\\[(\\d+),64\\]", line)})
                       for kind in ("all-gather", "ragged-all-to-all")}
    out[dispatcher]["grouped_gemms"] = xla_gpu.kernels(hlo).get(("GEMM", "Pallas grouped bf16"), (0, 0))[1]
print(json.dumps(out))
"""


def test_ragged_exchange_compiles_for_32_gpus_from_the_routed_copies():
    """XLA:GPU's program for 32 H100s without them (expert 32, 64 experts, top 8, 64 tokens a GPU): the ragged
    dispatcher's exchanges of token rows send out of the device's 64 x 8 routed copies (at most those: 512 rows
    against allgather's 31 x 64 = 1,984, less the copies it keeps) and return out of the 32 x 128 rows of its
    receive buffer (the copies it received); allgather all-gathers 32 x 64 rows; ragged all-gathers no token; the
    expert matmuls are grouped GEMMs."""
    pytest.importorskip("jax_plugins.xla_cuda12", reason='JAX\'s CUDA plugin (pip install -e ".[test]")')
    out = json.loads(run_python("-c", RAGGED_GPU).stdout.splitlines()[-1])
    assert out["allgather"]["all-gather"] == [64, 32 * 64] and not out["ragged"]["all-gather"], out
    assert out["ragged"]["ragged-all-to-all"] == [64 * 8, 32 * 64 * 2], out
    assert out["ragged"]["grouped_gemms"] >= 3 and out["allgather"]["grouped_gemms"] >= 3


EXPERT_TENSOR = """
import json, os
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax
import jax.numpy as jnp
from jaxllm import config
from jaxllm.model import gpt, layers, moe
from jaxllm.parallel import experts, sharding
from jaxllm.resolve import resolve

out = {}
x, w = jnp.ones((8, 8, 32)), jnp.ones((8, 8, 2))  # 8 rows of 8 tokens, top-2 of 8 experts of hidden 48
ids = jax.random.randint(jax.random.key(0), (8, 8, 2), 0, 8)
w1, w2 = jnp.ones((8, 32, 48)), jnp.ones((8, 48, 32))
op = lambda f: jax.jit(lambda x, w1, w2: f(x, ids, w, w1, None, w2, None, None, activation=layers.gelu,  # noqa: E731
                                                dtype=jnp.float32))
for etp in (0, 1):
    c = config.get_config()
    c.model.update(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, num_experts=8,
                   moe_ffn_hidden_size=48)
    c.train.update(seq_length=8, micro_batch_size=1, global_batch_size=8)
    c.mesh.update(expert=2, tensor=2, data=2, expert_tensor=etp)
    cfg = resolve(c, num_devices=8)
    mesh = sharding.make_mesh(cfg)
    w1_sharding = sharding.param_shardings(cfg, gpt.describe(cfg.model).axes, mesh)["layers"]["mlp"]["w1"]
    layout = sharding.Layout(mesh, sharding.rules(cfg))
    # [layers, experts, embed, expert_mlp]; the tokens each device dispatches (global [8, 8, 32] ones)
    out[etp] = {"w1_shard": w1_sharding.shard_shape((2, 8, 32, 48)),
                "tokens_shard": jax.NamedSharding(mesh, layout.spec(("batch", "expert_length", None))).shard_shape(
                    (8, 8, 32))}
    for d in ("allgather", "alltoall"):  # and the operation equals one device's
        got = op(experts.Experts(layout, d))(x, w1, w2)
        out[etp][d] = float(jnp.max(jnp.abs(got - op(moe.local_experts)(x, w1, w2))))
print(json.dumps(out))
"""


def test_expert_tensor_1_holds_whole_experts_and_shares_the_tokens():
    """mesh.expert_tensor=1 on expert 2 x tensor 2 x data 2 (8 experts of hidden 48): each device holds 2 whole
    experts (experts over expert x tensor, hidden 48 unsplit) where the default splits 4 experts' hidden over
    tensor; and each device dispatches a quarter of its tensor group's tokens' rows where the default's tensor
    devices dispatch the same ones, so they do not repeat each other's expert work; either dispatcher equals one
    device's operation."""
    r = subprocess.run([sys.executable, "-c", EXPERT_TENSOR], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert out["0"]["w1_shard"] == [2, 4, 32, 24] and out["1"]["w1_shard"] == [2, 2, 32, 48]
    # batch over data x expert (4), and with expert_tensor=1 the sequence over tensor too
    assert out["0"]["tokens_shard"] == [2, 8, 32] and out["1"]["tokens_shard"] == [2, 4, 32]
    for etp in ("0", "1"):
        for d in ("allgather", "alltoall"):
            assert out[etp][d] < 1e-3, (etp, d, out[etp][d])


@pytest.mark.parametrize("mesh, extra, key", [
    ({"tensor": 4, "data": 2, "expert_tensor": 2}, {}, "mesh.expert_tensor"),  # a part of tensor: not built
    ({"expert": 4, "tensor": 2, "expert_tensor": 1}, {}, "model.num_experts"),  # 4 experts over 8 devices
    ({"tensor": 2, "sequence": 4, "expert_tensor": 1}, {}, "train.seq_length")])  # 4 tokens over 8 devices
def test_expert_tensor_config_errors(mesh, extra, key):
    """One line naming the key, before anything compiles."""
    c = config.get_config()
    c.model.update(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, **{**MOE, **extra})
    c.train.update(seq_length=4, micro_batch_size=1, global_batch_size=8)
    c.mesh.update(**mesh)
    with pytest.raises(ConfigError) as e:
        resolve(c, num_devices=8, vocab_size=64)
    assert e.value.key == key
