"""Real models: Hugging Face checkpoints (Llama, Qwen2, Mistral families) served by our own
batched forward pass over a per-slot KV cache.

Importing this package is cheap and needs no torch: ``load_model`` imports the heavy libraries
only when it runs, and says in one line how to install them if they are missing.
"""

from app.models.hf.errors import ModelLoadError
from app.models.hf.loader import LoadedModel, check_spec, is_real_model, load_model, served_name

__all__ = [
    "LoadedModel",
    "ModelLoadError",
    "check_spec",
    "is_real_model",
    "load_model",
    "served_name",
]
