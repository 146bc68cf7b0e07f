"""The errors a user's input can cause: each names what is wrong and the fix, in one line.

The command-line tools print them as that one line and exit with status 2 (see :mod:`jaxllm.cli`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


class ConfigError(ValueError):
    """A config value that cannot work: names the key, the value and the fix."""

    def __init__(self, key: str, value, fix: str):
        self.key, self.value, self.fix = key, value, fix
        super().__init__(f"config error: {key}={value!r}: {fix}")


class DataError(ValueError):
    """Bad data input. The message names the file or config key, the problem and the fix."""


class ConvertError(ValueError):
    """A model, directory, checkpoint or option that cannot be converted (``jaxllm.convert``, :mod:`jaxllm.formats`).

    Attributes:
      keys: the config keys (jaxllm ``SECTION.KEY``, a config.json key or a Megatron argument) at fault, possibly
        empty.
    """

    def __init__(self, message: str, keys=()):
        self.keys = tuple(keys)
        super().__init__(message)


# Our own errors pass through :func:`reading` as they are: they name the file already.
_OURS = (ConfigError, DataError, ConvertError)


@contextlib.contextmanager
def reading(path: str, what: str, error: type[Exception] = DataError, fix: str = "") -> Iterator[None]:
    """Inside: the reading of the user's file ``path`` (a ``what``: ``"safetensors weights"``, ``"JSON"``...), where
    whatever the reader raises for a file that exists but cannot be read (truncated, damaged, not that format,
    unreadable) becomes one ``error`` line naming the file, what it should be and the reader's reason, with ``fix``
    (default: replace it with a complete copy).  The one checked path for every file a user hands over."""
    try:
        yield
    except (*_OURS, KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except BaseException as e:  # noqa: BLE001  each reader raises its library's: OSError, ValueError, torch's
        # CheckpointException (a BaseException)...
        first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), "")
        reason = f"{type(e).__name__}: {first[:200]}" if first else type(e).__name__
        raise error(f"{path} cannot be read as {what} ({reason}); {fix or 'replace it with a complete copy'}"
                    ) from None
