"""jaxllm's compiled train step against an independent PyTorch implementation, on one machine.

    python benchmarks/vs_pytorch.py [--shapes=shakespeare,default] [--rounds=10] [--steps=10] [--warmup=5] [--threads=N]

Two shapes: nanoGPT's CPU recipe (``configs/shakespeare_char.py``: 4 layers, 128 hidden,
context 64, batch 12, no biases) and the default job's (``python -m jaxllm.train`` with
no flags: 4 layers, 256 hidden, context 128, batch 16, biases), each with jaxllm's
config as it is (dtype included: ``model.dtype="auto"`` is float32 on CPU) against
``benchmarks/shakespeare_torch_reference.py`` (PyTorch eager, float32) with the same
shape, GPT-2's tanh GELU as jaxllm's.

Same model, same start, same batches: jaxllm initializes the parameters and PyTorch
loads them; both train on the same batches (Tiny Shakespeare: characters for the
recipe, UTF-8 bytes for the default job's byte-level vocabulary; rows drawn by one
seeded generator) with the config's AdamW, clipping and learning-rate schedule.
Each side is a long-lived process; they run ``--steps`` steps in turn, ``--rounds``
times, alternating which goes first, while the other waits on a pipe, so that both
see the same machine load.  A block's time runs from its first step's dispatch to
its last step's completion (jaxllm dispatches asynchronously, as the training loop
does).  Printed per shape: each side's median ms/step, the tokens/s ratio
jaxllm / PyTorch of every round (median, and min-max), the machine's load average,
and the loss check:

* step 1: the two losses of the same parameters on the same batch agree to 1e-5
  (relative): the same function;
* after all steps: the mean loss of the last 10 steps agrees to 1% (relative): the
  same training, up to float32 rounding that the optimizer amplifies.

``--threads=1`` runs both sides on one thread (``torch.set_num_threads(1)``; XLA's CPU client
with ``--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1``): a comparison of
the compiled code alone that a loaded machine distorts less (a multi-threaded step waits for
its slowest thread, and PyTorch's OpenMP workers spin while they wait).

Exit code 1 if a loss check fails.  Needs the test extra (torch).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from jaxllm.resolve import resolve

ROOT = Path(__file__).resolve().parents[1]
TEXT = ROOT / "tests" / "data" / "tinyshakespeare.txt"  # shipped with the repository (public domain)
SHAPES = {"shakespeare": "configs/shakespeare_char.py", "default": "jaxllm/default_config.py"}
SEED = 0


def cpu_model() -> str:
    """The CPU's name and x86 family/model from ``/proc/cpuinfo`` (machines of one kind differ:
    an "AMD EPYC" may be any generation); "unknown" where there is no such file."""
    try:
        lines = Path("/proc/cpuinfo").read_text().split("\n\n")[0].splitlines()
    except OSError:
        return "unknown"
    info = dict(line.split(":", 1) for line in lines if ":" in line)
    info = {k.strip(): v.strip() for k, v in info.items()}
    return f"{info.get('model name', '?')}, family {info.get('cpu family', '?')} model {info.get('model', '?')}"


def tokens_for(shape: str) -> tuple[np.ndarray, int]:
    """The token stream of a shape and its vocabulary: Tiny Shakespeare as characters (nanoGPT's
    sorted set) or as UTF-8 bytes (256)."""
    text = TEXT.read_text()
    if shape == "shakespeare":
        chars = sorted(set(text))
        index = {c: i for i, c in enumerate(chars)}
        return np.array([index[c] for c in text], dtype=np.int32), len(chars)
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32), 256


def batches(tokens: np.ndarray, n: int, batch: int, context: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` batches ``[n, batch, context]`` of inputs and targets from the first 90% of ``tokens``."""
    train = tokens[:int(len(tokens) * 0.9)]
    starts = np.random.default_rng(SEED).integers(0, len(train) - context - 1, (n, batch))
    rows = starts[..., None] + np.arange(context + 1)
    return train[rows[..., :-1]], train[rows[..., 1:]]


# ----- the jaxllm side ------------------------------------------------------------------------

def load_config(path: Path):
    """``get_config()`` of a jaxllm config file."""
    import importlib.util  # noqa: PLC0415

    module_spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.get_config()


def jax_worker(shape: str, total: int, init_path: str):
    from jaxllm.platform import host_memory  # noqa: PLC0415

    host_memory.keep_freed_memory()  # as python -m jaxllm.train does on CPUs, before XLA's threads start
    import jax  # noqa: PLC0415

    from jaxllm.runtime import optim  # noqa: PLC0415
    from jaxllm.runtime.run import Run  # noqa: PLC0415

    tokens, vocab = tokens_for(shape)
    spec = load_config(ROOT / SHAPES[shape])
    cfg = resolve(spec, num_devices=1, vocab_size=vocab)
    m, t = cfg.model, cfg.train
    if m.padded_vocab_size != m.vocab_size:
        raise SystemExit(f"{shape}: padded vocabulary {m.padded_vocab_size} != {m.vocab_size}; "
                         "the PyTorch model has no padding")
    run = Run(cfg)
    state = run.initial_state()
    params = jax.device_get(state["params"])
    flat = {"/".join(str(k.key) for k in path): np.asarray(v)
            for path, v in jax.tree_util.tree_flatten_with_path(params)[0]}
    schedule = optim.lr_schedule(t)
    meta = {"layers": m.num_layers, "heads": m.num_attention_heads, "hidden": m.hidden_size,
            "context": t.seq_length, "batch": t.global_batch_size, "vocab": m.vocab_size, "bias": m.use_bias,
            "dtype": m.dtype, "betas": [t.beta1, t.beta2], "eps": t.adam_eps, "weight_decay": t.weight_decay,
            "clip": t.grad_clip, "lr": [float(schedule(i)) for i in range(total)]}
    np.savez(init_path, meta=json.dumps(meta), **flat)
    x, y = batches(tokens, total, t.global_batch_size, t.seq_length)
    data = [run.global_batch(x[i], y[i]) for i in range(total)]
    step = run.train_step.lower(state, *data[0]).compile()
    holder = {"state": state}

    def train(i):
        holder["state"], m = step(holder["state"], *data[i])
        return m["loss"]

    serve(train, lambda losses: jax.block_until_ready((holder["state"], losses[-1])),
          lambda losses: jax.device_get(losses))


def serve(train, sync, fetch):
    """A worker's command loop: ``{"run": K}`` -> seconds for K more steps (``train(i)`` -> loss of
    step ``i``; ``sync(losses)`` waits for them); ``{"losses": 1}`` -> all losses (``fetch(losses)``)."""
    losses = []
    reply({"ready": True})
    for line in sys.stdin:
        cmd = json.loads(line)
        if "run" in cmd:
            t0 = time.perf_counter()
            for _ in range(cmd["run"]):
                losses.append(train(len(losses)))
            sync(losses)
            reply({"seconds": time.perf_counter() - t0})
        else:
            reply({"losses": [float(v) for v in fetch(losses)]})
            return


def reply(obj):
    print(json.dumps(obj), flush=True)


# ----- the PyTorch side -----------------------------------------------------------------------

def torch_worker(shape: str, total: int, init_path: str, threads: int = 0):
    import torch  # noqa: PLC0415

    if threads == 1:
        torch.set_num_threads(1)
    sys.path.insert(0, str(Path(__file__).parent))
    import shakespeare_torch_reference as ref  # noqa: PLC0415

    init = np.load(init_path)
    meta = json.loads(str(init["meta"]))
    s = ref.Shape(**{k: meta[k] for k in ("layers", "heads", "hidden", "context", "batch", "vocab", "bias")},
                  gelu="tanh")
    model = ref.GPT(s)
    load_jaxllm_params(model, init, s)
    opt = ref.make_optimizer(model, betas=tuple(meta["betas"]), weight_decay=meta["weight_decay"])
    for group in opt.param_groups:
        group["eps"] = meta["eps"]
    x, y = batches(tokens_for(shape)[0], total, s.batch, s.context)
    x, y = torch.from_numpy(x.astype(np.int64)), torch.from_numpy(y.astype(np.int64))
    serve(lambda i: ref.train_step(model, opt, x[i], y[i], meta["lr"][i], clip=meta["clip"]),
          lambda losses: None, lambda losses: losses)


def load_jaxllm_params(model, init, s):
    """Copies jaxllm's parameters (``layers/attn/wq`` ``[layers, embed, heads, head_dim]`` ...) into the
    PyTorch modules (``Linear`` weights are ``[out, in]``)."""
    import torch  # noqa: PLC0415

    e = s.hidden
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a))  # noqa: E731
    with torch.no_grad():
        model.wte.weight.copy_(t(init["wte"]))
        model.wpe.weight.copy_(t(init["wpe"][:s.context]))
        model.ln_f.weight.copy_(t(init["ln_f/scale"]))
        for i, block in enumerate(model.blocks):
            g = lambda name: init[f"layers/{name}"][i]  # noqa: E731, B023
            block.ln_1.weight.copy_(t(g("ln1/scale")))
            block.ln_2.weight.copy_(t(g("ln2/scale")))
            block.qkv.weight.copy_(t(np.concatenate([g(f"attn/{w}").reshape(e, e).T for w in ("wq", "wk", "wv")])))
            block.attn_proj.weight.copy_(t(g("attn/wo").reshape(e, e).T))
            block.fc.weight.copy_(t(g("mlp/w1").T))
            block.mlp_proj.weight.copy_(t(g("mlp/w2").T))
            if s.bias:
                block.ln_1.bias.copy_(t(g("ln1/bias")))
                block.ln_2.bias.copy_(t(g("ln2/bias")))
                block.qkv.bias.copy_(t(np.concatenate([g(f"attn/{b}").reshape(e) for b in ("bq", "bk", "bv")])))
                block.attn_proj.bias.copy_(t(g("attn/bo")))
                block.fc.bias.copy_(t(g("mlp/b1")))
                block.mlp_proj.bias.copy_(t(g("mlp/b2")))
        if s.bias:
            model.ln_f.bias.copy_(t(init["ln_f/bias"]))


# ----- the driver -----------------------------------------------------------------------------

class Worker:
    def __init__(self, kind, shape, total, init_path, threads=0):
        cmd = [sys.executable, __file__, f"--worker={kind}", f"--shape={shape}", f"--total={total}",
               f"--init={init_path}", f"--threads={threads}"]
        self.kind = kind
        env = {**os.environ, "JAX_PLATFORMS": "cpu"}
        if threads == 1:
            env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false"
                                " intra_op_parallelism_threads=1").strip()
        self.p = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.read()

    def read(self):
        line = self.p.stdout.readline()
        if not line:
            raise SystemExit(f"the {self.kind} worker ended (exit code {self.p.wait()})")
        return json.loads(line)

    def ask(self, cmd):
        self.p.stdin.write(json.dumps(cmd) + "\n")
        self.p.stdin.flush()
        return self.read()

    def close(self):
        self.p.stdin.close()
        self.p.wait()


def compare(shape: str, rounds: int, steps: int, warmup: int, threads: int = 0) -> bool:
    total = warmup + rounds * steps
    with tempfile.TemporaryDirectory() as tmp:
        init_path = os.path.join(tmp, "init.npz")
        jx = Worker("jax", shape, total, init_path, threads)
        meta = json.loads(str(np.load(init_path)["meta"]))
        pt = Worker("torch", shape, total, init_path, threads)
        load = [os.getloadavg()[0]]
        for w in (jx, pt):
            w.ask({"run": warmup})
        times = {"jax": [], "torch": []}
        for r in range(rounds):
            for w in ((jx, pt) if r % 2 == 0 else (pt, jx)):
                times[w.kind].append(w.ask({"run": steps})["seconds"] / steps)
        load.append(os.getloadavg()[0])
        losses = {w.kind: w.ask({"losses": 1})["losses"] for w in (jx, pt)}
        for w in (jx, pt):
            w.close()
    tokens = meta["batch"] * meta["context"]
    ratio = np.array(times["torch"]) / np.array(times["jax"])
    print(f"\n{shape}: {meta['layers']} layers, hidden {meta['hidden']}, context {meta['context']}, batch "
          f"{meta['batch']}, vocab {meta['vocab']}, jaxllm {meta['dtype']} vs PyTorch float32; {rounds} rounds x "
          f"{steps} steps after {warmup} warm-up, {threads or 'default'} thread(s); "
          f"load average {load[0]:.2f} -> {load[1]:.2f}")
    for kind in ("jax", "torch"):
        t = np.array(times[kind])
        print(f"  {'jaxllm ' if kind == 'jax' else 'PyTorch'} {1e3 * np.median(t):7.1f} ms/step (median; "
              f"{1e3 * t.min():.1f}-{1e3 * t.max():.1f}), {tokens / np.median(t):8,.0f} tokens/s")
    print(f"  tokens/s jaxllm / PyTorch: {np.median(ratio):.2f}x median of {rounds} rounds "
          f"(min {ratio.min():.2f}x, max {ratio.max():.2f}x)")
    a, b = np.array(losses["jax"]), np.array(losses["torch"])
    first = abs(a[0] - b[0]) / b[0]
    last = abs(a[-10:].mean() - b[-10:].mean()) / b[-10:].mean()
    ok = first < 1e-5 and last < 1e-2
    print(f"  loss step 1: jaxllm {a[0]:.6f}, PyTorch {b[0]:.6f} (relative difference {first:.1e}; must be < 1e-5)")
    print(f"  loss, mean of steps {max(1, total - 9)}-{total}: jaxllm {a[-10:].mean():.4f}, "
          f"PyTorch {b[-10:].mean():.4f} "
          f"(relative difference {last:.1e}; must be < 1e-2); largest per-step difference "
          f"{np.max(np.abs(a - b) / b):.1e}")
    print(f"  loss check: {'ok' if ok else 'FAILED'}")
    return ok


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="shakespeare,default")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--steps", type=int, default=10, help="steps per side and round")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps per side first")
    p.add_argument("--threads", type=int, default=0, choices=(0, 1), help="1: both sides on one thread; 0: defaults")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--shape", help=argparse.SUPPRESS)
    p.add_argument("--total", type=int, help=argparse.SUPPRESS)
    p.add_argument("--init", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        if a.worker == "jax":
            jax_worker(a.shape, a.total, a.init)
        else:
            torch_worker(a.shape, a.total, a.init, a.threads)
        return
    shapes = a.shapes.split(",")
    for s in shapes:
        if s not in SHAPES:
            p.error(f"--shapes: {s!r} is not one of {', '.join(SHAPES)}")
    print(f"{time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPUs ({cpu_model()}); "
          f"uptime: {os.popen('uptime').read().strip()}")
    ok = [compare(s, a.rounds, a.steps, a.warmup, a.threads) for s in shapes]
    sys.exit(0 if all(ok) else 1)


if __name__ == "__main__":
    main()
