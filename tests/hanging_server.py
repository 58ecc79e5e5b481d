"""A test-only server whose model call never returns: ``python tests/hanging_server.py <serve
flags>`` serves like ``python -m app serve`` but with ``HangingModel``, so a test can send
SIGTERM to a real process whose model is stuck (tests/engine/test_engine_edges.py)."""

from __future__ import annotations

import sys
import threading

from app.api.app import create_app
from app.cli import parse
from app.server import run

HANG = ord("!")  # a prompt starting with this byte makes the model call hang forever
ENTERED = "entered a model call that never returns"


class HangingModel:
    """A stateless model that blocks (runs in the engine's worker thread): a batch holding a
    prompt that starts with "!" never returns; any other batch gets "a" for every entry."""

    def next_tokens(self, batch: list[list[int]]) -> list[int]:
        if any(prefix[0] == HANG for prefix in batch):
            print(ENTERED, file=sys.stderr, flush=True)
            threading.Event().wait()  # never set
        return [ord("a")] * len(batch)


def main() -> None:
    _, settings = parse(["serve", *sys.argv[1:]])
    run(create_app(settings, HangingModel()), settings.host, settings.port, settings.log_level)


if __name__ == "__main__":
    main()
