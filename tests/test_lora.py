"""LoRA adapters: PEFT adapters made by peft on tiny random models, greedy tokens in float32
equal to transformers running each adapter merged (``merge_and_unload``), one adapter at a
time and a batch mixing three adapters and the base model; adapters on a kept-quantized
GGUF base; the server's flags and routes through the openai client; bad adapters."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import GREEDY_PROMPTS, assert_greedy_follows, hf_greedy, quantized_kernels
from test_gguf_quant import mixed_gguf  # noqa: F401 - the fixture

from cpullm import LLM, SamplingParams
from cpullm.lora import LoRARequest

NEW_TOKENS = 12
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [100, 2000, 30000, 7], list(range(40, 300, 3))]
ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


def make_adapter(base: Path, path: Path, seed: int, rank: int = 8, alpha: float = 16,
                 modules: list[str] | None = None, rslora: bool = False) -> Path:
    """A random PEFT adapter of ``base`` saved in ``path``, with its merged model beside it
    (``path/merged``) for the reference."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    if (path / "merged").exists():
        return path
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=modules or ALL_MODULES,
                        use_rslora=rslora, init_lora_weights=False)
    torch.manual_seed(seed)
    peft_model = get_peft_model(model, config)
    with torch.no_grad():  # B starts at zero in PEFT's init; drawn wide enough to matter
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.normal_(0, 0.3)
    peft_model.save_pretrained(path)
    peft_model.merge_and_unload().save_pretrained(path / "merged")
    return path


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory):
    """The tiny Llama and three adapters of it: rank 8 on everything, rank 4 on attention
    only (rsLoRA), rank 16 on the MLP only."""
    base = tiny_model("llama")
    root = tmp_path_factory.mktemp("lora")
    made = [make_adapter(base, root / "a", 1),
            make_adapter(base, root / "b", 2, rank=4, alpha=8, rslora=True,
                         modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
            make_adapter(base, root / "c", 3, rank=16, alpha=8,
                         modules=["gate_proj", "up_proj", "down_proj"])]
    return base, made


def requests_of(paths: list[Path]) -> list[LoRARequest]:
    return [LoRARequest(path.name, i + 1, str(path)) for i, path in enumerate(paths)]


def test_one_adapter_equals_transformers_merged(adapters):
    base, paths = adapters
    llm = LLM(str(base), dtype="float32", enable_lora=True, max_lora_rank=16,
              kv_cache_memory_bytes=1 << 24)
    lora = requests_of(paths)[0]
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY,
                           use_tqdm=False, lora_request=lora)
    assert [o.outputs[0].token_ids for o in outputs] == \
        hf_greedy(paths[0] / "merged", PROMPTS, NEW_TOKENS)
    base_outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY,
                                use_tqdm=False)
    expected_base = hf_greedy(base, PROMPTS, NEW_TOKENS)
    assert [o.outputs[0].token_ids for o in base_outputs] == expected_base
    assert expected_base != hf_greedy(paths[0] / "merged", PROMPTS, NEW_TOKENS)


@pytest.mark.parametrize("max_loras", [3, 1])
def test_a_batch_mixes_three_adapters_and_the_base(adapters, max_loras):
    """Every prompt under every adapter and the base model in one call: with three slots
    one step runs all of them; with one, requests of the other adapters wait for a slot.
    The same prompts under different adapters never share KV blocks (prefix caching on)."""
    base, paths = adapters
    llm = LLM(str(base), dtype="float32", enable_lora=True, max_loras=max_loras,
              max_lora_rank=16, kv_cache_memory_bytes=1 << 24, block_size=32)
    loras = [None, *requests_of(paths)]
    prompts = [{"prompt_token_ids": p} for _ in loras for p in PROMPTS]
    per_prompt = [lora for lora in loras for _ in PROMPTS]
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=per_prompt)
    got = [o.outputs[0].token_ids for o in outputs]
    expected = []
    for folder in [base, *(p / "merged" for p in paths)]:
        expected += hf_greedy(folder, PROMPTS, NEW_TOKENS)
    assert got == expected
    # a second round finds each adapter's own prompt blocks cached, and is still exact
    again = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=per_prompt)
    assert [o.outputs[0].token_ids for o in again] == expected
    assert all(o.num_cached_tokens == 64 for o in again if len(o.prompt_token_ids) > 64)


@pytest.mark.slow
@pytest.mark.parametrize("mixed_gguf", ["llama"], indirect=True)
def test_an_adapter_on_a_kept_quantized_gguf_base(mixed_gguf, tmp_path):  # noqa: F811
    """A GGUF base of K-quant and legacy blocks: in float32 (dequantized) exactly
    transformers with the adapter merged into the dequantized weights; in bfloat16 (kept
    quantized, the adapter's products beside the blocks) following it."""
    from transformers import AutoModelForCausalLM

    from cpullm.model_executor.layers.quantization.kept import QuantizedWeight

    dequantized = tmp_path / "dequantized"  # (a model read from GGUF is not saved as it is)
    read = AutoModelForCausalLM.from_pretrained(str(mixed_gguf.parent), gguf_file=mixed_gguf.name,
                                                dtype=torch.float32)
    read.config.__dict__.pop("quantization_config", None)
    plain = AutoModelForCausalLM.from_config(read.config, dtype=torch.float32)
    plain.load_state_dict(read.state_dict())
    plain.save_pretrained(dequantized)
    adapter = make_adapter(dequantized, tmp_path / "adapter", 4)
    lora = LoRARequest("gguf", 1, str(adapter))
    prompts = [{"prompt_token_ids": p} for p in GREEDY_PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=5)
    exact = LLM(str(mixed_gguf), dtype="float32", enable_lora=True,
                kv_cache_memory_bytes=1 << 24).generate(prompts, params, use_tqdm=False,
                                                         lora_request=lora)
    assert [o.outputs[0].token_ids for o in exact] == \
        hf_greedy(adapter / "merged", GREEDY_PROMPTS, NEW_TOKENS)
    ops, _ = quantized_kernels()
    if not QuantizedWeight.kernels_run(ops, torch.bfloat16):
        return  # bfloat16 runs dequantized too on this CPU
    llm = LLM(str(mixed_gguf), dtype="bfloat16", enable_lora=True,
              kv_cache_memory_bytes=1 << 24)
    assert llm.llm_engine.config.model.keeps_quantized
    kept = llm.generate(prompts, params, use_tqdm=False, lora_request=lora)
    assert_greedy_follows([o.outputs[0] for o in exact], [o.outputs[0] for o in kept])


def test_bad_adapters_are_refused_by_name(adapters, tmp_path):
    base, paths = adapters
    llm = LLM(str(base), dtype="float32", enable_lora=True, max_lora_rank=8,
              kv_cache_memory_bytes=1 << 24)
    prompt = {"prompt_token_ids": [1, 2, 3]}

    def refused(lora: LoRARequest, match: str) -> None:
        with pytest.raises(ValueError, match=match):
            llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=lora)

    refused(LoRARequest("gone", 9, str(tmp_path / "nowhere")), "'gone'.*no such folder")
    (tmp_path / "empty").mkdir()
    refused(LoRARequest("empty", 9, str(tmp_path / "empty")), "no adapter_config.json")
    refused(LoRARequest("big", 9, str(paths[2])), "rank 16 is over --max-lora-rank 8")
    from safetensors.torch import load_file, save_file

    wrong = tmp_path / "wrong"  # an adapter of a model whose q_proj takes 32 inputs
    shutil.copytree(paths[0], wrong, ignore=shutil.ignore_patterns("merged"))
    tensors = load_file(wrong / "adapter_model.safetensors")
    name = next(k for k in tensors if "q_proj.lora_A" in k)
    tensors[name] = tensors[name][:, :32].contiguous()
    save_file(tensors, wrong / "adapter_model.safetensors")
    refused(LoRARequest("wrong", 9, str(wrong)), r"lora_A \(8, 32\) and lora_B \(64, 8\) "
            "do not fit the base model's layer of 64 inputs")
    stray = tmp_path / "stray"  # a module the base model does not have
    shutil.copytree(paths[0], stray, ignore=shutil.ignore_patterns("merged"))
    tensors = load_file(stray / "adapter_model.safetensors")
    tensors = {k.replace("layers.1.", "layers.7."): v for k, v in tensors.items()}
    save_file(tensors, stray / "adapter_model.safetensors")
    refused(LoRARequest("stray", 9, str(stray)), "layers.7.*does not have as a linear layer")
    dora = tmp_path / "dora"
    shutil.copytree(paths[0], dora, ignore=shutil.ignore_patterns("merged"))
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    refused(LoRARequest("dora", 9, str(dora)), "DoRA is not supported")
    (dora / "adapter_model.safetensors").write_bytes(b"not a file of tensors")
    (dora / "adapter_config.json").write_text(json.dumps(config))
    refused(LoRARequest("dora", 9, str(dora)), "cannot read adapter_model.safetensors")
    # one id, two adapters
    llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=LoRARequest("a", 1, str(paths[0])))
    refused(LoRARequest("b", 1, str(paths[1])), "lora_int_id 1 is adapter 'a'")
    with pytest.raises(ValueError, match="lora_int_id must be an integer of at least 1"):
        LoRARequest("zero", 0, str(paths[0]))
    without = LLM(str(base), dtype="float32", kv_cache_memory_bytes=1 << 24)
    with pytest.raises(ValueError, match="without LoRA"):
        without.generate(prompt, GREEDY, use_tqdm=False,
                         lora_request=LoRARequest("a", 1, str(paths[0])))
    # nothing of the refused requests is left: the engine still answers
    assert llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_lora_flags_are_checked():
    from cpullm.engine_args import EngineArgs

    with pytest.raises(ValueError, match="max_lora_rank must be one of"):
        EngineArgs(enable_lora=True, max_lora_rank=12).create_engine_config()
    with pytest.raises(ValueError, match="max_cpu_loras .* must be at least max_loras"):
        EngineArgs(enable_lora=True, max_loras=4, max_cpu_loras=2).create_engine_config()
    with pytest.raises(ValueError, match="tensor or pipeline parallelism"):
        EngineArgs(enable_lora=True, pipeline_parallel_size=2).create_engine_config()


def test_the_server_serves_adapters_and_loads_them_at_run_time(adapters):
    """--lora-modules in both of vLLM's forms, /v1/models with each adapter's parent, a
    request's model picking its adapter (completions, chat streamed, concurrent requests of
    every adapter and the base), and the run-time routes behind
    VLLM_ALLOW_RUNTIME_LORA_UPDATING."""
    import asyncio

    import httpx
    import openai
    from server_utils import RemoteServer
    from transformers import AutoTokenizer

    base, paths = adapters
    expected = {name: hf_greedy(folder, PROMPTS, NEW_TOKENS) for name, folder in
                [("base", base), *((p.name, p / "merged") for p in paths)]}
    tokenizer = AutoTokenizer.from_pretrained(base)

    def text(tokens: list[int]) -> str:
        return tokenizer.decode(tokens, skip_special_tokens=True)

    module_b = json.dumps({"name": "b", "path": str(paths[1]), "base_model_name": "tiny"})
    server = RemoteServer([str(base), "--dtype", "float32", "--served-model-name", "base",
                           "--enable-lora", "--max-loras", "2", "--max-lora-rank", "16",
                           "--lora-modules", f"a={paths[0]}", module_b],
                          env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"})
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
        cards = {m.id: m for m in client.models.list().data}
        assert set(cards) == {"base", "a", "b"}
        assert (cards["a"].parent, cards["b"].parent, cards["a"].root) == \
            ("base", "tiny", str(paths[0]))

        def complete(model: str, prompt: list[int]) -> str:
            answer = client.completions.create(model=model, prompt=prompt, max_tokens=NEW_TOKENS,
                                               temperature=0, extra_body={"ignore_eos": True})
            assert answer.model == model
            return answer.choices[0].text

        for name in ("base", "a", "b"):
            assert [complete(name, p) for p in PROMPTS] == \
                [text(t) for t in expected[name]]
        stream = client.chat.completions.create(
            model="a", messages=[{"role": "user", "content": "hi"}], max_tokens=8,
            temperature=0, stream=True)
        chunks = list(stream)
        assert {c.model for c in chunks} == {"a"}
        with pytest.raises(openai.NotFoundError, match="The model `c` does not exist"):
            complete("c", PROMPTS[0])

        # at run time: load c, run every adapter at once (two slots for three adapters),
        # unload it
        http = httpx.Client(base_url=server.url, timeout=60)
        loaded = http.post("/v1/load_lora_adapter",
                           json={"lora_name": "c", "lora_path": str(paths[2])})
        assert loaded.status_code == 200, loaded.text
        assert "Success" in loaded.text
        again = http.post("/v1/load_lora_adapter", json={"lora_name": "c",
                                                         "lora_path": str(paths[2])})
        assert again.status_code == 400 and "already been loaded" in again.text
        bad = http.post("/v1/load_lora_adapter", json={"lora_name": "d",
                                                       "lora_path": str(base)})
        assert bad.status_code == 400 and "no adapter_config.json" in bad.json()["error"]["message"]

        async def all_at_once() -> list[str]:
            async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none") as aio:
                answers = await asyncio.gather(*(
                    aio.completions.create(model=name, prompt=p, max_tokens=NEW_TOKENS,
                                           temperature=0, extra_body={"ignore_eos": True})
                    for name in ("base", "a", "b", "c") for p in PROMPTS))
            return [a.choices[0].text for a in answers]

        assert asyncio.run(all_at_once()) == [text(t) for name in ("base", "a", "b", "c")
                                              for t in expected[name]]
        # unloading c while a request of it streams: the request finishes with c
        stream = client.completions.create(model="c", prompt=PROMPTS[0], max_tokens=200,
                                           temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        chunks = [next(iter(stream))]
        gone = http.post("/v1/unload_lora_adapter", json={"lora_name": "c"})
        assert gone.status_code == 200, gone.text
        chunks += [c for c in stream if c.choices]
        assert "".join(c.choices[0].text for c in chunks).startswith(text(expected["c"][0]))
        assert chunks[-1].choices[0].finish_reason == "length"
        assert http.post("/v1/unload_lora_adapter",
                         json={"lora_name": "c"}).status_code == 404
        with pytest.raises(openai.NotFoundError):
            complete("c", PROMPTS[0])
        assert {m.id for m in client.models.list().data} == {"base", "a", "b"}
        assert server.wait_idle()["vllm:num_requests_running"] == 0
    finally:
        assert server.stop() == 0
    assert "Traceback" not in server.log()


def test_the_runtime_routes_need_the_variable_and_modules_need_the_flag(adapters):
    import subprocess
    import sys

    import httpx
    from server_utils import RemoteServer

    base, paths = adapters
    server = RemoteServer([str(base), "--dtype", "float32", "--enable-lora",
                           "--max-model-len", "256"])
    try:
        answer = httpx.post(f"{server.url}/v1/load_lora_adapter",
                            json={"lora_name": "a", "lora_path": str(paths[0])})
        assert answer.status_code == 404
    finally:
        assert server.stop() == 0
    run = subprocess.run([sys.executable, "-m", "cpullm.entrypoints.cli", "serve", str(base),
                          "--dtype", "float32", "--lora-modules", f"a={paths[0]}"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "--lora-modules needs --enable-lora" in run.stderr
