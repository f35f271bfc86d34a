"""Debian's headless Chromium driven over its DevTools protocol (a websocket): no
browser or driver is downloaded. Under CI (CI=true) a missing ``chromium`` fails the
test; elsewhere it skips it (tests/services.py)."""

from __future__ import annotations

import base64
import itertools
import json
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

from .services import missing

FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--window-size=1400,1000",
)


def chromium_path() -> str:
    for name in ("chromium", "chromium-browser"):
        found = shutil.which(name)
        if found:
            return found
    missing("chromium", "no chromium on PATH (apt-get install chromium)")
    raise AssertionError("unreachable")


class Browser:
    """One headless Chromium with one page, driven by CDP commands."""

    def __init__(self, profile: Path, timeout: float = 20.0) -> None:
        import websocket  # websocket-client

        self.timeout = timeout
        self._ids = itertools.count(1)
        self._proc = subprocess.Popen(
            [chromium_path(), *FLAGS, f"--user-data-dir={profile}", "--remote-debugging-port=0"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + timeout
        while not port_file.exists() or not port_file.read_text().strip():
            if time.monotonic() > deadline or self._proc.poll() is not None:
                self.close()
                raise RuntimeError("chromium did not open its DevTools port")
            time.sleep(0.05)
        port = int(port_file.read_text().split()[0])
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=5) as answer:
            pages = [t for t in json.load(answer) if t["type"] == "page"]
        # suppress_origin: DevTools refuses websocket clients that name an origin
        self._ws = websocket.create_connection(
            pages[0]["webSocketDebuggerUrl"], timeout=timeout, suppress_origin=True
        )
        self.send("Page.enable")
        self.send("Runtime.enable")

    def send(self, method: str, **params: Any) -> dict[str, Any]:
        """Send a command and wait for its answer (events in between are dropped)."""
        call = next(self._ids)
        self._ws.send(json.dumps({"id": call, "method": method, "params": params}))
        while True:
            message = json.loads(self._ws.recv())
            if message.get("id") == call:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                result: dict[str, Any] = message.get("result", {})
                return result

    def evaluate(self, expression: str) -> Any:
        found = self.send("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in found:
            raise RuntimeError(f"{expression}: {found['exceptionDetails']}")
        return found["result"].get("value")

    def wait_for(self, expression: str) -> Any:
        """Poll ``expression`` until it is truthy (a page load, a navigation)."""
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            try:
                value = self.evaluate(expression)
            except RuntimeError:  # the page is between documents
                value = None
            if value:
                return value
            time.sleep(0.05)
        raise TimeoutError(expression)

    def open(self, url: str) -> None:
        self.send("Page.navigate", url=url)
        self.wait_for(f"document.readyState === 'complete' && location.href === {json.dumps(url)}")

    def screenshot(self, path: Path) -> Path:
        shot = self.send("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        path.write_bytes(base64.b64decode(shot["data"]))
        return path

    def close(self) -> None:
        ws = getattr(self, "_ws", None)
        if ws is not None:
            ws.close()
        self._proc.terminate()
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
