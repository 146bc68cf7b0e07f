"""The errors a user's input can cause: each names what is wrong and the fix, in one line.

The command-line tools print them as that one line and exit with status 2 (see :mod:`jaxllm.cli`).
"""


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
