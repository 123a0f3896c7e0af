"""The mixture-of-experts layer: the grouped expert computation against a per-token,
per-expert reference loop in float32, for random routings in which some experts get no
token; the end-to-end models are in the golden tests (qwen3_moe, qwen2_moe)."""

from __future__ import annotations

import pytest
import torch
from conftest import kernels_or_skip

from cpullm.model_executor.layers.moe import SparseMoE
from cpullm.model_executor.loader import finish_loading


def _reference(moe: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token: the softmax over the router's logits, the top k, each chosen expert
    run on the token alone."""
    logits = x @ moe.gate.weight.T
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = logits[t].softmax(-1)
        weights, experts = probs.topk(moe.top_k)
        if moe.normalize:
            weights = weights / weights.sum()
        for w, e in zip(weights.tolist(), experts.tolist(), strict=True):
            out[t] += w * moe.experts[e](x[t:t + 1])[0]
        if moe.shared_expert is not None:
            gate = torch.sigmoid(x[t] @ moe.shared_expert_gate.weight[0])
            out[t] += gate * moe.shared_expert(x[t:t + 1])[0]
    return out


@pytest.mark.parametrize("tokens", [1, 3, 40])
@pytest.mark.parametrize("normalize, shared", [(True, 0), (False, 24)])
def test_grouped_experts_equal_a_per_token_loop(tokens, normalize, shared):
    torch.manual_seed(tokens)
    moe = SparseMoE(32, 16, num_experts=8, top_k=2, normalize=normalize, dtype=torch.float32,
                    ops=None, quant_config=None, shared_size=shared)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
        finish_loading(moe, None)  # the dense layers' own ATen path (no kernels)
        x = torch.randn(tokens, 32)
        experts, _ = moe.route(x)
        if tokens <= 3:
            assert len(set(experts.flatten().tolist())) < 8  # some experts get no token
        assert torch.allclose(moe(x), _reference(moe, x), atol=1e-5)


def test_weight_memory_counts_every_expert(tiny_model):
    """The KV cache's default size and the memory check take the weights as they are: all
    experts, not the Llama layout's dense count."""
    from transformers import AutoModelForCausalLM

    from cpullm.engine_args import EngineArgs

    folder = str(tiny_model("qwen3_moe"))
    config = EngineArgs(model=folder, dtype="float32", max_model_len=256,
                        kv_cache_memory_bytes=1 << 24).create_engine_config()
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert config.model.weight_bytes == 4 * sum(p.numel() for p in reference.parameters())


@pytest.mark.parametrize("hidden, expert_size, num_experts, tokens",
                         [(64, 32, 8, 1), (64, 32, 8, 5), (64, 32, 8, 64), (2048, 2048, 3, 40)])
def test_one_kernel_call_per_projection_is_bit_identical(hidden, expert_size, num_experts,
                                                         tokens):
    """bfloat16 experts on the own GEMM run grouped (one call for all chosen experts'
    gate-ups, one for their downs): the same bits as the per-expert calls. With a hidden
    size of 2048 (rows 4 KiB apart) and an expert of 16 rows or more, the gathered tokens
    and the gate-ups' products lie in rows 64 bytes longer: the same bits too."""
    from cpullm.model_executor.layers.ops import load_ops

    ops = load_ops()
    kernels_or_skip(ops is not None and ops.gemm_bf16_grouped is not None, {"avx512_bf16"},
                    "the grouped bfloat16 GEMM")
    torch.manual_seed(tokens)
    moe = SparseMoE(hidden, expert_size, num_experts=num_experts, top_k=2, normalize=True,
                    dtype=torch.bfloat16, ops=ops, quant_config=None)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 2.4 / hidden ** 0.5)
        finish_loading(moe, ops)
        x = torch.randn(tokens, hidden).to(torch.bfloat16)
        if hidden == 2048:
            assert max(torch.bincount(moe.route(x)[0].flatten()).tolist()) >= 16
        grouped = moe(x)
        assert len(moe.grouped[0]) == num_experts  # set at load
        moe.grouped = ([], [], 0)  # expert by expert
        assert torch.equal(grouped, moe(x))


def test_rows_4k_apart_are_made_64_bytes_longer_from_16_rows():
    """A mixture's gathered rows lie 64 bytes further apart where they would be a multiple
    of 4 KiB apart and some expert has 16 or more of them; else they are contiguous."""
    from cpullm.model_executor.layers.packed_gemm import empty_rows

    like = torch.empty(0, dtype=torch.bfloat16)
    assert empty_rows(40, 2048, like, 16).stride() == (2080, 1)
    assert empty_rows(40, 2048, like, 15).is_contiguous()
    assert empty_rows(40, 2080, like, 16).is_contiguous()
