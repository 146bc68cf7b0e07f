"""jaxllm: GPT training in JAX. ``jaxllm.model`` holds the model, ``jaxllm.parallel.sharding`` the rules table."""
