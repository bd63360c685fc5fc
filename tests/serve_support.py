"""Real server processes for the serve tests: start, wait for a line, signal, stop.

Every wait is bounded and ordered by the server's own output lines (e.g.
``listening on``), never by sleeps. Processes import this work tree's
``genlm_backend`` (the repository root goes first on ``PYTHONPATH``).
"""

from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
GATED_SERVER = Path(__file__).resolve().parent / "serve_gated_server.py"
START_TIMEOUT_S = 60.0  # importing torch and transformers on a busy 2-core machine
LINE_TIMEOUT_S = 20.0


def process_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "GENLM_SERVE_TOKEN"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


class ServerProcess:
    """A server (or client) subprocess whose stdout lines are collected as they come."""

    def __init__(self, argv: Sequence[str], env: dict[str, str] | None = None):
        self.argv = list(argv)
        self.process = subprocess.Popen(
            [sys.executable, *argv],
            cwd=REPO_ROOT,
            env=env or process_env(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        self._new_lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.url = ""

    @classmethod
    def cli(cls, *args: str, env: dict[str, str] | None = None) -> ServerProcess:
        """``python -m genlm_backend serve ARGS``, started and listening."""
        server = cls(["-m", "genlm_backend", "serve", *args], env)
        server.wait_listening()
        return server

    @classmethod
    def gated(cls, *args: str, env: dict[str, str] | None = None) -> ServerProcess:
        """The gated mock server (``serve_gated_server.py ARGS``), started and listening."""
        server = cls([str(GATED_SERVER), *args], env)
        server.wait_listening()
        return server

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self._new_lines.put(line.rstrip("\n"))
        self._new_lines.put(None)

    def wait_for(self, pattern: str, timeout_s: float = LINE_TIMEOUT_S) -> re.Match:
        """The first line (since the start) matching ``pattern``; fails after ``timeout_s``."""
        regex = re.compile(pattern)
        for line in self.lines:
            match = regex.search(line)
            if match:
                return match
        deadline = time.monotonic() + timeout_s
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                line = self._new_lines.get(timeout=remaining)
            except queue.Empty:
                break
            if line is None:
                raise AssertionError(f"process ended before {pattern!r}; output:\n{self.output}")
            self.lines.append(line)
            match = regex.search(line)
            if match:
                return match
        raise AssertionError(
            f"no line matching {pattern!r} in {timeout_s} s; output:\n{self.output}"
        )

    def wait_for_count(self, pattern: str, count: int, timeout_s: float = LINE_TIMEOUT_S) -> None:
        """Wait until ``count`` lines (since the start) match ``pattern``; fails after ``timeout_s``."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout_s
        while sum(1 for line in self.lines if regex.search(line)) < count:
            try:
                line = self._new_lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(
                    f"fewer than {count} lines matching {pattern!r} in {timeout_s} s; "
                    f"output:\n{self.output}"
                ) from None
            if line is None:
                raise AssertionError(f"process ended before {count} x {pattern!r}:\n{self.output}")
            self.lines.append(line)

    def wait_listening(self) -> None:
        match = self.wait_for(r"listening on (http://\S+)", START_TIMEOUT_S)
        self.url = match.group(1)

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def open_gate(self, num_batches: int = 1) -> None:
        """Let the gated server's next ``num_batches`` batches compute."""
        assert self.process.stdin is not None
        self.process.stdin.write("\n" * num_batches)
        self.process.stdin.flush()

    def send_signal(self, sig: int) -> None:
        self.process.send_signal(sig)

    def wait_exit(self, timeout_s: float = LINE_TIMEOUT_S) -> int:
        return self.process.wait(timeout=timeout_s)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it has not exited within the line timeout."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        with contextlib.suppress(OSError):
            self.process.stdin.close()  # type: ignore[union-attr]  # releases a gated batch
        try:
            self.process.wait(timeout=LINE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._reader.join(timeout=5)
        self.process.stdout.close()  # type: ignore[union-attr]


def wait_until(condition: Callable[[], bool], timeout_s: float = LINE_TIMEOUT_S) -> None:
    """Poll ``condition`` (a cheap query of a server's state) until true; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout_s} s")
        time.sleep(0.01)


def in_thread(function: Callable, *args) -> tuple[threading.Thread, dict]:
    """Run ``function(*args)`` in a thread; the dict gets ``result`` or ``error`` and ``ended_at``."""
    outcome: dict = {}

    def target() -> None:
        try:
            outcome["result"] = function(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            outcome["error"] = exc
        outcome["ended_at"] = time.monotonic()

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, outcome
