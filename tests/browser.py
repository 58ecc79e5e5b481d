"""Headless Chromium (Debian's package) driven over the DevTools protocol, for page tests.

``open_page(url)`` starts a private Chromium with an empty profile and the flags this closed
network needs (no background networking), opens ``url`` and yields a ``Page`` whose
``evaluate`` runs JavaScript in it and whose ``exceptions`` lists the uncaught script errors the
browser reported. ``.ci/run`` (and ``make test``) install Chromium; ``CHROMIUM`` is None without.
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
from websockets.sync.client import connect
from websockets.sync.connection import Connection

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-dev-shm-usage", "--remote-debugging-port=0", "--window-size=1400,900",
)  # fmt: skip


class Page:
    """One tab, over its DevTools websocket."""

    def __init__(self, socket: Connection) -> None:
        self.socket = socket
        self.exceptions: list[str] = []
        self._ids = itertools.count(1)

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        """Send one DevTools command and return its result (events meanwhile are kept)."""
        number = next(self._ids)
        self.socket.send(json.dumps({"id": number, "method": method, "params": params}))
        while True:
            message = json.loads(self.socket.recv(timeout=30))
            if message.get("method") == "Runtime.exceptionThrown":
                details = message["params"]["exceptionDetails"]
                self.exceptions.append(
                    details.get("exception", {}).get("description", str(details))
                )
            if message.get("id") == number:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                result: dict[str, Any] = message["result"]
                return result

    def evaluate(self, expression: str) -> Any:
        """The JSON value of ``expression`` in the page."""
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        return result["result"].get("value")

    def screenshot(self, path: Path) -> None:
        data = self.call("Page.captureScreenshot", format="png")["data"]
        path.write_bytes(base64.b64decode(data))


@contextmanager
def open_page(url: str) -> Iterator[Page]:
    """Chromium showing ``url`` (loaded), closed afterwards."""
    assert CHROMIUM is not None, "no chromium binary"
    # (a helper process of Chromium may still write the profile as it dies: leftovers stay)
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as profile:
        command = [CHROMIUM, *FLAGS, f"--user-data-dir={profile}", "about:blank"]
        process = subprocess.Popen(  # its own process group: its helpers are killed with it
            command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        try:
            port = _devtools_port(Path(profile), process)
            targets = httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=10).json()
            tab = next(t for t in targets if t["type"] == "page")
            with connect(tab["webSocketDebuggerUrl"], max_size=None) as socket:
                page = Page(socket)
                page.call("Runtime.enable")
                page.call("Page.enable")
                page.call("Page.navigate", url=url)
                _wait_loaded(page)
                yield page
        finally:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)


def _devtools_port(profile: Path, process: subprocess.Popen[bytes]) -> int:
    """The port Chromium chose, from the file it writes once it listens."""
    marker = profile / "DevToolsActivePort"
    deadline = time.monotonic() + 30
    while not marker.exists() or not marker.read_text().strip():
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("chromium did not start its DevTools endpoint")
        time.sleep(0.05)  # another process writes it: there is no event to await
    return int(marker.read_text().splitlines()[0])


def _wait_loaded(page: Page) -> None:
    deadline = time.monotonic() + 30
    while page.evaluate("document.readyState") != "complete":
        if time.monotonic() > deadline:
            raise TimeoutError("the page did not load")
        time.sleep(0.05)


if __name__ == "__main__":  # python tests/browser.py URL OUT.png [SECONDS]: a screenshot
    import sys

    with open_page(sys.argv[1]) as page:
        time.sleep(float(sys.argv[3]) if len(sys.argv) > 3 else 0.0)
        page.screenshot(Path(sys.argv[2]))
