"""JAX's persistent compilation cache for a run (``train.compile_cache_dir``), and whether a compile hit it.

A restart compiles the same programs again: the train step, the evaluation, the initialization.
With the cache, process 0 writes each compiled program (those that took at least
``train.compile_cache_min_compile_s``) to the directory, and a later process with the same
program, JAX, XLA flags and devices reads it instead of compiling. On GPUs JAX also keeps XLA's
per-fusion autotuning results there (``jax_persistent_cache_enable_xla_caches``). The cache is
trusted: a directory others can write lets them run code in your jobs.

:func:`use` turns the cache on for a block (restoring JAX's settings after it, so that one
process may train several runs); :class:`Hits` counts JAX's cache events during a block.
"""

from __future__ import annotations

import contextlib
import os

import jax
from jax.experimental.compilation_cache import compilation_cache

from jaxllm import config

_CACHE_EVENTS = {"/jax/compilation_cache/compile_requests_use_cache": "requests",
                 "/jax/compilation_cache/cache_hits": "hits"}


def directory(configured: str, workdir: str) -> str | None:
    """The cache directory of ``train.compile_cache_dir=configured``: under ``workdir`` when relative; None
    (jaxllm sets none: JAX's own settings apply) when ``""``, or when it is the default and the environment
    has ``JAX_COMPILATION_CACHE_DIR``: a cache chosen for every JAX program (a cluster's, a test suite's) is
    used as JAX uses it, with JAX's ``JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS``."""
    if not configured or (configured == config.Train.compile_cache_dir and os.environ.get("JAX_COMPILATION_CACHE_DIR")):
        return None
    return os.path.abspath(os.path.join(workdir, os.path.expanduser(configured)))


@contextlib.contextmanager
def use(path: str | None, min_compile_s: float):
    """JAX's persistent compilation cache in ``path`` (None: JAX's settings untouched) during the block.

    Raises:
      OSError: ``path`` cannot be created.
    """
    if path is None:
        yield
        return
    os.makedirs(path, exist_ok=True)
    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")
    before = {n: getattr(jax.config, n) for n in names}
    compilation_cache.reset_cache()  # a cache opened earlier in this process stays open otherwise
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_s))
    try:
        yield
    finally:
        compilation_cache.reset_cache()
        for n, v in before.items():
            jax.config.update(n, v)


class Hits:
    """Counts the persistent-cache lookups and hits of the compiles inside ``with Hits() as h:``.

    ``h.state``: ``"hit"`` (every lookup found its program), ``"miss"`` (at least one was compiled),
    or ``"off"`` (no cache directory, or a backend that cannot serialize its programs); ``h.directory``:
    the cache directory (``train.compile_cache_dir`` or JAX's own ``JAX_COMPILATION_CACHE_DIR``), or None.
    """

    def __init__(self):
        self.requests = self.hits = 0
        self.directory = None

    def _listen(self, event: str, **_):
        name = _CACHE_EVENTS.get(event)
        if name:
            setattr(self, name, getattr(self, name) + 1)

    def __enter__(self) -> Hits:
        enabled = jax.config.jax_enable_compilation_cache and jax.config.jax_compilation_cache_dir
        self.directory = jax.config.jax_compilation_cache_dir if enabled else None
        jax.monitoring.register_event_listener(self._listen)
        return self

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_listener(self._listen)

    @property
    def state(self) -> str:
        if not self.requests or self.directory is None:  # JAX looks up keys even without a directory
            return "off"
        return "hit" if self.hits == self.requests else "miss"
