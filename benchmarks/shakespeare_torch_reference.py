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
"""

import argparse
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

LAYERS, HEADS, HIDDEN, CONTEXT, BATCH, ITERS, WARMUP = 4, 4, 128, 64, 12, 2000, 100
LR, MIN_LR = 1e-3, 1e-4


class LayerNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(HIDDEN))

    def forward(self, x):
        return F.layer_norm(x, (HIDDEN,), self.weight, None, 1e-5)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.ln_2 = LayerNorm(), LayerNorm()
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN, bias=False)
        self.attn_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.fc = nn.Linear(HIDDEN, 4 * HIDDEN, bias=False)
        self.mlp_proj = nn.Linear(4 * HIDDEN, HIDDEN, bias=False)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (z.view(b, t, HEADS, c // HEADS).transpose(1, 2) for z in self.qkv(self.ln_1(x)).split(c, 2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.attn_proj(y)
        return x + self.mlp_proj(F.gelu(self.fc(self.ln_2(x))))


class GPT(nn.Module):
    def __init__(self, vocab):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, HIDDEN), nn.Embedding(CONTEXT, HIDDEN)
        self.blocks = nn.ModuleList([Block() for _ in range(LAYERS)])
        self.ln_f = LayerNorm()
        self.lm_head = nn.Linear(HIDDEN, vocab, bias=False)
        self.wte.weight = self.lm_head.weight
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, 0.0, 0.02)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * LAYERS))

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def lr_at(it, iters=ITERS):
    if it < WARMUP:
        return LR * (it + 1) / (WARMUP + 1)
    return MIN_LR + 0.5 * (1 + math.cos(math.pi * (it - WARMUP) / (iters - WARMUP))) * (LR - MIN_LR)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--iters", type=int, default=ITERS, help="training steps (the recipe's: 2000; the schedule follows)")
    p.add_argument("--data", default=str(Path(__file__).resolve().parents[2] / "shared/data/tinyshakespeare.txt"))
    args = p.parse_args()
    torch.manual_seed(args.seed)
    text = Path(args.data).read_text()
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    data = np.array([index[c] for c in text], dtype=np.int64)
    split = int(len(data) * 0.9)
    train, val = data[:split], data[split:]

    def batch(d):
        ix = torch.randint(len(d) - CONTEXT, (BATCH,))
        return (torch.stack([torch.from_numpy(d[i:i + CONTEXT]) for i in ix]),
                torch.stack([torch.from_numpy(d[i + 1:i + 1 + CONTEXT]) for i in ix]))

    model = GPT(len(chars))
    params = list(model.parameters())
    opt = torch.optim.AdamW([{"params": [q for q in params if q.dim() >= 2], "weight_decay": 0.1},
                             {"params": [q for q in params if q.dim() < 2], "weight_decay": 0.0}],
                            lr=LR, betas=(0.9, 0.99))
    t0 = time.time()
    for it in range(args.iters):
        for group in opt.param_groups:
            group["lr"] = lr_at(it, max(args.iters, WARMUP + 1))
        loss = model(*batch(train))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
    model.eval()
    with torch.no_grad():
        val_loss = float(np.mean([model(*batch(val)).item() for _ in range(200)]))
    print(f"seed {args.seed}: val loss {val_loss:.4f} after {args.iters} steps ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
