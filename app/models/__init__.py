"""Models: the protocols the engine drives, and the mock models."""
