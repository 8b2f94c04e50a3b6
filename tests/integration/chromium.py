"""A real headless Chromium (Debian's chromium-headless-shell, or chromium), driven over the
DevTools protocol on a pipe (`--remote-debugging-pipe`: requests on fd 3, answers on fd 4,
each a JSON object ended by a NUL byte), so a test needs no port, no websocket client and
nothing downloaded. One browser per test module; a page is a target attached in flat mode.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import selectors
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from typing import Any

BINARIES = ("chromium-headless-shell", "chromium", "chromium-browser")


def find_binary() -> str | None:
    return next((path for name in BINARIES if (path := shutil.which(name))), None)


class BrowserError(AssertionError):
    pass


class Browser:
    def __init__(self, binary: str) -> None:
        self.profile = tempfile.mkdtemp(prefix="dmb-", dir="/tmp")
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()
        ends = (to_browser_r, from_browser_w)

        def onto_3_and_4() -> None:  # in the child: its ends of the pipes become fds 3 and 4
            high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in ends]
            os.dup2(high[0], 3)
            os.dup2(high[1], 4)

        args = [binary, "--headless", "--remote-debugging-pipe", "--no-sandbox", "--disable-gpu",
                "--no-first-run", "--no-default-browser-check", "--disable-extensions",
                f"--user-data-dir={self.profile}", "about:blank"]  # fmt: skip
        self.proc = subprocess.Popen(
            # fds 3 and 4 are made in preexec_fn, which runs before the others are closed
            args, preexec_fn=onto_3_and_4, pass_fds=(3, 4), stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        for fd in ends:
            os.close(fd)
        self._next_id = 0
        self._buffer = b""
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._from_browser, selectors.EVENT_READ)

    def call(self, method: str, session: str | None = None, timeout: float = 15,
             **params: Any) -> dict[str, Any]:  # fmt: skip
        """Send one command and wait for its answer (events in between are dropped)."""
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params}
        if session is not None:
            message["sessionId"] = session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            for reply in self._messages(deadline, method):
                if reply.get("id") == self._next_id:
                    if "error" in reply:
                        raise BrowserError(f"{method}: {reply['error']}")
                    result: dict[str, Any] = reply.get("result", {})
                    return result

    def _messages(self, deadline: float, method: str) -> Iterator[dict[str, Any]]:
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not self._selector.select(timeout=left):
                raise BrowserError(f"no answer from the browser to {method}")
            chunk = os.read(self._from_browser, 1 << 16)
            if not chunk:
                status = self.proc.poll()
                raise BrowserError(f"the browser exited (status {status}) during {method}")
            self._buffer += chunk
        *whole, self._buffer = self._buffer.split(b"\0")
        for raw in whole:
            yield json.loads(raw)

    def open(self, url: str) -> Page:
        target = self.call("Target.createTarget", url=url)["targetId"]
        session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        return Page(self, session)

    def close(self) -> None:
        with contextlib.suppress(BrowserError, OSError):  # OSError: it has gone already
            self.call("Browser.close", timeout=5)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self._selector.close()
        os.close(self._to_browser)
        os.close(self._from_browser)
        shutil.rmtree(self.profile, ignore_errors=True)


class Page:
    def __init__(self, browser: Browser, session: str) -> None:
        self.browser = browser
        self.session = session

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (JSON-serialisable)."""
        result = self.browser.call("Runtime.evaluate", self.session, expression=expression,
                                   returnByValue=True)  # fmt: skip
        if "exceptionDetails" in result:
            raise BrowserError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float, what: str,
                 interval: float = 0.05) -> Any:  # fmt: skip
        """Until the expression is truthy; its value. Raises naming the last value seen."""
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            last = self.evaluate(expression)
            if last:
                return last
            time.sleep(interval)
        raise BrowserError(f"the page did not show {what} within {timeout}s; last: {last!r}")
