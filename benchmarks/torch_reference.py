"""A PyTorch peer of jaxllm's GPT for throughput comparisons on one GPU (``configs/gpt3.py``'s architecture).

    python benchmarks/torch_reference.py --config=configs/gpt3.py:GPT1_5B [--config.SECTION.KEY=VALUE ...]
        [--steps=10] [--warmup=2] [--output=FILE.jsonl] [--no-compile] [--device=cuda|cpu] [--recompute]
        [--compile-mode=MODE] [--name=LABEL]

The config is read as ``jaxllm.bench`` reads it: the file (``FILE.py[:KEY]``) through ml-collections'
config-file loader, each ``--config.SECTION.KEY=VALUE`` parsed as its key's type
(:func:`jaxllm.config.override`), then :func:`jaxllm.resolve.resolve` for one device of the chosen kind
with the tokenizer's vocabulary (GPT-2's 50,257 for ``data.tokenizer=gpt2``, padded as jaxllm pads it).
The batch (``train.micro_batch_size`` sequences of ``train.seq_length`` tokens per micro batch,
``train.global_batch_size / micro_batch_size`` micro batches accumulated per step), ``model.dtype`` and
the optimizer's hyperparameters come from that resolved config.

The model (:class:`GPT`) has exactly jaxllm's parameters (:func:`jaxllm.model.gpt.num_params`; GPT1_5B:
1,440,328,704): a token table of ``model.padded_vocab_size`` rows (the padding rows zero; the output
layer is the same table, ``model.tie_embeddings``), a learned position table of
``model.max_position_embeddings`` rows, and per layer pre-norm LayerNorms (``model.norm_eps``, with
biases when ``model.use_bias``), one fused q/k/v ``Linear`` (jaxllm's ``wq``, ``wk``, ``wv``
``[hidden, heads, head_dim]`` side by side), the output projection, and a GELU MLP (tanh approximation,
GPT-2's and jaxllm's) of ``model.ffn_hidden_size``; biases on every ``Linear`` but the output layer. The
loss is the mean next-token cross entropy over the real vocabulary (the padded logits left out, as jaxllm
masks them). Initialization is jaxllm's: normal(0, ``init_std``), the output projections of attention and
MLP scaled by ``1/sqrt(2 x num_layers)``, biases 0, norm scales 1, the padding rows 0.
:func:`load_jaxllm_params` copies a jaxllm parameter tree into it (``tests/test_torch_reference.py``
checks loss and optimizer steps against jaxllm's to float32 rounding).

The step is what a fast PyTorch GPT trainer does (nanoGPT's recipe): ``torch.compile`` of the model and
its loss (``--no-compile``: eager; off by default on CPUs), ``F.scaled_dot_product_attention`` with
``is_causal=True`` (a fused kernel on GPUs: the one PyTorch's dispatcher picks for these shapes is
recorded in ``attention_impl``; cuDNN's on an H100 with PyTorch 2.11), float32 master parameters under
``torch.autocast`` in ``model.dtype`` (bfloat16 for configs/gpt3.py), TF32 for float32 matmuls on GPUs,
gradient accumulation over the micro batches, global-norm clipping at ``train.grad_clip``, and AdamW
(``fused=True`` on GPUs) with jaxllm's ``beta1``, ``beta2``, ``adam_eps`` and ``weight_decay`` on the
matrices and embeddings only, at the constant learning rate ``train.lr`` (the schedule changes no time).
No activation recomputation unless ``--recompute`` or ``model.remat=full`` (each layer under
``torch.utils.checkpoint``); other remat policies, and features configs/gpt3.py does not use (rotary
positions, RMSNorm, SwiGLU, grouped-query attention, experts, FP8, MLP chunks, optimizers other than
AdamW), are refused.

Timing follows ``jaxllm.bench``: synthetic data (uniform random tokens in ``[0, vocab_size)`` from
``numpy.random.default_rng(train.seed)``, the same two global batches ``jaxllm.bench`` draws, alternated),
a first step whose time is ``compile_s`` (it includes ``torch.compile``'s tracing and compilation),
``--warmup`` untimed steps, then ``--steps`` timed steps, each from ``torch.cuda.synchronize()`` to its
loss read back on the host (``loss.item()``) and a second synchronize, with ``time.perf_counter``.
Peak memory is ``torch.cuda.max_memory_allocated`` over the timed steps (its counter reset after the
warm-up); on CPUs the process's peak resident set (``ru_maxrss``, its whole life).  Model FLOPs, MFU and
HFU are jaxllm's (:mod:`jaxllm.runtime.flops` on the resolved config; the peak from
:data:`jaxllm.platform.hardware.PEAK_FLOPS` by the GPU's name, else a measured matmul), so the figures
compare with ``python -m jaxllm.bench``'s.  One line is printed, and one JSON record appended to
``--output`` with jaxllm.bench's keys (all but its XLA memory figures and jax versions) plus ``framework:
"torch"``, ``peak_memory_reserved_bytes`` (the caching allocator's peak), the compile settings and the torch,
CUDA, Triton and Python versions; ``jaxllm.bench.table`` renders both kinds of record side by side.

Exit codes: 0 done; 2 a bad flag or config (one line); 1 anything unexpected.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # jaxllm is only read here (config, FLOP counts): jax must leave the GPU to PyTorch
    os.environ["JAX_PLATFORMS"] = "cpu"

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import resource  # noqa: E402
import shlex  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

from jaxllm import cli, config  # noqa: E402
from jaxllm.data.tokenizers import KNOWN_VOCAB_SIZES  # noqa: E402
from jaxllm.parallel import schedules  # noqa: E402
from jaxllm.platform import hardware  # noqa: E402
from jaxllm.resolve import resolve  # noqa: E402
from jaxllm.runtime import flops  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "jaxllm",
                              "default_config.py")


# ---------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------


def unsupported(m, t=None) -> tuple[str, object, str] | None:
    """``(key, value, why)`` for the first setting of a resolved ``model`` section ``m`` (and ``train``
    section ``t``, when given) this peer does not implement (configs/gpt3.py's architecture), else None."""
    checks = [
        ("model.position_embedding", m.position_embedding, m.position_embedding == "learned"),
        ("model.norm", m.norm, m.norm == "layernorm"),
        ("model.activation", m.activation, m.activation == "gelu"),
        ("model.num_kv_heads", m.num_kv_heads, m.num_kv_heads == m.num_attention_heads),
        ("model.num_experts", m.num_experts, m.num_experts == 0),
        ("model.fp8", m.fp8, not m.fp8),
        ("model.mlp_chunks", m.mlp_chunks, m.mlp_chunks == 1),
        ("model.remat", m.remat, m.remat in ("none", "full")),
        ("model.dtype", m.dtype, m.dtype in DTYPES),
    ]
    if t is not None:
        checks.append(("train.optimizer", t.optimizer, t.optimizer == "adamw"))
    for key, value, ok in checks:
        if not ok:
            return key, value, ("not in this PyTorch peer (configs/gpt3.py's architecture: learned positions, "
                                "LayerNorm, GELU, multi-head attention, dense MLP, remat none or full, float32 or "
                                "bfloat16, AdamW)")
    return None


class Block(nn.Module):
    """One pre-norm layer, ``[batch, len, hidden]`` to the same: ``x + proj(attn(ln_1(x)))``, then
    ``x + mlp(ln_2(x))``; attention by ``F.scaled_dot_product_attention`` (causal, scale
    ``1/sqrt(head_dim)``), the MLP ``fc -> GELU (tanh) -> mlp_proj``.

    Args:
      m: the ``model`` section of a resolved jaxllm config (:class:`jaxllm.config.Model`).
    """

    def __init__(self, m):
        super().__init__()
        h, f = m.hidden_size, m.ffn_hidden_size
        self.heads, self.dropout = m.num_attention_heads, m.dropout
        self.ln_1 = nn.LayerNorm(h, m.norm_eps, bias=m.use_bias)
        self.ln_2 = nn.LayerNorm(h, m.norm_eps, bias=m.use_bias)
        self.qkv = nn.Linear(h, 3 * h, bias=m.use_bias)  # rows: q, k, v, each [heads, head_dim]
        self.attn_proj = nn.Linear(h, h, bias=m.use_bias)
        self.fc = nn.Linear(h, f, bias=m.use_bias)
        self.mlp_proj = nn.Linear(f, h, bias=m.use_bias)

    def forward(self, x):
        b, t, h = x.shape
        q, k, v = (z.view(b, t, self.heads, h // self.heads).transpose(1, 2)  # [batch, heads, len, head_dim]
                   for z in self.qkv(self.ln_1(x)).split(h, 2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, h)
        x = x + F.dropout(self.attn_proj(y), self.dropout, self.training)
        y = self.mlp_proj(F.gelu(self.fc(self.ln_2(x)), approximate="tanh"))
        return x + F.dropout(y, self.dropout, self.training)


class GPT(nn.Module):
    """jaxllm's GPT (configs/gpt3.py's architecture) in PyTorch; see the module docstring.

    Args:
      m: the ``model`` section of a resolved jaxllm config (derived sizes filled in:
        ``padded_vocab_size``, ``ffn_hidden_size``, ``max_position_embeddings``).
      recompute: run each layer under ``torch.utils.checkpoint`` (its activations recomputed in the
        backward pass: jaxllm's ``model.remat=full``).
    Raises:
      ValueError: a setting :func:`unsupported` names.
    """

    def __init__(self, m, *, recompute: bool = False):
        super().__init__()
        bad = unsupported(m)
        if bad:
            raise ValueError(f"{bad[0]}={bad[1]!r}: {bad[2]}")
        self.vocab_size, self.recompute, self.dropout = m.vocab_size, recompute, m.dropout
        self.wte = nn.Embedding(m.padded_vocab_size, m.hidden_size)
        self.wpe = nn.Embedding(m.max_position_embeddings, m.hidden_size)
        self.blocks = nn.ModuleList([Block(m) for _ in range(m.num_layers)])
        self.ln_f = nn.LayerNorm(m.hidden_size, m.norm_eps, bias=m.use_bias)
        self.lm_head = None if m.tie_embeddings else nn.Linear(m.hidden_size, m.padded_vocab_size, bias=False)
        self._init(m)

    @torch.no_grad()
    def _init(self, m):
        """jaxllm's initialization (:mod:`jaxllm.model.gpt`): normal(0, init_std) matrices and tables, the
        layers' output projections normal(0, init_std / sqrt(2 x layers)), biases 0, norm scales 1,
        padded vocabulary rows 0 (nothing on the meta device: no values)."""
        if self.wte.weight.is_meta:
            return
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = m.init_std / math.sqrt(2 * m.num_layers) if name.endswith("proj.weight") else m.init_std
                nn.init.normal_(p, 0.0, std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
            else:
                nn.init.ones_(p)
        for table in (self.wte.weight, None if self.lm_head is None else self.lm_head.weight):
            if table is not None:
                table[m.vocab_size:] = 0

    def forward(self, idx, targets):
        """Mean next-token cross entropy (nats, float32 scalar) of int64 ``targets`` ``[batch, len]``
        after int64 ``idx`` ``[batch, len]``, over the ``vocab_size`` real tokens (the padded logits
        excluded, as jaxllm masks them)."""
        x = self.wte(idx) + self.wpe.weight[:idx.shape[1]]
        x = F.dropout(x, self.dropout, self.training)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.recompute else block(x)
        table = self.wte.weight if self.lm_head is None else self.lm_head.weight
        logits = F.linear(self.ln_f(x), table)[..., :self.vocab_size]  # [batch, len, vocab]
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def num_params(model: nn.Module) -> int:
    """Parameters of ``model``, each tensor once (the tied table counted once, as jaxllm counts it)."""
    return sum(p.numel() for p in model.parameters())


def load_jaxllm_params(model: GPT, params: dict) -> None:
    """Copies a jaxllm parameter tree into ``model`` (float32, in place).

    Args:
      model: a :class:`GPT` of the same ``model`` config.
      params: :func:`jaxllm.model.gpt.init`'s nested dict (arrays of any kind numpy can read): ``wte``
        ``[padded_vocab, hidden]``, ``wpe`` ``[positions, hidden]``, ``ln_f/{scale,bias}``, optional
        ``lm_head`` ``[hidden, padded_vocab]``, and ``layers/...`` stacked on a leading ``[layers]``
        axis: ``attn/wq, wk, wv`` ``[hidden, heads, head_dim]``, ``attn/bq, bk, bv`` ``[heads, head_dim]``,
        ``attn/wo`` ``[heads, head_dim, hidden]``, ``attn/bo``, ``mlp/w1`` ``[hidden, ffn]``, ``mlp/b1``,
        ``mlp/w2`` ``[ffn, hidden]``, ``mlp/b2``, ``ln1/{scale,bias}``, ``ln2/{scale,bias}``.
        ``Linear`` weights are ``[out, in]``: jaxllm's matrices are flattened and transposed; q, k, v
        are stacked along the output rows.
    Raises:
      ValueError: a shape that does not match.
    """
    def put(dst: torch.Tensor, value, path: str):
        value = torch.from_numpy(np.array(value, dtype=np.float32))  # a writable float32 copy
        if tuple(value.shape) != tuple(dst.shape):
            raise ValueError(f"{path}: jaxllm's {tuple(value.shape)} does not fit the torch {tuple(dst.shape)}")
        dst.copy_(value.to(dst.device))

    layers = params["layers"]
    with torch.no_grad():
        put(model.wte.weight, params["wte"], "wte")
        put(model.wpe.weight, params["wpe"], "wpe")
        if model.lm_head is not None:
            put(model.lm_head.weight, np.asarray(params["lm_head"]).T, "lm_head")
        _norm(model.ln_f, params["ln_f"], put, "ln_f")
        for i, block in enumerate(model.blocks):
            g = lambda path: np.asarray(_get(layers, path))[i]  # noqa: E731, B023
            h = block.qkv.in_features
            put(block.qkv.weight, np.concatenate([g(f"attn/{w}").reshape(h, -1).T for w in ("wq", "wk", "wv")]),
                f"layers/attn/wq,wk,wv[{i}]")
            put(block.attn_proj.weight, g("attn/wo").reshape(-1, h).T, f"layers/attn/wo[{i}]")
            put(block.fc.weight, g("mlp/w1").T, f"layers/mlp/w1[{i}]")
            put(block.mlp_proj.weight, g("mlp/w2").T, f"layers/mlp/w2[{i}]")
            if block.qkv.bias is not None:
                put(block.qkv.bias, np.concatenate([g(f"attn/{b}").reshape(-1) for b in ("bq", "bk", "bv")]),
                    f"layers/attn/bq,bk,bv[{i}]")
                put(block.attn_proj.bias, g("attn/bo"), f"layers/attn/bo[{i}]")
                put(block.fc.bias, g("mlp/b1"), f"layers/mlp/b1[{i}]")
                put(block.mlp_proj.bias, g("mlp/b2"), f"layers/mlp/b2[{i}]")
            _norm(block.ln_1, {k: v[i] for k, v in layers["ln1"].items()}, put, f"layers/ln1[{i}]")
            _norm(block.ln_2, {k: v[i] for k, v in layers["ln2"].items()}, put, f"layers/ln2[{i}]")


def _get(tree: dict, path: str):
    for key in path.split("/"):
        tree = tree[key]
    return tree


def _norm(norm: nn.LayerNorm, values: dict, put, path: str) -> None:
    put(norm.weight, values["scale"], f"{path}/scale")
    if norm.bias is not None:
        put(norm.bias, values["bias"], f"{path}/bias")


def jaxllm_params(model: GPT, value=None) -> dict:
    """``model``'s parameters as jaxllm's nested dict (the inverse of :func:`load_jaxllm_params`): float32
    numpy arrays of jaxllm's shapes (see there), the layers stacked on a leading ``[layers]`` axis.

    Args:
      value: ``(torch parameter) -> numpy array of its shape``, applied to each parameter before it is
        rearranged (default: its float32 values); e.g. a constant array to see where a parameter lands.
    """
    value = value or (lambda p: p.detach().float().cpu().numpy())
    blocks = model.blocks
    b0 = blocks[0]
    h, heads = b0.qkv.in_features, b0.heads
    d = h // heads

    def stack(fn):
        return np.stack([fn(block) for block in blocks])

    def qkv(block, j, bias=False):
        if bias:
            return value(block.qkv.bias)[j * h:(j + 1) * h].reshape(heads, d)
        return value(block.qkv.weight)[j * h:(j + 1) * h].T.reshape(h, heads, d)

    def norm(ln):
        out = {"scale": value(ln.weight)}
        if ln.bias is not None:
            out["bias"] = value(ln.bias)
        return out

    attn = {w: stack(lambda blk, j=j: qkv(blk, j)) for j, w in enumerate(("wq", "wk", "wv"))}
    attn["wo"] = stack(lambda blk: value(blk.attn_proj.weight).T.reshape(heads, d, h))
    mlp = {"w1": stack(lambda blk: value(blk.fc.weight).T), "w2": stack(lambda blk: value(blk.mlp_proj.weight).T)}
    if b0.qkv.bias is not None:
        attn.update({b: stack(lambda blk, j=j: qkv(blk, j, bias=True)) for j, b in enumerate(("bq", "bk", "bv"))})
        attn["bo"] = stack(lambda blk: value(blk.attn_proj.bias))
        mlp.update(b1=stack(lambda blk: value(blk.fc.bias)), b2=stack(lambda blk: value(blk.mlp_proj.bias)))
    layers = {"attn": attn, "mlp": mlp,
              "ln1": {k: np.stack([norm(blk.ln_1)[k] for blk in blocks]) for k in norm(b0.ln_1)},
              "ln2": {k: np.stack([norm(blk.ln_2)[k] for blk in blocks]) for k in norm(b0.ln_2)}}
    out = {"wte": value(model.wte.weight), "wpe": value(model.wpe.weight), "ln_f": norm(model.ln_f),
           "layers": layers}
    if model.lm_head is not None:
        out["lm_head"] = value(model.lm_head.weight).T
    return out


# ---------------------------------------------------------------------------------------------
# The step
# ---------------------------------------------------------------------------------------------


def make_optimizer(model: nn.Module, t, device: torch.device) -> torch.optim.AdamW:
    """jaxllm's AdamW (:func:`jaxllm.runtime.optim.make_optimizer` for ``train.optimizer=adamw``) at the
    constant learning rate ``t.lr``: ``beta1``, ``beta2``, ``adam_eps``, decoupled weight decay
    ``weight_decay`` on the matrices and tables (``dim >= 2``: jaxllm's decay mask) and none on the
    biases and norm scales; ``fused=True`` on GPUs.

    Args:
      t: the ``train`` section of a resolved config.
    """
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": t.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.adam_eps,
                             fused=device.type == "cuda")


def train_step(forward, params: list, opt, tokens, targets, *, clip: float, dtype: torch.dtype) -> torch.Tensor:
    """One optimizer step over ``tokens``, ``targets`` int64 ``[microbatches, micro_batch, len]``: each
    micro batch's loss (under ``torch.autocast`` in ``dtype`` unless float32) back-propagated with weight
    ``1 / microbatches`` (the gradients accumulate: the mean over the global batch, as jaxllm's), the
    gradients clipped to global norm ``clip`` (0: off), then ``opt.step()``.

    Args:
      forward: the (compiled) model, ``(tokens, targets) -> mean loss``.
      params: the model's parameters (for the clipping).
    Returns:
      The step's mean loss, a float32 scalar on the device (not synchronized).
    """
    n = tokens.shape[0]
    total = torch.zeros((), dtype=torch.float32, device=tokens.device)
    for i in range(n):
        with torch.autocast(tokens.device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss = forward(tokens[i], targets[i])
        (loss / n).backward()
        total += loss.detach()
    if clip > 0:
        torch.nn.utils.clip_grad_norm_(params, clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return total / n


def synthetic_batches(cfg, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``jaxllm.bench``'s two synthetic global batches: ``numpy.random.default_rng(train.seed)`` draws
    int32 tokens ``[global_batch, seq_length + 1]`` uniform in ``[0, model.vocab_size)`` twice; inputs
    are each row's first ``seq_length``, targets its last; row ``r`` goes to micro batch
    ``r % microbatches`` (as jaxllm's ``Run.global_batch``).  Returns two ``(tokens, targets)``, int64
    ``[microbatches, micro_batch_size, seq_length]`` on ``device``."""
    t, n = cfg.train, cfg.microbatches
    rng = np.random.default_rng(t.seed)
    out = []
    for _ in range(2):
        tok = rng.integers(0, cfg.model.vocab_size, (t.global_batch_size, t.seq_length + 1), dtype=np.int32)
        split = lambda a: torch.from_numpy(  # noqa: E731  rows r, r + n, ...: micro batch r
            np.ascontiguousarray(a.reshape(t.micro_batch_size, n, t.seq_length).transpose(1, 0, 2)))
        out.append((split(tok[:, :-1]).long().to(device), split(tok[:, 1:]).long().to(device)))
    return out


def sdpa_backend(m, micro_batch: int, seq: int, device: torch.device, dtype: torch.dtype) -> str:
    """The kernel ``F.scaled_dot_product_attention`` dispatches to for causal attention of these shapes
    (``flash_attention``, ``efficient_attention``, ``cudnn_attention``, ``math``), as PyTorch's dispatcher
    (``torch._fused_sdp_choice``) picks it; ``"unknown"`` if it cannot be asked."""
    try:
        from torch.nn.attention import SDPBackend  # noqa: PLC0415

        q = torch.empty(micro_batch, m.num_attention_heads, seq, m.head_dim, device=device, dtype=dtype)
        return SDPBackend(torch._fused_sdp_choice(q, q, q, None, 0.0, True)).name.lower()
    except Exception:  # noqa: BLE001  a private function of PyTorch: its absence is no error of the benchmark
        return "unknown"


def measure_matmul(device: torch.device, dtype: torch.dtype, n: int, repeats: int = 5) -> float:
    """FLOP/s of the fastest of ``repeats`` ``[n, n] @ [n, n]`` matmuls in ``dtype`` on ``device`` (as
    :func:`jaxllm.platform.hardware.peak_flops_per_device` measures a device PEAK_FLOPS lacks)."""
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    a @ b
    sync()
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        sync()
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def peak_flops(device: torch.device, dtype: str) -> tuple[float, str]:
    """Peak dense FLOP/s of ``device`` in ``dtype`` and its source: jaxllm's datasheet table
    (:func:`jaxllm.platform.hardware.lookup_peak_flops` on the GPU's name, the same key jaxllm matches on
    ``device_kind``), else a measured matmul of jaxllm's size (``hardware.measured_matmul_size``)."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    found = hardware.lookup_peak_flops(name, dtype)
    if found is not None:
        return found[0], f"datasheet PEAK_FLOPS[{found[1]!r}] {dtype}"
    n = hardware.measured_matmul_size("cpu" if device.type == "cpu" else "gpu")
    where = "cpu" if device.type == "cpu" else f"{name!r} (not in PEAK_FLOPS)"
    return measure_matmul(device, DTYPES[dtype], n), f"measured torch matmul on {where} ({n}x{n} {dtype})"


def benchmark(cfg, *, device: torch.device, steps: int = 10, warmup: int = 2, compile: bool = True,
              compile_mode: str | None = None, name: str = "torch") -> dict:
    """Builds the model of ``cfg`` on ``device`` and times its training step; returns one record (the
    JSON line; keys as :func:`jaxllm.bench.benchmark`'s where they apply, see the module docstring).

    Args:
      cfg: a config resolved for one device (:func:`load_config`).
      steps: timed steps (>= 1); warmup: untimed steps after the first (compiling) one (>= 0).
      compile: ``torch.compile`` the model; compile_mode: its ``mode`` (None: the default).
    Returns:
      A dict: times in seconds, throughput in tokens/s, ``tflops_per_device`` in TFLOP/s, ``mfu`` /
      ``hfu`` fractions, ``peak_memory_bytes`` in bytes (with ``peak_memory_source``), ``step_times_s``
      every timed step.
    Raises:
      ValueError: ``steps < 1`` or ``warmup < 0``.
    """
    if steps < 1 or warmup < 0:
        raise ValueError(f"steps={steps}, warmup={warmup}: need steps >= 1 and warmup >= 0")
    m, t = cfg.model, cfg.train
    dtype = DTYPES[m.dtype]
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.set_float32_matmul_precision("high")  # TF32 for float32 matmuls, as XLA's default precision on GPUs
    torch.manual_seed(t.seed)
    with torch.device(device):
        model = GPT(m, recompute=m.remat == "full")
    model.train()
    params = list(model.parameters())
    opt = make_optimizer(model, t, device)
    forward = torch.compile(model, mode=compile_mode) if compile else model
    batches = synthetic_batches(cfg, device)
    backend = sdpa_backend(m, t.micro_batch_size, t.seq_length, device, dtype)
    peak, peak_source = peak_flops(device, m.dtype)

    times, loss = [], float("nan")
    for i in range(1 + warmup + steps):
        if cuda and i == 1 + warmup:
            torch.cuda.reset_peak_memory_stats(device)
        sync()
        start = time.perf_counter()
        loss = train_step(forward, params, opt, *batches[i % 2], clip=t.grad_clip, dtype=dtype).item()
        sync()
        elapsed = time.perf_counter() - start
        if i == 0:
            compile_s = elapsed
        elif i > warmup:
            times.append(elapsed)

    schedule = schedules.schedule_stats(cfg)  # one device: no pipeline (jaxllm.bench's values for it)
    if cuda:
        peak_mem = torch.cuda.max_memory_allocated(device)
        mem_source = "torch.cuda.max_memory_allocated over the timed steps (reset after the warm-up)"
    else:
        peak_mem = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        mem_source = "ru_maxrss: the process's peak resident set, its whole life"
    n = num_params(model)
    triton = sys.modules.get("triton")
    return {
        "name": name,
        "framework": "torch",
        "date": datetime.date.today().isoformat(),
        "platform": "gpu" if cuda else "cpu",  # jax's names for the same devices
        "device_kind": torch.cuda.get_device_name(device) if cuda else "cpu", "devices": 1,
        "mesh": dict(cfg.mesh_shape),
        "num_params": n, "active_params": n,
        "global_batch_size": t.global_batch_size, "micro_batch_size": t.micro_batch_size,
        "microbatches": cfg.microbatches, "seq_length": t.seq_length,
        "tokens_per_step": t.global_batch_size * t.seq_length,
        "remat": m.remat, "attention_impl": f"sdpa ({backend})", "dtype": m.dtype,
        "pipeline_schedule": None, "pipeline_bubble": schedule.bubble, "pipeline_in_flight": schedule.in_flight,
        "pipeline_awaiting_w": schedule.deferred,
        "data": "synthetic",
        "warmup": warmup, "steps": steps, "compile_s": compile_s,
        **flops.step_figures(times, cfg, num_devices=1, peak_flops=peak),
        "peak_flops_per_device": peak, "peak_flops_source": peak_source,
        "peak_memory_bytes": int(peak_mem), "peak_memory_source": mem_source,
        "peak_memory_reserved_bytes": int(torch.cuda.max_memory_reserved(device)) if cuda else None,
        "final_loss": loss, "step_times_s": times,
        "fp8": False,
        "compile": compile, "compile_mode": compile_mode if compile else None,
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "triton": getattr(triton, "__version__", None) if compile else None,
        "python": sys.version.split()[0],
        "config": cfg.to_dict(),
    }


# ---------------------------------------------------------------------------------------------
# Config and CLI
# ---------------------------------------------------------------------------------------------


def load_config(path: str | None, overrides: list[str], *, device: str, recompute: bool = False):
    """The resolved config of ``--config=FILE.py[:KEY]`` (None: jaxllm's defaults) with ``--config.S.K=V``
    ``overrides`` (each parsed as its key's type), for one device of kind ``device`` (``"cuda"`` or
    ``"cpu"``: ``model.dtype="auto"`` resolves as jaxllm resolves it there) and the tokenizer's vocabulary;
    ``recompute`` sets ``model.remat=full``.

    Raises:
      ConfigError: an unknown key, a value of the wrong type, a config that does not resolve, a
        vocabulary that is not known without reading data, or a setting this peer lacks (:func:`unsupported`).
      ValueError: the config file does not load.
    """
    from ml_collections.config_flags import config_flags  # noqa: PLC0415  jaxllm's config-file loader

    path = path or DEFAULT_CONFIG
    if not os.path.isfile(path.split(":", 1)[0]):
        raise config.ConfigError("--config", path, "no such file; give a config file such as configs/gpt3.py:GPT125M")
    try:
        spec = config_flags.ConfigFileFlagParser(name="config").parse(path)
    except Exception as e:  # noqa: BLE001  the file raised while loading: one line
        raise ValueError(f"--config={path}: {cli._file_error(e)}") from None
    if not isinstance(spec, config.Config):
        raise ValueError(f"--config={path}: get_config() returned {type(spec).__name__}, not a jaxllm Config")
    for item in overrides:
        key, eq, value = item.removeprefix("--config.").partition("=")
        if not eq:
            raise config.ConfigError(key, None, "write --config.SECTION.KEY=VALUE")
        config.check_key(key, value)
        config.override(spec, key, value)
    if recompute:
        spec.model.remat = "full"
    vocab = KNOWN_VOCAB_SIZES.get(spec.data.tokenizer)
    if not spec.model.vocab_size and vocab is None:
        raise config.ConfigError("model.vocab_size", 0, f"data.tokenizer={spec.data.tokenizer!r} has no known size "
                                 "without reading the data; set --config.model.vocab_size")
    cfg = resolve(spec, num_devices=1, vocab_size=vocab, backend=device, data_files=False)
    bad = unsupported(cfg.model, cfg.train)
    if bad:
        raise config.ConfigError(*bad)
    return cfg


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The flags of ``argv`` (without the program name) and the ``--config.S.K=V`` overrides."""
    p = argparse.ArgumentParser(prog="benchmarks/torch_reference.py", description=__doc__.splitlines()[0])
    p.add_argument("--config", default=None, help="FILE.py[:KEY], e.g. configs/gpt3.py:GPT1_5B (default: jaxllm's "
                   "defaults); --config.SECTION.KEY=VALUE overrides follow")
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps after the first (compiling) one")
    p.add_argument("--output", default="runs/bench/torch.jsonl", help="JSONL file; one line is appended")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda if there is one")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile the model (default: on for cuda, off for cpu)")
    p.add_argument("--compile-mode", default=None, help="torch.compile's mode (default, reduce-overhead, "
                   "max-autotune, max-autotune-no-cudagraphs); default: torch's")
    p.add_argument("--recompute", action="store_true", help="recompute each layer in the backward pass "
                   "(model.remat=full)")
    p.add_argument("--name", default="torch", help="a label stored in the record")
    args, rest = p.parse_known_args(argv)
    unknown = [a for a in rest if not a.startswith("--config.")]
    if unknown:
        p.error(f"unrecognized arguments: {' '.join(unknown)}")
    return args, rest


def main(argv: list[str]) -> dict:
    """Runs the CLI on ``argv`` (without the program name); returns the record it wrote."""
    args, overrides = parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        if device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device=cuda: PyTorch sees no CUDA device here; use --device=cpu")
        if args.steps < 1 or args.warmup < 0:
            raise ValueError(f"--steps={args.steps}, --warmup={args.warmup}: need steps >= 1 and warmup >= 0")
        cfg = load_config(args.config, overrides, device=device, recompute=args.recompute)
    except config.ConfigError as e:
        cli.fail(e)
    except ValueError as e:
        cli.fail(f"error: {e}")
    compile = device == "cuda" if args.compile is None else args.compile
    r = benchmark(cfg, device=torch.device(device), steps=args.steps, warmup=args.warmup, compile=compile,
                  compile_mode=args.compile_mode, name=args.name)
    r.update(command=shlex.join(["python", "benchmarks/torch_reference.py", *argv]),
             config_file=args.config or "jaxllm/default_config.py", overrides=overrides)
    print(f"{r['name']}: {r['tokens_per_sec']:,.0f} tokens/s, {r['step_time_s']:.4g} s/step, "
          f"{r['tflops_per_device']:.4g} TFLOP/s/device, MFU {100 * r['mfu']:.2f}% HFU {100 * r['hfu']:.2f}%, "
          f"peak {r['peak_memory_bytes'] / 2**30:.3f} GiB/device ({r['peak_memory_source']}), "
          f"compiled in {r['compile_s']:.1f} s [{r['num_params']:,} parameters, {r['attention_impl']}, "
          f"{r['dtype']}, compile {'on' if compile else 'off'}]", flush=True)
    if args.output:
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        with open(args.output, "a", encoding="utf-8") as f:
            f.write(json.dumps(r) + "\n")
        print(f"wrote 1 JSON line to {args.output}")
    return r


if __name__ == "__main__":
    main(sys.argv[1:])
