"""Prefill/decode disaggregation as vLLM's KV connectors show it to routers, simulated.

vLLM splits a request between two servers when a router (the vLLM router's P/D mode, llm-d, a
proxy) asks it to: the *producer* prefills the prompt with ``max_tokens: 1`` and
``kv_transfer_params: {"do_remote_decode": true}``, keeps the prompt's KV blocks and answers with
the parameters a decoder needs to pull them (``remote_engine_id``, ``remote_block_ids``,
``remote_host``, ``remote_port``, ...); the *consumer* gets the whole request again with those
parameters (``do_remote_prefill: true``), pulls the blocks instead of computing the prompt, and
decodes. What is simulated here, and what a real connector does that we do not:

- the producer holds the blocks in its KV books (they count in ``vllm:kv_cache_usage_perc``)
  until the consumer fetches them or ``hold_seconds`` pass (vLLM's NIXL connector frees them
  after ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``, 480 s by default);
- the consumer's pull is one small HTTP call to the producer (``POST /v1/kv_transfer/fetch`` on
  ``remote_host:remote_port``, our stand-in for NIXL's side channel) that releases the blocks,
  followed by a wait for the bytes to cross the link: KV bytes of the prompt / ``bandwidth`` +
  ``latency``. No KV data moves: the mock models compute nothing from it;
- a pull that fails (unknown engine, expired or unknown blocks, unreachable producer) falls back
  to a local prefill, counted and said in the response header ``x-kv-transfer``, as vLLM's
  ``kv_load_failure_policy: recompute`` does.

``config`` reads ``--kv-transfer-config``; ``params`` validates a request's ``kv_transfer_params``;
``link`` times a transfer; ``holds`` keeps the producer's held blocks; ``pull`` is the
consumer's side of the fetch.
"""
