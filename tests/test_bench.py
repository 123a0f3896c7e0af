"""The bench commands run a tiny workload end to end and write valid JSON."""

from __future__ import annotations

import json
import subprocess
import sys

from server_utils import RemoteServer

CLI = [sys.executable, "-m", "cpullm.entrypoints.cli", "bench"]
ENGINE = ["--dtype", "float32", "--block-size", "32", "--max-model-len", "256"]


def run(args: list[str]) -> subprocess.CompletedProcess:
    result = subprocess.run(CLI + args, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_bench_throughput(tiny_model, tmp_path):
    out = tmp_path / "throughput.json"
    result = run(["throughput", "--model", str(tiny_model("llama")), *ENGINE, "--num-prompts",
                  "6", "--random-input-len", "20", "--random-output-len", "8",
                  "--random-range-ratio", "0.5", "--output-json", str(out)])
    assert "Throughput:" in result.stdout
    # Threads are pinned (and say so) before the progress bar starts, not on its line.
    pinned = result.stderr.index("Compute threads pinned")
    assert pinned < result.stderr.index("Processed prompts")
    result = json.loads(out.read_text())
    assert result["num_requests"] == 6
    assert result["total_num_tokens"] > 6 * 8 * 0.5
    assert result["tokens_per_second"] > result["output_tokens_per_second"] > 0
    assert {"elapsed_time", "requests_per_second"} <= set(result)


def test_bench_throughput_sharegpt(tiny_model, tmp_path):
    data = [{"conversations": [{"from": "human", "value": f"Tell me about number {i}, please."},
                               {"from": "gpt", "value": "It is a fine number, I think so."}]}
            for i in range(5)]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    out = tmp_path / "result.json"
    run(["throughput", "--model", str(tiny_model("llama")), *ENGINE, "--dataset-name",
         "sharegpt", "--dataset-path", str(path), "--num-prompts", "3", "--output-json",
         str(out)])
    assert json.loads(out.read_text())["num_requests"] == 3


def test_bench_latency(tiny_model, tmp_path):
    out = tmp_path / "latency.json"
    stdout = run(["latency", "--model", str(tiny_model("llama")), *ENGINE, "--input-len", "8",
                  "--output-len", "4", "--batch-size", "2", "--num-iters-warmup", "1",
                  "--num-iters", "3", "--output-json", str(out)]).stdout
    assert "Avg latency" in stdout
    result = json.loads(out.read_text())
    assert len(result["latencies"]) == 3 and result["avg_latency"] > 0
    assert set(result["percentiles"]) == {"10", "25", "50", "75", "90", "99"}
    # the prompt step and the tokens after the first, apart (llama-bench's pp and tg)
    assert "Prefill:" in stdout
    assert result["prefill_tokens_per_second"] > 0 and result["decode_tokens_per_second"] > 0
    # against the machine: a decode step's bytes a second beside a plain read of as many
    assert "Decode reads" in stdout and "GFLOP/s in the linear layers" in stdout
    assert result["decode_read_gb_per_second"] > 0 and result["plain_read_gb_per_second"] > 0


def test_bench_latency_code_edit_with_speculation(tiny_model, tmp_path):
    """The input-grounded workload (a chat request over library source) with n-gram
    speculation: the acceptance figures come with the latency ones."""
    out = tmp_path / "latency.json"
    result = run(["latency", "--model", str(tiny_model("llama")), *ENGINE, "--prompts",
                  "code-edit", "--input-len", "120", "--output-len", "6", "--batch-size", "2",
                  "--num-iters-warmup", "0", "--num-iters", "2", "--output-json", str(out),
                  "--speculative-config",
                  '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}'])
    assert "Speculative decoding:" in result.stdout
    assert "mean acceptance length" in result.stdout
    # (adaptive, by default: the step times it decides by are measured at startup)
    assert "Decode step times measured for speculation" in result.stderr
    figures = json.loads(out.read_text())
    assert 0 <= figures["spec_acceptance_rate"] <= 1
    assert figures["spec_mean_acceptance_length"] >= 1


def test_bench_gemm(tiny_model, tmp_path):
    """Every GEMM path this CPU runs, timed on the model's layer shapes, and one prompt
    step through the engine against their peak."""
    from cpullm.platform import cpu_info

    out = tmp_path / "gemm.json"
    stdout = run(["gemm", "--model", str(tiny_model("llama")), "--rows", "1", "40",
                  "--iters", "2", "--prompt-tokens", "256", "--output-json", str(out)]).stdout
    assert "peak at 40 rows" in stdout and "of the peak" in stdout
    result = json.loads(out.read_text())
    flags = cpu_info().flags
    paths = set(result["gmacs"])
    assert "onednn" in paths
    assert ("avx512_bf16" in paths) == ("avx512_bf16" in flags)
    assert ("amx" in paths) == ("amx_bf16" in flags and "avx512_bf16" in flags)
    assert all(figure > 0 for path in result["gmacs"].values() for figure in path.values())
    assert result["peak_gmacs"] == max(path["40"] for path in result["gmacs"].values())
    assert result["prompt_step_gmacs"] > 0


def test_bench_serve(tiny_model, tmp_path):
    model = str(tiny_model("llama"))
    server = RemoteServer([model, *ENGINE])
    try:
        chats = ("openai-chat", "openai-responses", "anthropic-messages")
        prompt_tokens = {}
        for backend in ("openai", *chats):
            stdout = run(["serve", "--base-url", server.url, "--tokenizer", model,
                          "--backend", backend, "--num-prompts", "5", "--random-input-len",
                          "16", "--random-output-len", "6", "--max-concurrency", "2",
                          "--save-result", "--result-dir", str(tmp_path), "--result-filename",
                          f"{backend}.json"]).stdout
            assert "Serving Benchmark Result" in stdout
            result = json.loads((tmp_path / f"{backend}.json").read_text())
            assert result["completed"] == 5 and result["failed"] == 0, backend
            assert result["total_output_tokens"] == 5 * 6
            # the server's prompt counts: a chat prompt is the text plus the chat template
            assert (result["total_input_tokens"] > 5 * 16 if backend in chats
                    else result["total_input_tokens"] == 5 * 16)
            assert result["mean_ttft_ms"] > 0 and result["p99_itl_ms"] > 0
            prompt_tokens[backend] = result["total_input_tokens"]
        # the same conversation, whichever API it came through
        assert len({prompt_tokens[backend] for backend in chats}) == 1
    finally:
        server.stop()


def test_random_prompts_have_the_asked_length_as_text(tokenizer_dir):
    """The chat backend sends text: it must tokenize to the asked length, as the ids do."""
    import argparse

    from transformers import AutoTokenizer

    from cpullm.benchmarks.datasets import sample_requests

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    args = argparse.Namespace(num_prompts=20, seed=1, dataset_name="random", dataset_path=None,
                              random_input_len=64, random_output_len=8, random_range_ratio=0.0)
    requests = sample_requests(args, tokenizer)
    assert [len(r.prompt_token_ids) for r in requests] == [64] * 20
    assert [tokenizer.encode(r.prompt, add_special_tokens=False) for r in requests] == \
        [r.prompt_token_ids for r in requests]


def test_bench_embeddings_offline_and_served(tmp_path):
    """The default embedding model: texts/s offline, and through /v1/embeddings."""
    out = tmp_path / "embed.json"
    stdout = run(["throughput", "--task", "embed", "--dtype", "float32", "--num-prompts", "12",
                  "--random-input-len", "16", "--output-json", str(out)]).stdout
    assert "texts/s" in stdout
    result = json.loads(out.read_text())
    assert result["num_requests"] == 12 and result["total_num_tokens"] == 12 * 16
    server = RemoteServer(["--task", "embed", "--dtype", "float32"])
    try:
        stdout = run(["serve", "--base-url", server.url, "--backend", "openai-embeddings",
                      "--num-prompts", "10", "--random-input-len", "16", "--max-concurrency",
                      "4", "--save-result", "--result-dir", str(tmp_path), "--result-filename",
                      "served.json"]).stdout
        assert "Embedding Serving Benchmark Result" in stdout
        result = json.loads((tmp_path / "served.json").read_text())
        assert result["completed"] == 10 and result["total_input_tokens"] == 10 * 16
        assert result["request_throughput"] > 0 and result["p99_e2el_ms"] > 0
    finally:
        server.stop()
