"""Plans train steps with XLA:GPU for a GPU this machine lacks; prints one JSON object.

Used by tests/test_gpu_program.py in subprocesses (JAX's CUDA plugin registers without a GPU only with
``JAX_PLATFORMS=cpu`` set before JAX starts, and ``XLA_FLAGS`` is read then too):
``python tests/gpu_program.py CASE...``, each case a key of :data:`CASES`.  For each: the plan of
:func:`jaxllm.plan.plan` with ``gpu=`` (its kernels as ``{"group|kind": [in program, per step]}``, the
bytes on the device) and the counts the assertions need (layers, micro batches, the loss head's chunks,
the arrays of a layer's parameters and of the train state).
"""

import json
import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

from jaxllm import config  # noqa: E402
from jaxllm.model import fused_loss  # noqa: E402
from jaxllm.plan import plan, resolved  # noqa: E402
from jaxllm.runtime.run import Run  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs"))
import gpt3  # noqa: E402
import llama  # noqa: E402

SMALL = dict(model=dict(num_layers=4), train=dict(seq_length=512, micro_batch_size=2, global_batch_size=4))
GPT1_5B = {  # the H200 runs of 2026-11-26 (tests/test_gpu_program.py: MEASURED), the layers scanned as they ran
    "long": dict(train=dict(seq_length=32768, micro_batch_size=1, global_batch_size=1), model=dict(remat="full")),
    "full": dict(train=dict(micro_batch_size=4, global_batch_size=8), model=dict(remat="full")),
    "none": dict(train=dict(micro_batch_size=4, global_batch_size=8), model=dict(remat="none", layer_loop="scan")),
}
# two Qwen3-30B-A3B layers (128 experts, top 8, hidden 2048, experts' FFN 768) on 4,096 tokens
QWEN3_MOE = {"model": dict(num_layers=2, remat="full"), "data": dict(tokenizer="byte"),
             "train": dict(seq_length=4096, micro_batch_size=1, global_batch_size=1)}
# case -> (configs/gpt3.py key, or "llama:" and a configs/llama.py key; GPU; overrides by section)
CASES = {
    "qwen3_moe": ("llama:Qwen3-30B-A3B", "H100", QWEN3_MOE),
    "bf16": ("GPT125M", "H100", {**SMALL, "model": dict(num_layers=4, remat="full")}),
    "bf16_packed": ("GPT125M", "H100", {**SMALL, "model": dict(num_layers=4, remat="full"),
                                        "data": dict(reset_attention_mask=True,
                                                                     max_documents_per_sample=16)}),
    "fp8": ("GPT125M", "H100", {**SMALL, "model": dict(num_layers=4, remat="full", fp8=True)}),
    "fp8_none": ("GPT125M", "H100", {**SMALL, "model": dict(num_layers=4, remat="none", fp8=True)}),
    "fp8_swiglu": ("GPT125M", "H100", {**SMALL, "model": dict(num_layers=4, remat="none", fp8=True,
                                                             activation="swiglu")}),
    **{f"GPT1_5B_{k}": ("GPT1_5B", "H200", v) for k, v in GPT1_5B.items()},
}


def case(name: str) -> dict:
    key, gpu, overrides = CASES[name]
    spec = llama.get_config(key[len("llama:"):]) if key.startswith("llama:") else gpt3.get_config(key)
    for section, values in overrides.items():
        getattr(spec, section).update(**values)
    spec = config.from_dict(spec.to_dict())
    p = plan(spec, 1, backend="cuda", gpu=gpu)
    cfg = resolved(spec, 1, "cuda")
    tokens = cfg.train.micro_batch_size * cfg.train.seq_length
    params = Run(cfg, devices=jax.devices("cpu")[:1]).logical_state
    return {"kernels": {f"{g}|{k}": list(c) for (g, k), c in p["kernels"].items()}, "device": p["device"],
            "layers": cfg.model.num_layers, "microbatches": cfg.microbatches, "temp": p["temp"],
            "dynamic_gemm_loops": p["gemm_loops"],
            "loss_chunks": tokens // fused_loss.chunk_rows(tokens, cfg.model.padded_vocab_size),
            "layer_arrays": len(jax.tree.leaves(params["params"]["layers"])),
            "state_arrays": len(jax.tree.leaves(params))}


if __name__ == "__main__":
    print(json.dumps({name: case(name) for name in sys.argv[1:]}))
