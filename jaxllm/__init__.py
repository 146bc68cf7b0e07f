"""jaxllm: GPT training in JAX, and its public API for other programs.

    import jaxllm

    run = jaxllm.load("runs/default")          # a trained run: config, params, tokenizer
    run.logits(tokens), run.score(text), run.generate(prompt)
    jaxllm.shardings(run.config, jaxllm.make_mesh(run.config))   # the parameters' layout

The names of :data:`__all__` are imported on first use (PEP 562), so ``import jaxllm`` imports
no JAX: the command-line tools (``python -m jaxllm.train``, ...) set the GPU's XLA flags and
environment before JAX starts.  The API is :mod:`jaxllm.api`; the subpackages are ``model``
(the GPT), ``parallel`` (the mesh and the one rules table, :mod:`jaxllm.parallel.sharding`),
``runtime`` (a run's compiled steps, optimizer, checkpoints, sampling), ``platform`` (devices,
multi-process jobs, GPU settings), ``data`` (tokenizers, datasets, batches); ``config`` is the
config schema and ``resolve`` its one resolution step (``jaxllm.resolve.resolve(config,
num_devices=...)``).
"""

import importlib as _importlib

# name -> the module that defines it (a submodule's name maps to itself)
_LAZY = {
    "load": "jaxllm.api",
    "TrainedModel": "jaxllm.api",
    "shardings": "jaxllm.api",
    "optimizer_shardings": "jaxllm.api",
    "make_mesh": "jaxllm.api",
    "RULES": "jaxllm.api",
    "rules": "jaxllm.api",
    "Config": "jaxllm.config",
    "Resolved": "jaxllm.config",
    "get_config": "jaxllm.config",
    "ConfigError": "jaxllm.errors",
    "DataError": "jaxllm.errors",
    "CheckpointError": "jaxllm.runtime.checkpoint",
    **{name: f"jaxllm.{name}" for name in ("api", "config", "resolve", "model", "parallel", "runtime", "platform",
                                           "data")},
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'jaxllm' has no attribute {name!r}")
    value = _importlib.import_module(module)
    if module != f"jaxllm.{name}":  # a submodule's import has set the attribute itself
        value = getattr(value, name)
        globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
