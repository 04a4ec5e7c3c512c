"""A minimal headless-Chromium driver over the DevTools protocol, standard library only.

Chromium is started with ``--remote-debugging-pipe``: it reads protocol commands from
file descriptor 3 and writes answers and events to 4, each message a JSON text ended by
a NUL byte. No websocket, no port, no third-party client. Used by the browser test of
report.html (console errors, drawn content of every plot, a screenshot).
"""

from __future__ import annotations

import base64
import json
import os
import queue
import shutil
import subprocess
import tempfile
import threading
import time

EXECUTABLES = ("chromium", "chromium-browser", "google-chrome")
# Installed by .ci/run where apt is usable (Debian's package is "chromium").
INSTALL_HINT = "apt-get install -y chromium"


def find_executable() -> str | None:
    for name in EXECUTABLES:
        path = shutil.which(name)
        if path:
            return path
    return None


class ProtocolError(RuntimeError):
    pass


class Chromium:
    """One headless browser; ``open(url)`` loads a page and collects its console errors."""

    def __init__(self, executable: str, timeout_s: float = 60.0, width: int = 1400, height: int = 1000):
        self.timeout_s = timeout_s
        self.profile = tempfile.mkdtemp(prefix="attncheck-chromium-")
        to_read, self._to_write = os.pipe()
        self._from_read, from_write = os.pipe()
        # bash puts our pipe ends on the descriptors 3 and 4 that Chromium expects.
        command = [executable, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                   "--no-default-browser-check", "--disable-extensions", "--disable-background-networking",
                   "--remote-debugging-pipe", f"--user-data-dir={self.profile}", f"--window-size={width},{height}",
                   "about:blank"]
        self.proc = subprocess.Popen(["bash", "-c", f'exec "$@" 3<&{to_read} 4>&{from_write}', "chromium", *command],
                                     pass_fds=(to_read, from_write), stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        os.close(to_read)
        os.close(from_write)
        self._messages: queue.Queue = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self._next_id = 0
        self.events: list[dict] = []
        self.width, self.height = width, height

    def _read(self) -> None:
        buffer = b""
        while True:
            try:
                chunk = os.read(self._from_read, 1 << 16)
            except OSError:
                chunk = b""
            if not chunk:
                self._messages.put(None)
                return
            buffer += chunk
            while b"\0" in buffer:
                message, buffer = buffer.split(b"\0", 1)
                self._messages.put(json.loads(message))

    def send(self, method: str, params: dict | None = None, session: str | None = None) -> dict:
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        os.write(self._to_write, json.dumps(message).encode() + b"\0")
        answer = self._wait(lambda m: m.get("id") == self._next_id)
        if "error" in answer:
            raise ProtocolError(f"{method}: {answer['error']}")
        return answer.get("result", {})

    def _wait(self, predicate) -> dict:
        deadline = time.monotonic() + self.timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no answer from chromium within {self.timeout_s:.0f} s")
            try:
                message = self._messages.get(timeout=left)
            except queue.Empty:
                continue
            if message is None:
                raise ProtocolError(f"chromium exited: {self.stderr_tail()}")
            if predicate(message):
                return message
            if "method" in message:
                self.events.append(message)

    def stderr_tail(self) -> str:
        if self.proc.poll() is None or self.proc.stderr is None:
            return ""
        return self.proc.stderr.read().decode(errors="replace")[-2000:]

    def open(self, url: str) -> str:
        """Load ``url`` in a new tab; returns the protocol session of the tab."""
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for method in ("Page.enable", "Runtime.enable", "Log.enable"):
            self.send(method, session=session)
        self.send("Emulation.setDeviceMetricsOverride", {"width": self.width, "height": self.height,
                                                         "deviceScaleFactor": 1, "mobile": False}, session)
        self.send("Page.navigate", {"url": url}, session)
        self._wait(lambda m: m.get("method") == "Page.loadEventFired" and m.get("sessionId") == session)
        return session

    def evaluate(self, session: str, expression: str):
        result = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True,
                                                "awaitPromise": True}, session)
        if "exceptionDetails" in result:
            raise ProtocolError(f"evaluate: {result['exceptionDetails']}")
        return result["result"].get("value")

    def console_errors(self, session: str) -> list[str]:
        """Uncaught exceptions, console.error/assert calls and browser log errors (a failed
        load, a blocked request) of the tab so far."""
        errors = []
        for event in self.events:
            if event.get("sessionId") != session:
                continue
            method, params = event["method"], event.get("params", {})
            if method == "Runtime.exceptionThrown":
                details = params.get("exceptionDetails", {})
                errors.append(f"exception: {details.get('exception', {}).get('description') or details.get('text')}")
            elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
                errors.append("console." + params["type"] + ": " + " ".join(
                    str(a.get("value", a.get("description", ""))) for a in params.get("args", [])))
            elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
                entry = params["entry"]
                errors.append(f"log: {entry.get('text')} {entry.get('url', '')}".strip())
        return errors

    def screenshot(self, session: str, selector: str, path: str, margin: int = 2) -> None:
        """A PNG of the whole element matching ``selector``. The viewport is first made as
        tall as the page (same width): capturing beyond a smaller viewport lays the page out
        again at another width, and the element moves away from the measured box."""
        size = self.send("Page.getLayoutMetrics", session=session)["cssContentSize"]
        self.send("Emulation.setDeviceMetricsOverride", {"width": self.width, "deviceScaleFactor": 1, "mobile": False,
                                                         "height": min(16000, int(size["height"]) + 1)}, session)
        box = self.evaluate(session, f"""(() => {{
            const el = document.querySelector({json.dumps(selector)});
            if (!el) return null;
            const r = el.getBoundingClientRect();
            return {{x: r.left + window.scrollX, y: r.top + window.scrollY, width: r.width, height: r.height}};
        }})()""")
        if not box:
            raise ProtocolError(f"no element matches {selector!r}")
        clip = {"x": max(0, box["x"] - margin), "y": max(0, box["y"] - margin),
                "width": box["width"] + 2 * margin, "height": box["height"] + 2 * margin, "scale": 1}
        data = self.send("Page.captureScreenshot", {"format": "png", "clip": clip}, session)["data"]
        with open(path, "wb") as fh:
            fh.write(base64.b64decode(data))

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                try:
                    os.write(self._to_write, json.dumps({"id": 0, "method": "Browser.close"}).encode() + b"\0")
                except OSError:
                    pass
                try:
                    self.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(timeout=10)
        finally:
            for fd in (self._to_write, self._from_read):
                try:
                    os.close(fd)
                except OSError:
                    pass
            shutil.rmtree(self.profile, ignore_errors=True)

    def __enter__(self) -> Chromium:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
