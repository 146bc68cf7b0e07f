"""Session settings for the tests, set before anything imports jax.

XLA's CPU backend compiles without LLVM's optimization passes: the tests' models are tiny,
so they spend their time compiling, not running, and this cuts it by about a fifth
(measured on a layout run: 30.4 s -> 23.8 s). The subprocesses the tests start inherit it.
Results agree with an optimized build to float rounding; every comparison in the suite is
between runs made with the same setting.  The few tests that run many steps of a larger
model (bfloat16 on CPU is emulated in generated code, which -O0 slows) start their
subprocesses with :func:`optimized_env`.
"""

import os

O0 = "--xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = " ".join(filter(None, [os.environ.get("XLA_FLAGS"), O0]))


def optimized_env(env: dict) -> dict:
    """``env`` with XLA's optimizations back on."""
    return {**env, "XLA_FLAGS": " ".join(f for f in env.get("XLA_FLAGS", "").split() if f != O0)}
