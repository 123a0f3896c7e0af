"""`cpullm chat` driven in a pseudo-terminal, as a person types into it: the conversation's
lines are the conversation's (no log lines unless -v), and the prompt waits for them."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.slow  # the real default model, in a process of its own


class Terminal:
    """A process on a pseudo-terminal: what it wrote so far, and a way to type."""

    def __init__(self, args: list[str]) -> None:
        env = {k: v for k, v in os.environ.items() if k != "VLLM_LOGGING_LEVEL"}
        master, slave = pty.openpty()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "cpullm.entrypoints.cli", "chat", *args],
            stdin=slave, stdout=slave, stderr=slave, close_fds=True,
            env={**env, "COLUMNS": "120", "TERM": "xterm"})
        os.close(slave)
        self.master = master
        self.text = ""

    def read_until(self, marker: str, start: int, timeout: float = 180) -> int:
        """Read until ``marker`` appears at or after ``start``; its index."""
        deadline = time.monotonic() + timeout
        while (found := self.text.find(marker, start)) < 0:
            assert time.monotonic() < deadline, f"no {marker!r} in {self.text!r}"
            ready, _, _ = select.select([self.master], [], [], 0.5)
            if ready:
                try:
                    self.text += os.read(self.master, 4096).decode(errors="replace")
                except OSError:  # the process ended
                    assert self.process.poll() is not None
                    assert marker in self.text[start:], self.text
        return found

    def type(self, line: str) -> None:
        os.write(self.master, (line + "\n").encode())

    def close(self) -> int:
        code = self.process.wait(timeout=60)
        os.close(self.master)
        return code


def converse(extra: list[str]) -> tuple[str, str, str]:
    """(what came before the first prompt, the user's turn and the answer up to the next
    prompt, what came after) of one question and an empty line."""
    terminal = Terminal(["--max-tokens", "12", "--temperature", "0", *extra])
    try:
        # the prompt at a line's start (-v's log lines hold "thread 0 -> CPU 0")
        first = terminal.read_until("\n> ", 0) + 1
        terminal.type("What is the capital of France?")
        second = terminal.read_until("\n> ", first + 2)
        terminal.type("")
        assert terminal.close() == 0
    finally:
        if terminal.process.poll() is None:
            terminal.process.kill()
    text = terminal.text
    return text[:first], text[first:second + 3], text[second + 3:]


def test_the_chat_keeps_log_lines_out_of_the_conversation():
    before, turn, after = converse([])
    assert "Chatting with the model" in before
    for part in (before, turn, after):
        assert "INFO" not in part and "WARNING" not in part, part
    question, answer = turn.split("France?", 1)
    assert answer.strip(), turn  # the model's words, and nothing else, up to the prompt


def test_verbose_chat_logs_while_it_loads():
    before, turn, _ = converse(["-v"])
    assert "INFO" in before and "Compute threads pinned" in before  # before the prompt
    assert "Compute threads pinned" not in turn
