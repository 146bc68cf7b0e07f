"""The parallel layer: the mesh and the one rules table (:mod:`~jaxllm.parallel.sharding`), attention
split along the sequence (:mod:`~jaxllm.parallel.context_parallel`), vocabulary-parallel embedding and
loss (:mod:`~jaxllm.parallel.vocab_parallel`), the pipeline schedules' timetables
(:mod:`~jaxllm.parallel.schedules`) and their loops (:mod:`~jaxllm.parallel.pipeline`, zb_h1's split
backward in :mod:`~jaxllm.parallel.zero_bubble`), and the experts' dispatch (:mod:`~jaxllm.parallel.experts`)."""

__all__ = ["context_parallel", "experts", "pipeline", "schedules", "sharding", "vocab_parallel", "zero_bubble"]
