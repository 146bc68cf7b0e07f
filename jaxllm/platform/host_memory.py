"""Host memory for XLA:CPU's buffers: the process keeps the memory it frees instead of faulting it in again.

XLA:CPU takes each execution's temporary buffer and outputs, and its ops' scratch space, from
``malloc``.  glibc serves a large request with fresh ``mmap`` pages that it unmaps on ``free``
(above its mmap threshold: at most 32 MiB), gives each thread that allocates an arena of its own
whose extra heaps it unmaps once they are empty, and returns freed memory at the top of a heap to
the kernel.  Each train step then touches tens to hundreds of MiB that the kernel maps and zeroes
again, one page fault per 4 KiB page.  On the 2-core development machine 35 steps of the default
job's shape (and their compilation) took 2.5 million page faults, 0.45 million with the settings
below, which also made the step 13% faster (docs/performance.md).

:func:`keep_freed_memory` sets glibc's ``mallopt`` (``man 3 mallopt``) so that freed memory stays
with the process: ``M_ARENA_MAX=1`` (one heap for every thread), ``M_MMAP_MAX=0`` (blocks come
from the heap, not from ``mmap``), ``M_TRIM_THRESHOLD`` at its maximum (freed memory is not
returned), ``M_TOP_PAD`` 64 MiB (the heap grows in large steps).  The cost: the process holds its
peak host memory until it exits, as a caching allocator does.  It must run before XLA starts its
threads (a thread keeps the arena it has): ``python -m jaxllm.train``, ``bench`` and ``tune`` call it
before JAX starts a backend; it acts on machines without GPUs only (decided as
:func:`jaxllm.platform.gpu_env.apply` decides), GPU runs leave the host allocator alone.  With a C
library other than glibc nothing changes.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform

from jaxllm.platform.distributed import gpu_vendor

# mallopt parameters (glibc's malloc.h).
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_MAX, M_ARENA_MAX = -1, -2, -4, -8
SETTINGS = ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, 2**31 - 1), (M_TOP_PAD, 64 << 20))


@functools.cache
def keep_freed_memory() -> bool:
    """Applies :data:`SETTINGS` to this process's glibc allocator (once), on a machine without GPUs.

    Returns:
      True if glibc accepted every setting; False on a GPU machine (``JAX_PLATFORMS`` or the
      device files, :func:`jaxllm.platform.distributed.gpu_vendor`), on another C library, or if one was refused.
    """
    if gpu_vendor(os.environ) is not None or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)
    return all(libc.mallopt(param, value) == 1 for param, value in SETTINGS)
