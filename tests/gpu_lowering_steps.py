"""Exports the train step of a small GPT for GPUs on 8 fake CPU devices; prints one JSON line.

Used by tests/test_gpu_lowering.py in a subprocess (the device count is fixed before jax starts):
``python tests/gpu_lowering_steps.py``.  For each layout, ``jax.export`` of
``jaxllm.runtime.run.Run(cfg).train_step`` for ``cuda`` or ``rocm`` (inside
``jaxllm.model.attention.lowering_target``), summarised as its custom calls, Triton kernel names,
device count, ``shard_map`` regions (``sdy.manual_computation``), float8 types and whether inputs are
sharded.
"""

import collections
import json
import os
import re
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxllm import config  # noqa: E402
from jaxllm.model import attention  # noqa: E402
from jaxllm.resolve import resolve
from jaxllm.runtime.run import Run  # noqa: E402
from jaxllm_kernels import lowering  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_gpu_lowering import CUDNN_VERSION  # noqa: E402

# (name, platform, attention_impl, mesh, parallel)
LAYOUTS = [
    ("cuda-pallas-1", "cuda", "pallas", {}, {}),
    ("cuda-cudnn-1", "cuda", "cudnn", {}, {}),
    ("rocm-pallas-1", "rocm", "pallas", {}, {}),
    ("cuda-pallas-fsdp2-tensor2-data2", "cuda", "pallas", dict(fsdp=2, tensor=2, data=2), {}),
    ("cuda-cudnn-fsdp2-tensor2-data2", "cuda", "cudnn", dict(fsdp=2, tensor=2, data=2), {}),
    ("rocm-pallas-fsdp2-tensor2-data2", "rocm", "pallas", dict(fsdp=2, tensor=2, data=2), {}),
    ("cuda-pallas-ring2-tensor2-data2", "cuda", "pallas", dict(sequence=2, tensor=2, data=2),
     dict(sequence_impl="ring")),
    ("cuda-cudnn-fp8-tensor2-data2", "cuda", "cudnn", dict(tensor=2, data=2), {}),
]
MODEL = {"cuda-cudnn-fp8-tensor2-data2": {"fp8": True}}  # model keys beyond small_config's


def small_config(platform, impl, mesh, parallel, model=None):
    c = config.get_config()
    # the layers scanned (model.layer_loop's auto writes them out on NVIDIA GPUs without remat): one kernel call
    # in the scan's body, its backward's in the transpose's, whatever the depth
    c.model.update(num_layers=2, hidden_size=128, num_attention_heads=4, vocab_size=256, dtype="bfloat16",
                   attention_impl=impl, layer_loop="scan", **(model or {}))
    c.train.update(seq_length=256, micro_batch_size=2, global_batch_size=8, warmup_iters=1)
    c.mesh.update(**mesh)
    c.parallel.update(**parallel)
    n = 1
    for v in mesh.values():
        n *= v
    return resolve(c, num_devices=n, backend=platform), n


def export_step(platform, impl, mesh, parallel, model=None):
    cfg, n = small_config(platform, impl, mesh, parallel, model)
    with attention.lowering_target(platform):
        run = Run(cfg, devices=jax.devices()[:n])
        tokens = jax.ShapeDtypeStruct(cfg.batch_shape, jnp.int32, sharding=run.batch_sharding)
        exported = lowering.export_for(run.train_step, (run.abstract_state, tokens, tokens), platform)
    text = exported.mlir_module()
    signature = text[text.index("func.func public @main("):]
    signature = signature[:signature.index(") -> (")]
    return {"platforms": list(exported.platforms), "nr_devices": exported.nr_devices,
            "calls": dict(collections.Counter(lowering.custom_call_targets(exported))),
            "kernels": sorted({k.name for k in lowering.triton_kernels(exported)}),
            "manual": text.count("sdy.manual_computation"),
            "float8": dict(collections.Counter(re.findall(r"f8E\w+", text))),
            "mesh": re.search(r"sdy\.mesh @mesh = <\[(.*?)\]>", text).group(1),
            # arguments split over some mesh axis (a Shardy sharding with a non-empty axis list)
            "sharded_inputs": len(re.findall(r'#sdy\.sharding<@mesh, \[[^\]]*\{"', signature))}


def main():
    from jax._src.cudnn import fused_attention_stablehlo as fa

    fa.check_cudnn_version = lambda: CUDNN_VERSION  # no CUDA plugin here: the version jax would ask it for
    out = {name: export_step(*spec, MODEL.get(name)) for name, *spec in LAYOUTS}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
