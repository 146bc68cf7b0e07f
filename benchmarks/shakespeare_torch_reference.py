"""An independent PyTorch implementation of nanoGPT's CPU Tiny Shakespeare recipe, for comparison.

    python benchmarks/shakespeare_torch_reference.py --seed 0

The recipe of ``configs/shakespeare_char.py`` (nanoGPT's README, "I only have a
macbook"): 4 layers, 4 heads, 128 hidden, context 64, batch 12, 2000 iterations,
AdamW (0.9, 0.99) lr 1e-3 -> 1e-4 cosine after 100 warmup, weight decay 0.1 on
matrices and embeddings, clip 1.0, no biases, no dropout, tied embeddings, init
normal(0.02) with the output projections scaled by 1/sqrt(2L).  Prints the
validation loss after 2000 steps over 200 random validation batches: the same
measure jaxllm logs, so the two can be compared seed for seed on one machine.
Needs the test extra (torch).

The model and step are also importable with another shape (:class:`Shape`; e.g. the
default jaxllm job's, with biases), as ``benchmarks/vs_pytorch.py`` uses them.
"""

import argparse
import dataclasses
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


@dataclasses.dataclass(frozen=True)
class Shape:
    """A GPT-2-style model and batch: pre-norm LayerNorm, GELU MLP of 4 x hidden, tied embeddings."""

    layers: int = 4
    heads: int = 4
    hidden: int = 128
    context: int = 64
    batch: int = 12
    vocab: int = 65
    bias: bool = False  # biases in every Linear and LayerNorm
    gelu: str = "none"  # torch's F.gelu approximate=: "none" (erf, nanoGPT's) or "tanh" (GPT-2's, jaxllm's)


RECIPE = Shape()
ITERS, WARMUP, LR, MIN_LR = 2000, 100, 1e-3, 1e-4


class LayerNorm(nn.Module):
    def __init__(self, s: Shape):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(s.hidden))
        self.bias = nn.Parameter(torch.zeros(s.hidden)) if s.bias else None

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class Block(nn.Module):
    def __init__(self, s: Shape):
        super().__init__()
        self.s = s
        self.ln_1, self.ln_2 = LayerNorm(s), LayerNorm(s)
        self.qkv = nn.Linear(s.hidden, 3 * s.hidden, bias=s.bias)
        self.attn_proj = nn.Linear(s.hidden, s.hidden, bias=s.bias)
        self.fc = nn.Linear(s.hidden, 4 * s.hidden, bias=s.bias)
        self.mlp_proj = nn.Linear(4 * s.hidden, s.hidden, bias=s.bias)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.s.heads, c // self.s.heads).transpose(1, 2)
                   for z in self.qkv(self.ln_1(x)).split(c, 2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.attn_proj(y)
        return x + self.mlp_proj(F.gelu(self.fc(self.ln_2(x)), approximate=self.s.gelu))


class GPT(nn.Module):
    def __init__(self, s: Shape = RECIPE):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(s.vocab, s.hidden), nn.Embedding(s.context, s.hidden)
        self.blocks = nn.ModuleList([Block(s) for _ in range(s.layers)])
        self.ln_f = LayerNorm(s)
        self.lm_head = nn.Linear(s.hidden, s.vocab, bias=False)
        self.wte.weight = self.lm_head.weight
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, 0.0, 0.02)
                if isinstance(m, nn.Linear) and m.bias is not None:
                    nn.init.zeros_(m.bias)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * s.layers))

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def make_optimizer(model, lr=LR, betas=(0.9, 0.99), weight_decay=0.1):
    """AdamW with weight decay on the matrices and embeddings (dim >= 2), none on norms and biases."""
    params = list(model.parameters())
    return torch.optim.AdamW([{"params": [q for q in params if q.dim() >= 2], "weight_decay": weight_decay},
                              {"params": [q for q in params if q.dim() < 2], "weight_decay": 0.0}],
                             lr=lr, betas=betas)


def train_step(model, opt, x, y, lr, clip=1.0):
    """One AdamW step at learning rate ``lr`` with global-norm clipping; returns the loss (a tensor)."""
    for group in opt.param_groups:
        group["lr"] = lr
    loss = model(x, y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    return loss.detach()


def lr_at(it, iters=ITERS):
    if it < WARMUP:
        return LR * (it + 1) / (WARMUP + 1)
    return MIN_LR + 0.5 * (1 + math.cos(math.pi * (it - WARMUP) / (iters - WARMUP))) * (LR - MIN_LR)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--iters", type=int, default=ITERS, help="training steps (the recipe's: 2000; the schedule follows)")
    p.add_argument("--data", default=str(Path(__file__).resolve().parents[1] / "tests/data/tinyshakespeare.txt"))
    args = p.parse_args()
    torch.manual_seed(args.seed)
    text = Path(args.data).read_text()
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    data = np.array([index[c] for c in text], dtype=np.int64)
    split = int(len(data) * 0.9)
    train, val = data[:split], data[split:]
    s = dataclasses.replace(RECIPE, vocab=len(chars))

    def batch(d):
        ix = torch.randint(len(d) - s.context, (s.batch,))
        return (torch.stack([torch.from_numpy(d[i:i + s.context]) for i in ix]),
                torch.stack([torch.from_numpy(d[i + 1:i + 1 + s.context]) for i in ix]))

    model = GPT(s)
    opt = make_optimizer(model)
    t0 = time.time()
    for it in range(args.iters):
        train_step(model, opt, *batch(train), lr_at(it, max(args.iters, WARMUP + 1)))
    model.eval()
    with torch.no_grad():
        val_loss = float(np.mean([model(*batch(val)).item() for _ in range(200)]))
    print(f"seed {args.seed}: val loss {val_loss:.4f} after {args.iters} steps ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
