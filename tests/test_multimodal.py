"""Images in prompts: a tiny random LLaVA (CLIP tower, projector, Llama) with its processor,
saved by transformers; greedy tokens in float32 equal transformers' generate on the same
image(s) and text, for one and two images, with text-only requests in the same batch, and
with chunked prefill splitting an image's tokens; prefix caching keyed by the image."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from cpullm import LLM, SamplingParams

NEW_TOKENS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
PROMPT = "USER: <image>\nWhat is this? ASSISTANT:"
TWO = "USER: <image> and <image>: which is brighter? ASSISTANT:"


def image(seed: int, size: tuple[int, int] = (80, 100)):
    from PIL import Image

    pixels = np.random.default_rng(seed).random((*size, 3)) * 255
    return Image.fromarray(pixels.astype(np.uint8))


@pytest.fixture(scope="module")
def llava(tmp_path_factory, tokenizer_dir) -> tuple[Path, object, object]:
    """(folder, transformers model, processor): CLIP 56x56 in 14-pixel patches (16 image
    tokens an image), the default model's tokenizer with an <image> token."""
    from transformers import (
        AutoTokenizer,
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    path = tmp_path_factory.mktemp("llava")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessor(size={"shortest_edge": 56},
                                           crop_size={"height": 56, "width": 56}),
        tokenizer=tokenizer, patch_size=14, vision_feature_select_strategy="default",
        image_token="<image>", num_additional_image_tokens=1)
    vision = CLIPVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, image_size=56, patch_size=14)
    text = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, vocab_size=len(tokenizer),
                       max_position_embeddings=1024, initializer_range=0.3,
                       bos_token_id=None, eos_token_id=None, pad_token_id=None)
    config = LlavaConfig(vision_config=vision.to_dict(), text_config=text.to_dict(),
                         image_token_index=tokenizer.convert_tokens_to_ids("<image>"))
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config)
    with torch.no_grad():  # the tower and projector drawn wide: the image decides the answer
        for name, param in model.named_parameters():
            if ("vision_tower" in name or "projector" in name) and "norm" not in name:
                param.normal_(0, 0.2)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    model.generation_config.eos_token_id = None
    return path, model.eval(), processor


def reference(llava, prompt: str, images: list) -> list[int]:
    _, model, processor = llava
    inputs = processor(text=prompt, images=images or None, return_tensors="pt")
    out = model.generate(**inputs, do_sample=False, max_new_tokens=NEW_TOKENS)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def request(prompt: str, images: list) -> dict:
    return {"prompt": prompt, "multi_modal_data": {"image": images}} if images \
        else {"prompt": prompt}


def test_images_and_text_in_one_batch_equal_transformers(llava):
    cases = [(PROMPT, [image(0)]), ("USER: hello there ASSISTANT:", []),
             (TWO, [image(1), image(2, (40, 60))]), (PROMPT, [image(3)])]
    llm = LLM(str(llava[0]), dtype="float32", kv_cache_memory_bytes=1 << 24)
    outputs = llm.generate([request(p, i) for p, i in cases], GREEDY, use_tqdm=False)
    expected = [reference(llava, p, i) for p, i in cases]
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert expected[0] != expected[3]  # the image decides: same text, other answer


def test_chunks_split_an_image_and_prefixes_are_keyed_by_it(llava):
    """Chunks of 8 tokens cut each image's 16 tokens in two steps; blocks of 32 tokens that
    hold an image are found again only with that image."""
    llm = LLM(str(llava[0]), dtype="float32", kv_cache_memory_bytes=1 << 24,
              max_num_batched_tokens=8, block_size=32)
    long_prompt = "USER: " + "tell me about it, " * 6 + "<image> now ASSISTANT:"
    first = llm.generate(request(long_prompt, [image(4)]), GREEDY, use_tqdm=False)[0]
    assert first.outputs[0].token_ids == reference(llava, long_prompt, [image(4)])
    again = llm.generate(request(long_prompt, [image(4)]), GREEDY, use_tqdm=False)[0]
    other = llm.generate(request(long_prompt, [image(5)]), GREEDY, use_tqdm=False)[0]
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert again.num_cached_tokens >= 32
    assert other.outputs[0].token_ids == reference(llava, long_prompt, [image(5)])
    # the text before the image is shared; no block holding the other image's tokens is
    image_at = first.prompt_token_ids.index(llm.llm_engine.config.model.mm_config
                                            .image_token_index)
    assert other.num_cached_tokens == image_at // 32 * 32


def test_bad_image_requests_are_refused_by_name(llava, tiny_model):
    llm = LLM(str(llava[0]), dtype="float32", kv_cache_memory_bytes=1 << 24)
    with pytest.raises(ValueError, match="images must be PIL images"):
        llm.generate(request(PROMPT, ["a picture"]), GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="multi_modal_data"):
        llm.generate(request(TWO, [image(0)]), GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="a prompt with images must be text"):
        llm.generate({"prompt_token_ids": [1, 2], "multi_modal_data": {"image": image(0)}},
                     GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="expected"):
        llm.generate({"prompt": PROMPT, "multi_modal_data": {"video": image(0)}}, GREEDY,
                     use_tqdm=False)
    assert llm.generate(request(PROMPT, [image(0)]), GREEDY, use_tqdm=False)[0].outputs
    text_only = LLM(str(tiny_model("llama")), dtype="float32", kv_cache_memory_bytes=1 << 24)
    with pytest.raises(ValueError, match="LlamaForCausalLM takes no images"):
        text_only.generate(request(PROMPT, [image(0)]), GREEDY, use_tqdm=False)


def data_url(picture) -> str:
    import base64
    import io

    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def test_the_server_answers_images_and_refuses_bad_ones(llava, tmp_path):
    """Chat through the openai client: a data-URL image and a local file under
    --allowed-local-media-path answer as transformers does on the same rendered prompt;
    images that cannot be had get a 400 naming why; the server keeps serving."""
    import openai
    from server_utils import RemoteServer
    from transformers import AutoTokenizer

    folder, _, processor = llava
    tokenizer = AutoTokenizer.from_pretrained(folder)
    picture, other = image(6), image(7, (30, 90))
    other.save(tmp_path / "other.png")
    server = RemoteServer([str(folder), "--dtype", "float32", "--max-model-len", "512",
                           "--allowed-local-media-path", str(tmp_path),
                           "--limit-mm-per-prompt", '{"image": 2}'])
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")

        def ask(parts: list[dict]) -> str:
            answer = client.chat.completions.create(
                model=str(folder), messages=[{"role": "user", "content": parts}],
                max_tokens=NEW_TOKENS, temperature=0, extra_body={"ignore_eos": True})
            return answer.choices[0].message.content

        def expected(text: str, images: list) -> str:
            prompt = tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], tokenize=False,
                add_generation_prompt=True)
            inputs = processor(text=prompt, images=images, return_tensors="pt",
                               add_special_tokens=False)
            out = llava[1].generate(**inputs, do_sample=False, max_new_tokens=NEW_TOKENS)
            return tokenizer.decode(out[0, inputs["input_ids"].shape[1]:],
                                    skip_special_tokens=True)

        parts = [{"type": "text", "text": "Look: "},
                 {"type": "image_url", "image_url": {"url": data_url(picture)}},
                 {"type": "text", "text": " and "},
                 {"type": "image_url", "image_url": {"url": f"file://{tmp_path}/other.png"}}]
        assert ask(parts) == expected("Look: <image> and <image>", [picture, other])

        def refused(parts: list[dict], match: str) -> None:
            with pytest.raises(openai.BadRequestError, match=match):
                ask(parts)

        url = {"type": "image_url", "image_url": {"url": data_url(picture)}}
        refused([url] * 3, "3 images in the conversation; this server takes at most 2")
        refused([{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}],
                "not an image PIL can read")
        refused([{"type": "image_url", "image_url": {"url": "data:text/plain,hi"}}],
                "a data URL must be")
        refused([{"type": "image_url", "image_url": {"url": "/etc/hostname"}}],
                "not under --allowed-local-media-path")
        refused([{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}],
                "--allow-remote-media")
        assert ask([{"type": "text", "text": "just text"}])
        assert server.wait_idle()["vllm:num_requests_running"] == 0
    finally:
        assert server.stop() == 0
    assert "Traceback" not in server.log()


def test_a_text_model_refuses_images(tiny_model):
    import openai
    from server_utils import RemoteServer

    server = RemoteServer([str(tiny_model("llama")), "--dtype", "float32",
                           "--max-model-len", "256"])
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
        part = {"type": "image_url", "image_url": {"url": data_url(image(0))}}
        with pytest.raises(openai.BadRequestError, match="takes no images"):
            client.chat.completions.create(model=str(tiny_model("llama")), max_tokens=4,
                                           messages=[{"role": "user", "content": [part]}])
    finally:
        assert server.stop() == 0


def test_other_vision_language_models_are_refused_by_name(tmp_path):
    from transformers import Qwen2_5_VLConfig

    config = Qwen2_5_VLConfig(architectures=["Qwen2_5_VLForConditionalGeneration"])
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="'Qwen2_5_VLForConditionalGeneration': this "
                       "vision-language model is not supported yet"):
        LLM(str(tmp_path))


def test_llm_chat_takes_image_parts(llava):
    """LLM.chat with vLLM's offline image parts (image_pil, and image_url with a data URL)
    answers as transformers on the same rendered conversation."""
    from transformers import AutoTokenizer

    folder, model, processor = llava
    tokenizer = AutoTokenizer.from_pretrained(folder)
    llm = LLM(str(folder), dtype="float32", kv_cache_memory_bytes=1 << 24)
    conversation = [{"role": "user", "content": [
        {"type": "image_pil", "image_pil": image(8)}, {"type": "text", "text": " and "},
        {"type": "image_url", "image_url": {"url": data_url(image(9))}}]}]
    got = llm.chat([conversation, [{"role": "user", "content": "no picture"}]], GREEDY,
                   use_tqdm=False)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "<image> and <image>"}],
                                           tokenize=False, add_generation_prompt=True)
    inputs = processor(text=prompt, images=[image(8), image(9)], return_tensors="pt",
                       add_special_tokens=False)
    out = model.generate(**inputs, do_sample=False, max_new_tokens=NEW_TOKENS)
    assert got[0].outputs[0].token_ids == out[0, inputs["input_ids"].shape[1]:].tolist()
    assert len(got[1].outputs[0].token_ids) == NEW_TOKENS
