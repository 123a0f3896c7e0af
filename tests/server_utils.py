"""Start the real ``cpullm serve`` as a subprocess on a free loopback port."""

from __future__ import annotations

import collections
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RemoteServer:
    def __init__(self, args: list[str], env: dict[str, str] | None = None,
                 timeout: float = 120.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.started = time.monotonic()
        env = {**os.environ, **(env or {})}
        if (not args or args[0].startswith("-")) and "--kv-cache-memory-bytes" not in args:
            # The default model's default KV cache is vLLM CPU's 4 GiB, faulted in at startup:
            # 4-6 s on a VM. 1 GiB holds what any test sends it.
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cpullm.entrypoints.cli", "serve", *args,
             "--port", str(self.port), "--uvicorn-log-level", "warning"],
            env=env, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True)
        # Drained all along, so the server never blocks on a full pipe; read with log().
        self._lines: list[str] = []
        self._reader = threading.Thread(target=self._lines.extend, args=(self.proc.stdout,),
                                        daemon=True)
        self._reader.start()
        self._wait_healthy(timeout)

    def log(self) -> str:
        """What the server printed so far."""
        return "".join(list(self._lines))

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self._reader.join(5)
                raise RuntimeError(f"server exited early:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError("server did not become healthy")

    def metrics(self) -> dict[str, float]:
        text = httpx.get(f"{self.url}/metrics").text
        values = {}
        for line in text.splitlines():
            match = re.match(r'^([\w:]+)(?:\{[^}]*\})? ([-\d.e+]+)$', line)
            if match:
                values[match.group(1)] = values.get(match.group(1), 0.0) + float(match.group(2))
        return values

    def finished_by_reason(self) -> collections.Counter:
        """vllm:request_success_total per finished_reason (stop, length, abort)."""
        counts: collections.Counter = collections.Counter()
        for line in httpx.get(f"{self.url}/metrics").text.splitlines():
            match = re.match(r'vllm:request_success_total\{.*finished_reason="(\w+)".*\} '
                             r'(\S+)$', line)
            if match:
                counts[match.group(1)] += float(match.group(2))
        return counts

    def wait_idle(self, timeout: float = 20.0) -> dict[str, float]:
        """Wait until no request runs and every KV block is free again."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if (m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0
                    and m["cpullm:kv_cache_free_blocks"] == m["cpullm:kv_cache_total_blocks"]):
                return m
            if time.monotonic() > deadline:
                raise AssertionError(f"server not idle: {m}")
            time.sleep(0.1)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(5)  # the rest of the output, up to end of file
        return self.proc.returncode
