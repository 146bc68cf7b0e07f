"""Start-up time of a blend of many small indexed datasets: the first start (indices built and
cached) and the second (read from the cache), each in a fresh process.

    python benchmarks/data_startup.py --datasets=1000

writes ``--datasets`` datasets of ``--documents`` random documents each (100-2,000 byte-range
tokens) and an ALCF data-file list with random weights under ``--dir`` (made once), then times
``jaxllm.data.loader.Data`` for a GPT-3-like run (sequence 2048, global batch 512, 2,000 steps, an
evaluation of 10 batches every 500) twice with an empty index cache at first.
"""

import argparse
import os
import shutil
import subprocess
import sys
import time

import numpy as np

from jaxllm.data.indexed import IndexedWriter

TIME_ONE = """
import sys, time
t0 = time.perf_counter()
from jaxllm.config import get_config
from jaxllm.data.loader import Data
cfg = get_config()
cfg.data.update(file_list=sys.argv[1], cache_dir=sys.argv[2], tokenizer="byte")
cfg.train.update(seq_length=2048, global_batch_size=512, micro_batch_size=512, train_iters=2000, eval_interval=500,
                 eval_iters=10)
t1 = time.perf_counter()
d = Data(cfg, sys.argv[2])
t2 = time.perf_counter()
print(f"{'built' if d.index_built else 'read'}: Data() {t2 - t1:.2f} s (of which indices {d.index_seconds:.2f} s), "
      f"imports {t1 - t0:.2f} s; {d.split_length('train'):,} train / {d.split_length('valid'):,} valid samples")
"""


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--datasets", type=int, default=1000)
    p.add_argument("--documents", type=int, default=20)
    p.add_argument("--dir", default="runs/data_startup")
    args = p.parse_args()
    root = os.path.abspath(os.path.join(args.dir, f"{args.datasets}x{args.documents}"))
    listing = os.path.join(root, "file_list.txt")
    if not os.path.isfile(listing):
        os.makedirs(root, exist_ok=True)
        rng = np.random.default_rng(0)
        lines = []
        for i in range(args.datasets):
            prefix = os.path.join(root, f"part{i:05d}")
            w = IndexedWriter(prefix + ".bin", prefix + ".idx", np.uint16)
            for n in rng.integers(100, 2000, args.documents):
                w.add_document(rng.integers(0, 256, n))
            w.finish()
            lines.append(f"{rng.random() + 0.01:.6f} {prefix} corpus{i % 7}\n")
        with open(listing + ".tmp", "w") as f:
            f.writelines(lines)
        os.replace(listing + ".tmp", listing)
    cache = os.path.join(root, "index-cache")
    shutil.rmtree(cache, ignore_errors=True)
    for start in ("first", "second"):
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, "-c", TIME_ONE, listing, cache], capture_output=True, text=True)
        if r.returncode:
            sys.exit(r.stderr)
        print(f"{start} start: {r.stdout.strip()}; process {time.perf_counter() - t0:.2f} s")


if __name__ == "__main__":
    main()
