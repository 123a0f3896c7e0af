"""The short soak (docs/reliability.md has the long one): 64 streaming clients for
23 s, a third of the requests left mid-stream, against the real server."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from server_utils import RemoteServer

CLIENTS, SECONDS, WARMUP = 64, 15, 8


@pytest.mark.slow
def test_soak_with_vanishing_clients(tiny_model, tmp_path):
    srv = RemoteServer([str(tiny_model("llama")), "--dtype", "float32", "--max-model-len", "512"])
    result_file = tmp_path / "soak.json"
    try:
        run = subprocess.run(
            [sys.executable, "-m", "cpullm.entrypoints.cli", "bench", "soak",
             "--base-url", srv.url, "--clients", str(CLIENTS), "--duration", str(SECONDS),
             "--warmup", str(WARMUP), "--server-pid", str(srv.proc.pid),
             "--result-file", str(result_file)],
            capture_output=True, text=True, timeout=SECONDS + 120)
        figures = json.loads(result_file.read_text())
        assert run.returncode == 0, run.stdout + run.stderr
        assert figures["errors"] == 0, figures["first_errors"]
        assert figures["kv_blocks_leaked"] == 0
        assert figures["requests"] > 100 and figures["disconnects"] > 50
        # Resident memory flat after the warm-up: within 10% and 32 MB of where it stood.
        assert figures["rss_max_after_warmup_mb"] <= \
            figures["rss_after_warmup_mb"] * 1.10 + 32, figures
        assert srv.wait_idle()["vllm:num_requests_running"] == 0
    finally:
        assert srv.stop() == 0
    assert "Traceback" not in srv.log()
