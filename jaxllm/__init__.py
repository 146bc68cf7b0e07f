"""jaxllm: GPT training in JAX. ``jaxllm.model`` holds the model, ``jaxllm.sharding`` the rules table."""
