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
