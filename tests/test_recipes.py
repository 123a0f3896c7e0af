"""Recipes (`cpullm recipe`) planned on fixture machines and hardware classes, and vLLM's
`--config config.yml` that `cpullm serve` reads them from."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from cpu_platform.machines import MACHINES, make_machine

from cpullm.engine_args import EngineArgs
from cpullm.entrypoints.cli import _with_config_file, build_parser, main
from cpullm.recipes import ModelFacts, make_recipe, model_facts
from cpullm.recipes.hardware import class_of, resolve_hardware


def _machine(tmp_path: Path, name: str) -> str:
    return str(make_machine(tmp_path / name, **MACHINES[name]))


def _written(recipe, folder: Path) -> tuple[dict, dict[str, str]]:
    recipe.write(folder)
    config = yaml.safe_load((folder / "config.yml").read_text())
    env = {}
    for line in (folder / "env.sh").read_text().splitlines():
        if line.startswith("export "):
            key, _, value = line.removeprefix("export ").partition("=")
            env[key] = value.strip("'")
    return config, env


@pytest.mark.parametrize("machine, hardware, env", [
    # two sockets of 4 cores with AMX: a replica per socket, one core each left to the
    # front-end; the tiny model's 128 sequences of 1024 tokens need 1 GiB of KV cache
    ("xeon-2s", "xeon5", {"VLLM_CPU_OMP_THREADS_BIND": "0-2|4-6",
                          "VLLM_CPU_NUM_OF_RESERVED_CPU": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}),
    ("zen4", "epyc-zen5", {"VLLM_CPU_OMP_THREADS_BIND": "0-6",
                           "VLLM_CPU_NUM_OF_RESERVED_CPU": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}),
    ("arm", "graviton4", {"VLLM_CPU_OMP_THREADS_BIND": "0-2",
                          "VLLM_CPU_NUM_OF_RESERVED_CPU": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}),
    # a container allowed CPUs 2-5 and 10-11 (cores 2, 3 of socket 0, their second threads,
    # and cores 0, 1 of socket 1): two cores a rank, too few to give one away
    ("container", "xeon5", {"VLLM_CPU_OMP_THREADS_BIND": "2-3|4-5",
                            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}),
])
def test_recipe_on_fixture_machines(tmp_path, tiny_model, machine, hardware, env):
    model = str(tiny_model("llama"))
    recipe = make_recipe(model, "auto", root=_machine(tmp_path, machine))
    assert recipe.hardware.name == hardware and recipe.hardware.detected
    config, written = _written(recipe, tmp_path / "out")
    assert written == env
    replicas = 2 if machine in ("xeon-2s", "container") else 1
    budgets = {"xeon5": (128, 4096), "epyc-zen5": (256, 2048), "graviton4": (128, 2048)}
    assert config == {"model": model, "dtype": "bfloat16", "tensor-parallel-size": 1,
                      "pipeline-parallel-size": 1, "data-parallel-size": replicas,
                      "max-num-seqs": budgets[hardware][0],
                      "max-num-batched-tokens": budgets[hardware][1], "block-size": 128,
                      "enable-prefix-caching": True}


def test_container_binding_matches_the_engine(tmp_path):
    """The container's lists are the engine's own auto binding of two ranks there."""
    from cpullm.platform import CpuTopology, plan_binding

    topology = CpuTopology.detect(_machine(tmp_path, "container"))
    plan = plan_binding(topology, "auto", 2, 0)
    assert [list(c) for c in plan.rank_cpus] == [[2, 3], [4, 5]]


def test_classes_of_cpus(tmp_path):
    from cpullm.platform import CpuInfo

    xeon6 = CpuInfo("GenuineIntel", "Intel(R) Xeon(R) 6767P", frozenset({"amx_bf16"}))
    assert class_of(xeon6) == "xeon6"
    assert class_of(CpuInfo("GenuineIntel", "Old", frozenset({"avx2"}))) == "generic"
    assert resolve_hardware("auto", _machine(tmp_path, "xeon-1s-ht")).name == "xeon5"
    with pytest.raises(ValueError, match="unknown class 'xeon9'.*xeon6"):
        resolve_hardware("xeon9")


def test_named_hardware_and_a_model_not_on_this_machine(tmp_path):
    """A hub name is planned from what it says (a 70B model: 130 GiB of bfloat16)."""
    recipe = make_recipe("meta-llama/Llama-3.1-70B-Instruct", "xeon6")
    assert (recipe.config["tensor-parallel-size"], recipe.config["data-parallel-size"]) == (1, 2)
    assert recipe.env["VLLM_CPU_OMP_THREADS_BIND"] == "0-62|64-126"
    # 0.5 x (512 GiB - 130.4 GiB of weights - 2 GiB of runtime)
    assert recipe.env["VLLM_CPU_KVCACHE_SPACE"] == "189"
    latency = make_recipe("meta-llama/Llama-3.1-70B-Instruct", "xeon6", "latency")
    assert latency.config["tensor-parallel-size"] == 2
    assert latency.config["data-parallel-size"] == 1
    assert latency.config["max-num-batched-tokens"] == 1024
    assert latency.env["VLLM_CPU_KVCACHE_SPACE"] == str(int(0.5 * (512 - 130.4 / 2 - 2)))
    # 810 GiB: more than the two nodes' weight shares hold
    with pytest.raises(ValueError, match="do not fit the 2 NUMA node"):
        make_recipe("meta-llama/Llama-3.1-405B-Instruct", "xeon6")
    with pytest.raises(ValueError, match="no variant 'int2'.*latency"):
        make_recipe("meta-llama/Llama-3.1-8B-Instruct", "xeon6", "int2")
    # a mixture of experts by its name: its own recipe, with the wider token budget
    moe = make_recipe("Qwen/Qwen3-30B-A3B", "epyc-zen5")
    assert moe.family == "moe" and moe.config["max-num-batched-tokens"] == 4096
    assert "latency" not in str(moe.variant)


def test_weights_that_need_two_nodes_split_by_heads(tmp_path):
    facts = ModelFacts("big", "default", "generate", weight_bytes=400 << 30,
                       kv_bytes_per_token=160 << 10, max_model_len=8192, num_heads=64,
                       num_kv_heads=8)
    recipe = make_recipe("big", "xeon6", facts=facts)
    assert (recipe.config["tensor-parallel-size"], recipe.config["pipeline-parallel-size"]) \
        == (2, 1)
    odd = ModelFacts("odd", "default", "generate", weight_bytes=400 << 30, num_heads=25,
                     num_kv_heads=5)
    recipe = make_recipe("odd", "xeon6", facts=odd)
    assert (recipe.config["tensor-parallel-size"], recipe.config["pipeline-parallel-size"]) \
        == (1, 2)


def test_the_default_models(tmp_path):
    """The GGUF chat model takes the recipe's gguf variant; the embedding model is an
    encoder: no KV cache, a replica per node, a budget that holds its longest input."""
    chat = make_recipe(None, "xeon6")
    assert chat.variant == "gguf" and "model" not in chat.config
    assert chat.config["quantization"] == "gguf"
    facts = model_facts("sentence-transformers/all-MiniLM-L6-v2")
    assert (facts.family, facts.task) == ("encoder", "embed")
    embed = make_recipe("sentence-transformers/all-MiniLM-L6-v2", "epyc-zen5")
    assert embed.config["task"] == "embed" and embed.config["data-parallel-size"] == 2
    assert "VLLM_CPU_KVCACHE_SPACE" not in embed.env
    assert embed.config["max-num-batched-tokens"] == 8192


def test_serve_reads_the_config_file(tmp_path, tiny_model, monkeypatch):
    """`cpullm serve --config config.yml` takes a recipe's flags, checked by the flags
    themselves; the command line wins; the engine accepts the result."""
    model = str(tiny_model("llama"))
    recipe = make_recipe(model, "auto", root=_machine(tmp_path, "zen4"))
    recipe.write(tmp_path)
    parser = build_parser()
    argv = ["serve", "--config", str(tmp_path / "config.yml"), "--max-num-seqs", "8"]
    _with_config_file(parser, argv)
    args = parser.parse_args(argv)
    assert (args.model, args.max_num_seqs, args.max_num_batched_tokens, args.block_size) == (
        model, 8, 2048, 128)
    assert args.enable_prefix_caching is True
    config = EngineArgs.from_cli_args(args).create_engine_config()
    assert config.scheduler.max_num_seqs == 8
    assert config.scheduler.max_num_batched_tokens == 2048
    # the positional model wins over the file's
    parser = build_parser()
    argv = ["serve", "other-model", "--config", str(tmp_path / "config.yml")]
    _with_config_file(parser, argv)
    assert parser.parse_args(argv).model_tag == "other-model"


@pytest.mark.parametrize("text, message", [
    ("frobnicate: 1\n", "unknown key 'frobnicate' \\(no flag --frobnicate\\)"),
    ("max-num-seqs: many\n", "argument --max-num-seqs: invalid int value: 'many'"),
    ("enforce-eager: 3\n", "key 'enforce-eager': expected true or false"),
    ("port: [1, 2]\n", "key 'port': takes one value"),
    ("- a\n- b\n", "expected a mapping"),
    ("a: [\n", "not valid YAML"),
])
def test_bad_config_files_are_refused_by_name(tmp_path, capsys, text, message):
    path = tmp_path / "config.yml"
    path.write_text(text)
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--config", str(path)])
    assert exit_info.value.code == 2
    assert f"--config {path}" in capsys.readouterr().err
    path.write_text(text)
    parser = build_parser()
    with pytest.raises(ValueError, match=message):
        _with_config_file(parser, ["serve", "--config", str(path)])


def test_recipe_command(tmp_path, capsys):
    assert main(["recipe", "--list"]) == 0
    listed = capsys.readouterr().out
    assert all(name in listed for name in ("xeon6", "xeon5", "epyc-zen5", "graviton4"))
    assert main(["recipe", "--model", "Qwen/Qwen3-8B", "--hardware", "graviton4",
                 "--output-dir", str(tmp_path)]) == 0
    env = (tmp_path / "env.sh").read_text()
    assert "export VLLM_CPU_OMP_THREADS_BIND='0-94|96-190'" in env
    assert "cpullm serve --config" in (tmp_path / "config.yml").read_text()
    assert main(["recipe", "--hardware", "nope"]) == 2
