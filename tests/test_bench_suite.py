"""`cpullm bench suite`: case files in vLLM CPU's shape, dry runs, filters, and one small
suite run for real against the default models."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from server_utils import free_port

from cpullm.benchmarks.suite import DEFAULT_SERVING_JSON, SUITE_DIR, load_cases, to_flags
from cpullm.entrypoints.cli import main

CASES = {
    "defaults": {"qps_list": [1, "inf"], "max_concurrency_list": [2],
                 "server_environment_variables": {"VLLM_CPU_KVCACHE_SPACE": 1},
                 "server_parameters": {"dtype": "bfloat16", "block_size": 16},
                 "client_parameters": {"backend": "vllm", "num_prompts": 4}},
    "tests": [
        {"test_name": "small_bf16", "server_parameters": {"model": "m/small"},
         "client_parameters": {"random_input_len": 8, "ignore_eos": ""}},
        {"test_name": "small_fp32", "server_parameters": {"model": "m/small", "dtype": "float32",
                                                          "enforce_eager": ""},
         "max_concurrency_list": [1, 4]},
        {"test_name": "big_bf16", "server_parameters": {"model": "m/big",
                                                        "tensor_parallel_size": 2},
         "server_environment_variables": {"VLLM_CPU_OMP_THREADS_BIND": "0-3|4-7"}},
    ],
}


def _write(tmp_path: Path, data: object) -> Path:
    path = tmp_path / "cases.json"
    path.write_text(json.dumps(data))
    return path


def test_dry_run_writes_the_commands_of_the_filtered_cases(tmp_path, monkeypatch, capsys):
    """DRY_RUN=1, SERVING_JSON, MODEL_FILTER and DTYPE_FILTER, as vLLM's script reads them."""
    results = tmp_path / "results"
    monkeypatch.setenv("DRY_RUN", "1")
    monkeypatch.setenv("ON_CPU", "1")
    monkeypatch.setenv("SERVING_JSON", str(_write(tmp_path, CASES)))
    monkeypatch.setenv("MODEL_FILTER", "m/small")
    monkeypatch.setenv("DTYPE_FILTER", "float32")
    assert main(["bench", "suite", "--results-dir", str(results), "--port", "8123"]) == 0
    assert sorted(p.name for p in results.iterdir()) == [
        "small_fp32_qps_1_concurrency_1.commands", "small_fp32_qps_1_concurrency_4.commands",
        "small_fp32_qps_inf_concurrency_1.commands", "small_fp32_qps_inf_concurrency_4.commands"]
    commands = json.loads((results / "small_fp32_qps_inf_concurrency_4.commands").read_text())
    assert commands == {
        "server_command": "VLLM_CPU_KVCACHE_SPACE=1 cpullm serve --dtype float32 --block-size "
                          "16 --model m/small --enforce-eager --port 8123",
        "client_command": "cpullm bench serve --backend vllm --num-prompts 4 --base-url "
                          "http://127.0.0.1:8123 --request-rate inf --save-result --result-dir "
                          f"{results} --result-filename small_fp32_qps_inf_concurrency_4.json "
                          "--max-concurrency 4"}
    assert "small_fp32: commands written (4 client runs)" in capsys.readouterr().out

    monkeypatch.setenv("MODEL_FILTER", "m/big")
    monkeypatch.delenv("DTYPE_FILTER")
    assert main(["bench", "suite", "--results-dir", str(results)]) == 0
    big = json.loads((results / "big_bf16_qps_1_concurrency_2.commands").read_text())
    assert big["server_command"].startswith(
        "VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND='0-3|4-7' cpullm serve")
    assert "--tensor-parallel-size 2" in big["server_command"]


def test_a_filter_that_matches_nothing_fails(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DRY_RUN", "1")
    path = _write(tmp_path, CASES)
    assert main(["bench", "suite", "--serving-json", str(path), "--model-filter", "m/none",
                 "--results-dir", str(tmp_path / "r")]) == 2
    assert "no case of" in capsys.readouterr().err and not (tmp_path / "r").exists()


@pytest.mark.parametrize("change, message", [
    (lambda d: d["tests"][1].update(server_paramters={}),
     "test 'small_fp32': unknown key 'server_paramters'"),
    (lambda d: d["tests"][0].update(qps_list=[0]),
     "test 'small_bf16': key \"qps_list\": 0 is not a positive number"),
    (lambda d: d["tests"][2].update(max_concurrency_list=[2.5]),
     "test 'big_bf16': key \"max_concurrency_list\": 2.5 is not a positive integer"),
    (lambda d: d["tests"][0].pop("test_name"), "test 0: key \"test_name\""),
    (lambda d: d["tests"][2].update(test_name="small_bf16"), "the name is used twice"),
    (lambda d: d["tests"][0]["server_parameters"].update(model={"a": 1}),
     "test 'small_bf16': key 'server_parameters': 'model' has a value of type dict"),
    (lambda d: d["defaults"].update(client_parameters=[]),
     "defaults: key 'client_parameters': expected an object"),
    (lambda d: d.pop("tests"), "expected an object with a \"tests\" list"),
])
def test_malformed_case_files_name_the_case_and_key(tmp_path, change, message):
    data = json.loads(json.dumps(CASES))
    change(data)
    with pytest.raises(ValueError, match=message.replace("(", "\\(")):
        load_cases(_write(tmp_path, data))


def test_shipped_case_files(tmp_path):
    """The text and embedding case files load; their smoke cases run the default models."""
    text = load_cases(DEFAULT_SERVING_JSON)
    embed = load_cases(SUITE_DIR / "serving-tests-cpu-embed.json")
    assert {"serving_smollm2_random_128_128", "serving_llama8B_xeon6_tp2_random_128_128",
            "serving_llama8B_zen5_tp1_random_128_2048",
            "serving_qwen8B_graviton4_tp1_random_128_128"} <= {c.name for c in text}
    assert {c.model for c in text if c.name.startswith("serving_smollm2")} == {
        "HuggingFaceTB/SmolLM2-135M-Instruct"}
    assert {c.model for c in embed if c.name.startswith("serving_minilm")} == {
        "sentence-transformers/all-MiniLM-L6-v2"}
    tp2 = next(c for c in text if c.name == "serving_llama8B_xeon6_tp2_random_128_128")
    assert tp2.env["VLLM_CPU_OMP_THREADS_BIND"] == "0-62|64-126"
    assert to_flags({"enable_chunked_prefill": "", "x_y": 2, "off": False}) == [
        "--enable-chunked-prefill", "--x-y", "2"]


def _png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", head[16:24])


@pytest.mark.slow
def test_a_small_suite_runs_end_to_end(tmp_path):
    """Two real servers (the default chat and embedding models), their clients, results,
    the table and the plots; a case whose server cannot start is reported and the suite
    goes on."""
    data = {
        "defaults": {"qps_list": ["inf"], "max_concurrency_list": [1, 2],
                     "server_parameters": {"max_num_seqs": 4},
                     "client_parameters": {"num_prompts": 4}},
        "tests": [
            {"test_name": "chat", "server_parameters": {
                "model": "HuggingFaceTB/SmolLM2-135M-Instruct"},
             "client_parameters": {"backend": "vllm", "random_input_len": 16,
                                   "random_output_len": 4}},
            {"test_name": "broken", "server_parameters": {"model": str(tmp_path / "none")}},
            {"test_name": "embed", "server_parameters": {
                "model": "sentence-transformers/all-MiniLM-L6-v2"},
             "client_parameters": {"backend": "openai-embeddings", "random_input_len": 16,
                                   "tokenizer": "sentence-transformers/all-MiniLM-L6-v2"}},
        ]}
    results = tmp_path / "results"
    code = main(["bench", "suite", "--serving-json", str(_write(tmp_path, data)),
                 "--results-dir", str(results), "--port", str(free_port())])
    assert code == 1  # the broken case
    for name in ("chat", "embed"):
        for concurrency in (1, 2):
            result = json.loads((results / f"{name}_qps_inf_concurrency_{concurrency}.json")
                                .read_text())
            assert result["completed"] == 4 and result["failed"] == 0
            assert result["max_concurrency"] == concurrency
    assert json.loads((results / "chat_qps_inf_concurrency_2.json").read_text())[
        "total_output_tokens"] == 16
    table = (results / "benchmark_results.md").read_text().splitlines()
    rows = [line for line in table if line.startswith("| chat") or line.startswith("| embed")
            or line.startswith("| broken")]
    assert len(rows) == 6
    assert all("output tok/s" in r for r in rows if r.startswith("| chat"))
    assert all("texts/s" in r for r in rows if r.startswith("| embed"))
    assert all("failed: the server exited with status 2" in r and "model" in r
               for r in rows if r.startswith("| broken"))
    chat = json.loads((results / "chat.plot.json").read_text())
    assert set(chat) == {"throughput (output tok/s)", "median TTFT (ms)", "median TPOT (ms)"}
    assert all([p[0] for p in curve["qps inf"]] == [1, 2] for curve in chat.values())
    embed = json.loads((results / "embed.plot.json").read_text())
    assert set(embed) == {"throughput (texts/s)", "median latency (ms)"}
    assert _png_size(results / "chat.png") == (1500, 400)  # three panels
    assert _png_size(results / "embed.png") == (1000, 400)
    assert not (results / "broken.png").exists()
