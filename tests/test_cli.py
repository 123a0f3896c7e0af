"""The command line explains itself: every flag has help with its default; the model is
given the same way to every command; log lines stay off progress bars."""

from __future__ import annotations

import argparse
import logging
import subprocess
import sys

import pytest

from cpullm.entrypoints.cli import build_parser, main


def walk(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from walk(sub, (*path, name))


def test_every_flag_has_a_help_line():
    missing = [f"{' '.join(path) or 'cpullm'} {action.dest}"
               for path, parser in walk(build_parser()) for action in parser._actions
               if not action.help or action.help == argparse.SUPPRESS]
    assert missing == []


@pytest.mark.parametrize("command", [["generate"], ["chat"], ["serve"], ["env"],
                                     ["bench", "throughput"], ["bench", "latency"],
                                     ["bench", "serve"]])
def test_help_shows_defaults(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([*command, "--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # unwrapped
    assert "(default: " in text
    if command[0] != "bench" or command[1] != "serve":
        assert "--model MODEL" in text and "--max-num-seqs MAX_NUM_SEQS" in text
    if command == ["generate"]:
        assert "--max-tokens MAX_TOKENS most tokens to generate per answer (default: 256)" in text
        assert "sampling temperature; 0 is greedy (default: 0.0)" in text
    if command == ["serve"]:
        assert "(default: 128)" in text  # serving's own max_num_seqs
        for name in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND",
                     "VLLM_CPU_NUM_OF_RESERVED_CPU", "docs/configuration.md"):
            assert name in text


def test_serve_takes_the_model_both_ways():
    parser = build_parser()
    assert parser.parse_args(["serve", "m"]).model_tag == "m"
    assert parser.parse_args(["serve", "--model", "m"]).model == "m"
    for command in (["generate", "x"], ["chat"], ["env"], ["bench", "throughput"]):
        assert parser.parse_args([*command, "--model", "m"]).model == "m"


def test_serve_refuses_two_different_models(capsys):
    assert main(["serve", "one", "--model", "two"]) == 2
    assert "given twice" in capsys.readouterr().err


def test_log_lines_land_above_a_progress_bar():
    script = (
        "from tqdm import tqdm\n"
        "from cpullm.logger import init_logger, logging_to_tqdm\n"
        "log = init_logger('cpullm.check')\n"
        "with logging_to_tqdm():\n"
        "    bar = tqdm(total=2, desc='Processed prompts', mininterval=0)\n"
        "    bar.update(1)\n"
        "    log.info('a line between updates')\n"
        "    bar.update(1)\n"
        "    bar.close()\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    line = next(line for line in result.stderr.split("\n") if "a line between" in line)
    # What is left visible on that terminal line (after the last carriage return).
    assert line.rsplit("\r", 1)[-1].startswith("INFO"), repr(line)


def test_kv_cache_default_says_why(tiny_model, monkeypatch):
    from cpullm.engine_args import EngineArgs

    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore
    root = logging.getLogger("cpullm")
    root.addHandler(handler)
    try:
        EngineArgs(model=str(tiny_model("llama")), dtype="float32", block_size=32,
                   max_model_len=256, max_num_seqs=3).create_engine_config()
    finally:
        root.removeHandler(handler)
    line = next(r for r in records if r.startswith("KV cache:"))
    assert "what max_num_seqs=3 requests of max_model_len=256 tokens can fill" in line
    assert "VLLM_CPU_KVCACHE_SPACE" in line


def test_models_lists_every_architecture_the_registry_runs(capsys):
    from cpullm.model_executor.models import MODEL_REGISTRY

    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in MODEL_REGISTRY)
    assert "Gemma3ForCausalLM" in out and "awq, gptq, compressed-tensors" in out
