"""A headless Chromium driven through the DevTools protocol over a pipe (no extra packages).

The browser test of the dashboard (tests/phase8/test_dashboard.py) and the screenshots in the
READMEs (benchmarks/dashboard_screenshots.py) need a real browser that runs the page's
JavaScript, then questions about the DOM and a picture of it. `--remote-debugging-pipe` makes
Chromium read DevTools commands from file descriptor 3 and write replies and events to
descriptor 4, each message JSON followed by a NUL byte: a client in ~100 lines, no websocket
library and no browser download (Debian's `chromium` package; `.ci/setup --dev` installs it).
"""

import base64
import fcntl
import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

EXECUTABLES = ("chromium", "chromium-browser", "google-chrome")
COMMAND_TIMEOUT_S = 30.0
HIGH_FD = 10  # the pipe ends are moved above this before becoming the child's fds 3 and 4


def find_chromium() -> str | None:
    return next((path for name in EXECUTABLES if (path := shutil.which(name))), None)


class DevToolsError(RuntimeError):
    pass


class Chromium:
    """One headless browser; `open(url)` gives a `Page`. Use it as a context manager."""

    def __init__(self, executable: str, width: int = 1280, height: int = 900):
        self.width, self.height = width, height
        self.profile = tempfile.TemporaryDirectory(prefix="chromium-")
        to_browser, self._commands = os.pipe()
        self._replies, from_browser = os.pipe()

        def as_fds_3_and_4():  # runs in the child, before exec
            ours = [fcntl.fcntl(fd, fcntl.F_DUPFD, HIGH_FD) for fd in (to_browser, from_browser)]
            os.dup2(ours[0], 3)
            os.dup2(ours[1], 4)

        flags = ["--headless", "--disable-gpu", "--remote-debugging-pipe", "--no-first-run",
                 f"--user-data-dir={self.profile.name}", f"--window-size={width},{height}",
                 "--hide-scrollbars"]  # fmt: skip
        if os.geteuid() == 0:
            flags.append("--no-sandbox")  # Chromium refuses to run its sandbox as root (CI)
        self.process = subprocess.Popen(
            [executable, *flags, "about:blank"], preexec_fn=as_fds_3_and_4, pass_fds=(3, 4),
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        os.close(to_browser)
        os.close(from_browser)
        self._buffer = b""
        self._next_id = 0

    def __enter__(self) -> "Chromium":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        os.close(self._commands)
        os.close(self._replies)
        self.profile.cleanup()

    def send(self, method: str, params: dict | None = None, session: str | None = None) -> dict:
        """Sends one command and returns its result (events that arrive meanwhile are dropped)."""
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params or {}}
        if session is not None:
            message["sessionId"] = session
        os.write(self._commands, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + COMMAND_TIMEOUT_S
        while True:
            reply = self._read(deadline)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise DevToolsError(f"{method}: {reply['error']}")
                return reply["result"]

    def _read(self, deadline: float) -> dict:
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._replies], [], [], left)[0]:
                raise DevToolsError("Chromium did not answer in time")
            chunk = os.read(self._replies, 1 << 16)
            if not chunk:
                raise DevToolsError("Chromium exited")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def open(self, url: str) -> "Page":
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})
        page = Page(self, session["sessionId"], target)
        page.send("Emulation.setDeviceMetricsOverride", {"width": self.width,
                  "height": self.height, "deviceScaleFactor": 1, "mobile": False})  # fmt: skip
        page.send("Page.navigate", {"url": url})
        return page


class Page:
    """A browser tab; use it as a context manager, so that it closes (and its page's
    connections with it)."""

    def __init__(self, browser: Chromium, session: str, target: str):
        self.browser, self.session, self.target = browser, session, target

    def __enter__(self) -> "Page":
        return self

    def __exit__(self, *exc) -> None:
        self.browser.send("Target.closeTarget", {"targetId": self.target})

    def send(self, method: str, params: dict | None = None) -> dict:
        return self.browser.send(method, params, self.session)

    def evaluate(self, expression: str):
        """The value of a JavaScript expression in the page (a promise is awaited)."""
        result = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True,
                                                "awaitPromise": True})  # fmt: skip
        if "exceptionDetails" in result:
            raise DevToolsError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 20.0, interval: float = 0.05):
        """Polls `expression` until it is truthy (an exception counts as false while the page
        is still loading); returns its value."""
        deadline, error = time.monotonic() + timeout, None
        while time.monotonic() < deadline:
            try:
                value = self.evaluate(expression)
            except DevToolsError as e:
                value, error = None, e
            if value:
                return value
            time.sleep(interval)
        raise AssertionError(f"after {timeout} s the page never made this true: {expression} "
                             f"(last error: {error})")  # fmt: skip

    def screenshot(self, path: str | Path) -> None:
        """A PNG of the whole page (not only the window)."""
        height = self.evaluate("document.documentElement.scrollHeight")
        self.send("Emulation.setDeviceMetricsOverride", {"width": self.browser.width,
                  "height": height, "deviceScaleFactor": 1, "mobile": False})  # fmt: skip
        data = self.send("Page.captureScreenshot", {"format": "png"})["data"]
        Path(path).write_bytes(base64.b64decode(data))
