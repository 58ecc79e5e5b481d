"""``slotserve bench``: a load generator and benchmark report for slotserve and any
OpenAI-compatible server, with ``vllm bench serve``'s metric definitions.

Modules: ``workload`` (what to send and when), ``client`` (one streamed request, SSE parsed from
raw bytes), ``metrics`` (pure latency and throughput math), ``monitor`` (the server's slots and
queue over time, its token counter), ``runner`` (loops, warm-up, worker processes), ``report``
(table, JSON, charts), ``schedule`` (a batch schedule's ideal step count), ``cli``.
"""
