"""Plans train steps with XLA:GPU for a GPU this machine lacks; prints one JSON object.

Used by tests/test_gpu_program.py in subprocesses (JAX's CUDA plugin registers without a GPU only with
``JAX_PLATFORMS=cpu`` set before JAX starts, and ``XLA_FLAGS`` is read then too):
``python tests/gpu_program.py CASE...``, each case a key of :data:`CASES`.  For each: the plan of
:func:`jaxllm.plan.plan` with ``gpu=`` (its kernels as ``{"group|kind": [in program, per step]}``, the
bytes on the device), the step-time model's step and collectives (seconds; those in loops apart) and the counts
the assertions need (layers, micro batches, the loss head's chunks, the arrays of a layer's parameters and of the
train state).
"""

import json
import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

from jaxllm import config  # noqa: E402
from jaxllm.model import fused_loss  # noqa: E402
from jaxllm.plan import plan, resolved  # noqa: E402
from jaxllm.platform import xla_gpu  # noqa: E402
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
# GPT125M's 4 layers on 8 GPUs, FSDP over all 8 (ZeRO-3), 2 sequences each
FSDP8 = {"model": dict(num_layers=4, remat="full"), "mesh": dict(data=1, fsdp=8),
         "train": dict(seq_length=512, micro_batch_size=2, global_batch_size=16)}
# Llama-2-7B's shapes in 6 layers (loops of several trips) on 8 GPUs, FSDP over all 8, JAX-Toolbox's job otherwise
LLAMA_FSDP8 = {"model": dict(num_layers=6, remat="save_dots", vocab_size=32000), "data": dict(tokenizer="byte"),
               "mesh": dict(data=1, fsdp=8), "train": dict(seq_length=4096, micro_batch_size=2, global_batch_size=16)}
# case -> (configs/gpt3.py key, or "llama:" and a configs/llama.py key; GPU; overrides by section[; GPUs, else 1])
CASES = {
    "fsdp8": ("GPT125M", "H100", FSDP8, 8),
    "llama_fsdp8": ("llama:Llama-2-7B", "H100", LLAMA_FSDP8, 8),
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
    key, gpu, overrides, *devices = CASES[name]
    n = devices[0] if devices else 1
    spec = llama.get_config(key[len("llama:"):]) if key.startswith("llama:") else gpt3.get_config(key)
    for section, values in overrides.items():
        getattr(spec, section).update(**values)
    spec = config.from_dict(spec.to_dict())
    p = plan(spec, n, backend="cuda", gpu=gpu)
    cfg = resolved(spec, n, "cuda")
    tokens = cfg.train.micro_batch_size * cfg.train.seq_length
    params = Run(cfg, devices=xla_gpu.devices(gpu, n)).logical_state
    return {"kernels": {f"{g}|{k}": list(c) for (g, k), c in p["kernels"].items()}, "device": p["device"],
            "layers": cfg.model.num_layers, "microbatches": cfg.microbatches, "temp": p["temp"],
            "dynamic_gemm_loops": p["gemm_loops"],
            "loss_chunks": tokens // fused_loss.chunk_rows(tokens, cfg.model.padded_vocab_size),
            "layer_arrays": len(jax.tree.leaves(params["params"]["layers"])),
            "state_arrays": len(jax.tree.leaves(params)),
            "predicted": {**{k: p["predicted"][k] for k in ("step_s", "communication_s", "exposed_communication_s")},
                          # the collectives inside loops (the layers', the loss head's): run more than once a step
                          **{k: sum(getattr(tr, a) for tr in p["predicted"]["transfers"] if tr.runs > 1)
                             for k, a in (("loop_communication_s", "time_s"), ("loop_exposed_s", "exposed_s"))}}}


if __name__ == "__main__":
    print(json.dumps({name: case(name) for name in sys.argv[1:]}))
