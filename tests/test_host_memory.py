"""jaxllm.platform.host_memory: a block freed and allocated again costs no page faults, in any thread."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Allocates, touches and frees 64 MiB three times in a fresh thread each time (as XLA's worker
# threads do) and prints the minor page faults of the last two rounds; with the settings applied
# first (argv[1] == "keep").
FAULTS = r"""
import ctypes, resource, sys, threading
if sys.argv[1] == "keep":
    from jaxllm.platform import host_memory
    assert host_memory.keep_freed_memory()
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
size = 64 << 20
def touch():
    p = libc.malloc(size)
    ctypes.memset(p, 1, size)
    libc.free(ctypes.c_void_p(p))
faults = []
for _ in range(3):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t = threading.Thread(target=touch)
    t.start(); t.join()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(sum(faults[1:]))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_freed_memory_is_reused_without_page_faults():
    def faults(mode):
        r = subprocess.run([sys.executable, "-c", FAULTS, mode], cwd=ROOT, capture_output=True, text=True, timeout=60,
                           env={**os.environ, "JAX_PLATFORMS": "cpu"})  # a CPU process, also on a GPU machine
        assert r.returncode == 0, r.stderr
        return int(r.stdout)

    pages = 2 * (64 << 20) // 4096  # two rounds of 64 MiB in 4 KiB pages
    assert faults("default") > pages / 2  # the control: glibc maps and zeroes the block again each round
    assert faults("keep") < pages / 100
