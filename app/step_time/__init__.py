"""Step time from physics: a model's config.json on a GPU's datasheet.

- ``model_config``: the shape of a Hugging Face ``config.json`` (Llama-style dense or
  Mixtral-style mixture of experts) and what it implies (weights, FLOPs, KV bytes).
- ``gpus``: datasheet figures of common GPUs (``--gpu``).
- ``physics``: ``PhysicsStepTime``, a ``StepTimeModel`` (``app.engine.step_clock``) that
  prices a step's work with roofline terms and a handful of calibration constants, and the
  KV capacity vLLM would get on that hardware.

The engine never imports this package: it is handed a ``StepTimeModel``.
"""
