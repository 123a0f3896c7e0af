"""The default model, SmolLM2-135M-Instruct from its GGUF file, end to end."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_pool_free

from cpullm import LLM, SamplingParams
from cpullm.model_executor.layers.ops import ISA_LEVELS
from cpullm.transformers_utils import resolve_model

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
# Where a prompt's activations are quantized to int8 (every library but the AMX one), the
# layers' int8 blocks move the first token of the answer to QUESTION: in float32 "The" leads
# "L" by 0.082 nats, on the AMX path by 0.120, on AVX-512 "L" leads by 0.186 and on AVX2 by
# 0.094 (Intel Xeon, float32 logits on every path). There the question is asked so that the
# first token is not that coin flip.
QUESTION_ONE_SENTENCE = [{"role": "user",
                          "content": "What is the capital of France? Answer in one sentence."}]


@pytest.fixture(scope="module")
def llm_fp32():
    return LLM(dtype="float32", max_model_len=1024)


def test_gguf_greedy_matches_transformers(llm_fp32):
    from transformers import AutoModelForCausalLM

    source = resolve_model(None)
    reference = AutoModelForCausalLM.from_pretrained(source.directory, gguf_file=source.gguf_file,
                                                     dtype=torch.float32)
    reference.generation_config.eos_token_id = None  # as ignore_eos: always 32 new tokens
    tokenizer = llm_fp32.get_tokenizer()
    prompts = ["The quick brown fox", "def fibonacci(n):\n    ",
               tokenizer.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outputs = llm_fp32.generate(prompts, params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs, strict=True):
        ids = torch.tensor([output.prompt_token_ids])
        expected = reference.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                      max_new_tokens=32)
        assert output.outputs[0].token_ids == expected[0, ids.shape[1]:].tolist(), prompt
    assert_pool_free(llm_fp32)


@pytest.mark.parametrize("level", [level.name for level in ISA_LEVELS])
def test_chat_answers_paris(level, monkeypatch):
    """In bfloat16 the Q4_1 file runs on its blocks as stored (the quantized kernels), on
    each kernel library this CPU runs. On AMX tiles, the plain question: its answer's first
    token leads by 0.08 nats in float32, which logits rounded to bfloat16 (0.06 apart near
    20) tied (QuantizedWeight.logits); on the int8 paths see QUESTION_ONE_SENTENCE."""
    from cpullm.model_executor.layers import ops
    from cpullm.model_executor.layers.quantization.kept import QuantizedWeight
    from cpullm.model_executor.loader import weight_bytes
    from cpullm.platform.cpu import cpu_info

    needs = next(item.needs for item in ISA_LEVELS if item.name == level)
    if not needs <= cpu_info().flags:
        pytest.skip(f"the {level} library needs {', '.join(sorted(needs - cpu_info().flags))}")
    monkeypatch.setenv("CPULLM_KERNEL_ISA", level)
    ops.load_ops.cache_clear()
    try:
        llm = LLM(dtype="bfloat16", max_model_len=1024)
        model = llm.llm_engine.model_runner.model
        assert model.lm_head.ops.isa == level
        loaded = weight_bytes(model)
        assert loaded < 130e6  # the file is 95 MB; in bfloat16 the weights take ~270 MB
        assert abs(llm.llm_engine.config.model.weight_bytes - loaded) < 0.1 * loaded
        assert sum(isinstance(m, QuantizedWeight) for m in model.modules()) == 4 * 30 + 1
        amx = model.lm_head.ops.quant_gemm_tiled_amx is not None
        output = llm.chat(QUESTION if amx else QUESTION_ONE_SENTENCE,
                          SamplingParams(temperature=0, max_tokens=32))[0]
    finally:
        ops.load_ops.cache_clear()
    completion = output.outputs[0]
    assert "Paris" in completion.text, completion.text
    assert completion.finish_reason == "stop"
    assert_pool_free(llm)


def test_server_chat_on_default_model():
    import openai
    from server_utils import RemoteServer

    server = RemoteServer(["--max-model-len", "1024", "--dtype", "float32"])
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        (model,) = client.models.list().data
        reply = client.chat.completions.create(model=model.id, messages=QUESTION,
                                               temperature=0, max_tokens=32)
        assert "Paris" in reply.choices[0].message.content
        assert reply.choices[0].finish_reason == "stop"
    finally:
        assert server.stop() == 0
