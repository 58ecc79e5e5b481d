"""KV-cache events in vLLM's wire format: the prefix cache's changes, published per engine step
on a ZeroMQ PUB socket as msgpack ``KVEventBatch``es, with a replay socket for missed batches.

- ``schema``: vLLM's event structs (``vllm/distributed/kv_events.py``), msgspec-encoded.
- ``hashing``: vLLM's block hashes (``--prefix-caching-hash-algo``, seeded like vLLM's
  ``PYTHONHASHSEED``).
- ``publisher``: ``KVEventPublisher``, the engine's sink: never blocks the engine (a bounded
  queue drained by a background thread; a full queue drops the batch and counts it).
"""
