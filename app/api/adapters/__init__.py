"""Protocol adapters over one internal request and one output stream (``app.api.generation``):
the Anthropic Messages API (``anthropic``) and OpenAI's Responses API (``responses``)."""
