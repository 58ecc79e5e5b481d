"""The plain sequential reference every batched result is compared with."""

from __future__ import annotations

from app.models.protocol import StatelessModel


def run_alone(
    model: StatelessModel, prompt: list[int], max_tokens: int, stop_token: int, include_stop: bool
) -> list[int]:
    """One request by itself: one ``next_tokens([prefix])`` call per generated token."""
    prefix, generated = list(prompt), list[int]()
    while len(generated) < max_tokens:
        (token,) = model.next_tokens([list(prefix)])
        if token == stop_token:
            if include_stop:
                generated.append(token)
            break
        generated.append(token)
        prefix.append(token)
    return generated
