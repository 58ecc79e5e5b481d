"""``slotserve simulate``: the server's Scheduler and step clock on a virtual clock.

- ``workload``: the requests to replay, from an inference-perf config (its ``data`` and
  ``load`` sections) or a JSONL trace.
- ``run``: the replay: requests enter the same ``Scheduler`` the server runs, each step lasts
  what the step-time model says, time jumps from one event to the next (no sleeping, no HTTP).
- ``report``: inference-perf's own report files (``stage_N_lifecycle_metrics.json``,
  ``summary_lifecycle_metrics.json``) and a short table.
- ``cli``: the command line.
"""
