"""Shared fixtures: tiny random-weight models saved by transformers into temp folders; the
test tiers (markers, below)."""

from __future__ import annotations

import functools
import inspect
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

# Modules whose every test runs the engine in processes of its own (ranks, replicas, the
# engine core): the "multiproc" tier.
MULTIPROC_MODULES = ("test_parallel", "test_engine_process")


@functools.cache
def _starts_a_server(function: Any) -> bool:
    try:
        return "RemoteServer(" in inspect.getsource(function)
    except (OSError, TypeError):
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Marks the tiers that `make test-fast` leaves out: "server" for a test that starts an
    HTTP server, itself or through one of its fixtures; "multiproc" for MULTIPROC_MODULES'
    tests ("slow" is marked where the test is)."""
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        functions = [getattr(item, "function", None)]
        for name in item.fixturenames:
            functions += [d.func for d in (info.name2fixturedefs.get(name, ()) if info else ())]
        if any(_starts_a_server(f) for f in functions if f is not None):
            item.add_marker(pytest.mark.server)
        if item.module is not None and item.module.__name__ in MULTIPROC_MODULES:
            item.add_marker(pytest.mark.multiproc)


TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6,
            # Wide initial weights give peaked logits, so float32 rounding differences
            # between two correct implementations do not flip a greedy argmax.
            initializer_range=0.3, bos_token_id=None, eos_token_id=None, pad_token_id=None)

ARCHITECTURES: dict[str, dict[str, Any]] = {
    "llama": dict(cls="LlamaConfig"),
    "llama3-rope-tied": dict(cls="LlamaConfig", tie_word_embeddings=True,
                             rope_parameters=dict(rope_type="llama3", rope_theta=500000.0,
                                                  factor=8.0, low_freq_factor=1.0,
                                                  high_freq_factor=4.0,
                                                  original_max_position_embeddings=64)),
    "mistral": dict(cls="MistralConfig", sliding_window=None),
    "qwen2": dict(cls="Qwen2Config"),
    "qwen3": dict(cls="Qwen3Config", head_dim=16),
    "granite": dict(cls="GraniteConfig", embedding_multiplier=3.0, attention_multiplier=0.05,
                    residual_multiplier=0.6, logits_scaling=2.5),
    # LongRoPE (short factors: the sequences stay within its pretraining length, as the
    # golden tests compare with transformers, which recomputes a sequence that outgrows it
    # with the long factors throughout), partial rotary,
    # and a window shorter than the longer prompts
    "phi3": dict(cls="Phi3Config", sliding_window=48, original_max_position_embeddings=256,
                 rope_parameters=dict(
        rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=0.5,
        short_factor=[1.0, 1.2, 1.5, 2.0], long_factor=[1.5, 2.5, 4.0, 8.0],
        original_max_position_embeddings=256)),
    # layer 0 sparse, layer 1 dense (mlp_only_layers); 8 experts, 2 a token: some get none
    "qwen3_moe": dict(cls="Qwen3MoeConfig", head_dim=16, num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=32, mlp_only_layers=[1], norm_topk_prob=True),
    "qwen2_moe": dict(cls="Qwen2MoeConfig", num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=32, shared_expert_intermediate_size=48,
                      norm_topk_prob=False),
    "mixtral": dict(cls="MixtralConfig", num_local_experts=8, num_experts_per_tok=2,
                    sliding_window=None),
    "glm": dict(cls="GlmConfig", head_dim=16, partial_rotary_factor=0.5, attention_bias=True),
    "glm4": dict(cls="Glm4Config", head_dim=16, partial_rotary_factor=0.5, attention_bias=True),
    "gemma": dict(cls="GemmaConfig", head_dim=16),
    # layer 0 sliding (window 24), 1 full; attention and final logit soft-caps tight enough
    # to bite
    "gemma2": dict(cls="Gemma2Config", head_dim=16, sliding_window=24, query_pre_attn_scalar=24,
                   attn_logit_softcapping=2.0, final_logit_softcapping=5.0,
                   layer_types=["sliding_attention", "full_attention"]),
    # layer 0 sliding (window 24, shorter than the prompts), 1 full; a rope base per kind,
    # linear rope scaling on the full layer, and the final logit soft-cap
    "gemma3": dict(cls="Gemma3TextConfig", head_dim=16, sliding_window=24,
                   query_pre_attn_scalar=24, final_logit_softcapping=5.0,
                   layer_types=["sliding_attention", "full_attention"],
                   rope_parameters={"sliding_attention": dict(rope_type="default",
                                                              rope_theta=10000.0),
                                    "full_attention": dict(rope_type="linear", factor=4.0,
                                                           rope_theta=1000000.0)}),
    # layer 0 sliding (window 24), 1 full; YaRN; 8 experts, 2 a token; a SwiGLU limit low
    # enough to clip; the expert biases (zero at init) and the sinks drawn wide
    "gpt_oss": dict(cls="GptOssConfig", head_dim=16, num_local_experts=8,
                    num_experts_per_tok=2, sliding_window=24, swiglu_limit=0.5,
                    layer_types=["sliding_attention", "full_attention"],
                    rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=4.0,
                                         beta_fast=32.0, beta_slow=1.0, truncate=False,
                                         original_max_position_embeddings=256),
                    randomize={"_bias": 0.3, "sinks": 1.0}),
}


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default model's tokenizer (from its GGUF file) saved as tokenizer.json."""
    from cpullm.transformers_utils import load_tokenizer, resolve_model

    path = tmp_path_factory.mktemp("tokenizer")
    load_tokenizer(resolve_model(None)).save_pretrained(path)
    return path


def make_tiny_model(path: Path, tokenizer_dir: Path, arch: str, seed: int = 0) -> Path:
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = dict(ARCHITECTURES[arch])
    config_cls = getattr(transformers, spec.pop("cls"))
    randomize = spec.pop("randomize", {})  # parameter name suffix -> std of a fresh draw
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = config_cls(**{**TINY, "vocab_size": len(tokenizer), **spec})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            std = next((v for suffix, v in randomize.items() if name.endswith(suffix)), None)
            if std is not None:
                param.normal_(0.0, std)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path):
    """Factory: the folder of a tiny random model of the given architecture (cached)."""
    made: dict[str, Path] = {}

    def get(arch: str = "llama") -> Path:
        if arch not in made:
            made[arch] = make_tiny_model(tmp_path_factory.mktemp(arch), tokenizer_dir, arch)
        return made[arch]

    return get


def assert_pool_free(llm: Any) -> None:
    """No request left and every KV block back in the free queue."""
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    pool = engine.scheduler.kv_cache_manager.pool
    assert pool.num_free == pool.num_blocks
    assert all(count == 0 for count in pool.ref_counts)


def quantized_kernels() -> tuple[Any, list[str]]:
    """The kernel table, and the kernels on 16-row tiles (``TiledWeight``) this machine's
    build runs: the int8 dot products in every library (AVX2, AVX-512 VNNI), the AVX-512
    GEMM on dequantized panels wherever the AVX-512 BF16 build runs, the AMX GEMM where the
    CPU has AMX."""
    from cpullm.model_executor.layers.ops import load_ops

    ops = load_ops()
    found = []
    if ops is not None:
        for kernel, run in (("tiled_int8", ops.quant_gemm_tiled_int8),
                            ("tiled_bf16", ops.quant_gemm_tiled_bf16),
                            ("tiled_amx", ops.quant_gemm_tiled_amx)):
            if run is not None:
                found.append(kernel)
    return ops, found


def avx2_kernels() -> Any:
    """The AVX2 library's kernel table where this CPU runs it (the install built it), else
    None: its int8 dot products are what an AVX2-only CPU runs."""
    from cpullm.model_executor.layers.ops import ISA_LEVELS, KernelTable, load_ops, load_prebuilt
    from cpullm.platform.cpu import cpu_info

    level = ISA_LEVELS[0]
    if not level.needs <= cpu_info().flags:
        return None
    ops = load_ops()
    if ops is not None and ops.isa == level.name:
        return ops
    module = load_prebuilt(level)
    return None if module is None else KernelTable.of(module)


def prebuilt_libraries() -> list[Any]:
    """The kernel table of every prebuilt library this CPU runs (AVX2, AVX-512 VNNI,
    AVX-512 BF16), each its own build of the kernels; a library the CPU runs but the
    install did not build from the sources as they are fails the test."""
    from cpullm.model_executor.layers.ops import ISA_LEVELS, KernelTable, load_prebuilt
    from cpullm.platform.cpu import cpu_info

    tables = []
    for level in ISA_LEVELS:
        if level.needs <= cpu_info().flags:
            module = load_prebuilt(level)
            if module is None:
                pytest.fail(f"this CPU runs the {level.name} library, but the install did not "
                            "build it from the sources as they are (make setup)")
            tables.append(KernelTable.of(module))
    return tables


def kernels_or_skip(found: object, needs: set[str], what: str) -> None:
    """Skip a kernel test where the kernel library running here lacks the instruction sets
    ``needs`` (a CPU without them, or CPULLM_KERNEL_ISA set to a lower level). Where it has
    them, finding no kernels (``found`` empty or false) fails the test: a build that lost
    them must not pass for a machine without them."""
    from cpullm.model_executor.layers.ops import chosen_level

    if found:
        return
    level = chosen_level()
    have = level.needs if level is not None else frozenset()
    if needs <= have:
        pytest.fail(f"{what}: the {level.name} kernel library runs here but has none of them")
    pytest.skip(f"{what} need {', '.join(sorted(needs - have))}, which the kernel library "
                "running here lacks")


def amx_or_skip(usable: bool, flag: str, what: str) -> None:
    """Skip an AMX kernel test where the CPU lacks ``flag``, the AVX-512 BF16 library (which
    holds the AMX kernels) is not the one running, or the OS withholds the tile state from
    this process; where all of them hold and the kernel still does not run (``usable``
    false), fail: a build that lost the AMX kernels must not pass for a CPU without AMX."""
    from cpullm.model_executor.layers.ops import chosen_level, load_ops
    from cpullm.platform.cpu import cpu_info

    if usable:
        return
    if flag not in cpu_info().flags:
        pytest.skip(f"{what} needs {flag}, which this CPU lacks")
    level = chosen_level()
    if level is None or level.name != "avx512_bf16":
        pytest.skip(f"{what} is in the avx512_bf16 kernel library, not the one running here")
    ops = load_ops()
    if ops is not None and ops.amx_bf16_ready is not None and not ops.amx_bf16_ready():
        pytest.skip("the OS withholds the AMX tile state from this process")
    pytest.fail(f"{what}: this CPU has {flag} and runs the avx512_bf16 library, but the "
                "kernel is missing")


def quantized_kernel_runs() -> list[tuple[Any, str]]:
    """(kernel table, kernel) for every quantized kernel this machine can run, forced, on a
    weight's 16-row tiles: quantized_kernels()'s, and the AVX2 library's int8 dot products on
    a CPU that runs a higher level."""
    ops, kernels = quantized_kernels()
    runs = [(ops, kernel) for kernel in kernels]
    avx2 = avx2_kernels()
    if avx2 is not None and avx2 is not ops:
        runs.append((avx2, "tiled_int8"))
    return runs


def assert_kept_experts_grouped(moe: Any, hidden_size: int) -> None:
    """A mixture of kept-quantized experts runs grouped (two kernel calls a step), bit for
    bit what its per-expert calls give, for decode-sized and small prompt batches."""
    assert moe.kept_grouped is not None
    grouped = moe.kept_grouped
    torch.manual_seed(0)
    try:
        with torch.inference_mode():
            for tokens in (1, 3, 9):
                x = torch.randn(tokens, hidden_size).to(torch.bfloat16)
                moe.kept_grouped = grouped
                expected = moe(x)
                moe.kept_grouped = None  # expert by expert
                assert torch.equal(expected, moe(x)), tokens
    finally:
        moe.kept_grouped = grouped


def assert_greedy_follows(exact: list[Any], other: list[Any]) -> None:
    """Greedy completions (with logprobs) of two runs agree up to their first difference,
    where each side's token is in the other's top logprobs."""
    for a, b in zip(exact, other, strict=True):
        for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=True)):
            if x != y:
                assert y in a.logprobs[i] and x in b.logprobs[i], (i, a.token_ids, b.token_ids)
                break


# (folder, prompts, max_new_tokens) -> hf_greedy's tokens: the session's folders never
# change, and several tests compare with the same reference (test_parallel: TP and PP)
_HF_GREEDY: dict[tuple[str, tuple[tuple[int, ...], ...], int], list[list[int]]] = {}


def hf_greedy(reference: Any, prompts: list[list[int]], max_new_tokens: int
              ) -> list[list[int]]:
    """transformers' greedy float32 tokens for each prompt, from a model folder (computed
    once a session) or a loaded model, with no end-of-sequence stop."""
    from transformers import AutoModelForCausalLM

    if not isinstance(reference, torch.nn.Module):
        key = (str(reference), tuple(map(tuple, prompts)), max_new_tokens)
        if key not in _HF_GREEDY:
            _HF_GREEDY[key] = hf_greedy(AutoModelForCausalLM.from_pretrained(
                str(reference), dtype=torch.float32), prompts, max_new_tokens)
        return [list(tokens) for tokens in _HF_GREEDY[key]]
    model = reference
    model.generation_config.eos_token_id = None
    results = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens)
        results.append(out[0, len(prompt):].tolist())
    return results


# Token-id prompts of the small end-to-end checks of quantized weights.
GREEDY_PROMPTS = [[1, 2, 3, 4, 5], [100, 2000, 30000, 7]]


def greedy_outputs(model: Any, dtype: str, max_tokens: int = 16, **engine: Any
                   ) -> tuple[torch.nn.Module, list[Any]]:
    """A small engine on ``model`` (a folder or a GGUF file; ``engine``: more LLM
    arguments): the model as loaded, and its greedy completions (with top-5 logprobs) of
    GREEDY_PROMPTS."""
    from cpullm import LLM, SamplingParams

    llm = LLM(model=str(model), dtype=dtype, max_model_len=256, kv_cache_memory_bytes=1 << 24,
              **engine)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=5)
    outputs = llm.generate([{"prompt_token_ids": p} for p in GREEDY_PROMPTS], params,
                           use_tqdm=False)
    return llm.llm_engine.model_runner.model, [o.outputs[0] for o in outputs]

