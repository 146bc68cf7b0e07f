"""The config ``python -m jaxllm.train`` runs without ``--config``: every default of :mod:`jaxllm.config`.

(A file of its own because ml-collections executes a config file as a new module: the
classes must come from the one imported ``jaxllm.config``.)
"""

from jaxllm.config import get_config  # noqa: F401
