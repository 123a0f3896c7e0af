"""Sparse mixture-of-experts blocks (Qwen2/3-MoE, Mixtral, gpt-oss).

A sparse layer routes each token to its top-k experts: softmax over the router's logits
in float32, the k largest, renormalised to sum to one where the config says so
(``norm_topk_prob``). The experts run grouped: for each expert that some token of the step
chose (and only those), one gate-up GEMM and one down GEMM over its tokens, the result
weighted and added into those tokens' rows — no loop over tokens, and a decode step that
touches few experts reads only their weights. Each expert is a dense gated MLP whose
weights are packed once at load like every other linear layer (and kept quantized, for a
quantized checkpoint). Experts are added in increasing order, as transformers adds them, so
float32 sums are the same.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from cpullm import distributed
from cpullm.model_executor.layers.linear import LinearBase, ReplicatedLinear
from cpullm.model_executor.layers.mlp import GatedMLP
from cpullm.model_executor.layers.ops import KernelTable
from cpullm.model_executor.layers.packed_gemm import PackedGemm, empty_rows
from cpullm.model_executor.layers.quantization.base import QuantizationConfig
from cpullm.model_executor.layers.quantization.kept import VNNI_MAX_ROWS, QuantizedWeight


class SparseMoE(nn.Module):
    """Top-k routed experts, and optionally a shared expert every token runs."""

    def __init__(self, hidden_size: int, expert_size: int, num_experts: int, top_k: int,
                 normalize: bool, dtype: torch.dtype, ops: KernelTable | None,
                 quant_config: QuantizationConfig | None, shared_size: int = 0,
                 expert: Callable[[], nn.Module] | None = None, gate_bias: bool = False
                 ) -> None:
        """``expert``: makes one expert (default: a Llama MLP of ``expert_size``), whose
        tensor-parallel partial sums it leaves unreduced; ``gate_bias``: the router's."""
        super().__init__()
        self.top_k, self.normalize, self.num_experts = top_k, normalize, num_experts
        self.ops = ops
        # (gate-up panels, down panels, rows) of the grouped expert kernel, set at load
        self.grouped: tuple[list[torch.Tensor], list[torch.Tensor], int] = ([], [], 0)
        self.kept_grouped: KeptExperts | None = None  # or, for kept-quantized experts
        self.gate = ReplicatedLinear(hidden_size, num_experts, bias=gate_bias, dtype=dtype,
                                     quant_config=quant_config)
        # Under tensor parallelism every rank holds its part of every expert; the partial
        # sums of all experts (and the shared one) are summed over the ranks once.
        expert = expert or (lambda: GatedMLP(hidden_size, expert_size, False, dtype, ops,
                                             quant_config, reduce=False))
        self.experts = nn.ModuleList(expert() for _ in range(num_experts))
        self.shared_expert: GatedMLP | None = None
        if shared_size:
            self.shared_expert = GatedMLP(hidden_size, shared_size, False, dtype, ops,
                                          quant_config, reduce=False)
            self.shared_expert_gate = ReplicatedLinear(hidden_size, 1, dtype=dtype,
                                                       quant_config=quant_config)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[tokens, k] expert ids and their weights (in x's dtype)."""
        logits = self.gate(x)  # [tokens, num_experts]
        probs = F.softmax(logits, dim=-1, dtype=torch.float)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights /= weights.sum(dim=-1, keepdim=True)
        return experts, weights.to(logits.dtype)

    def process_weights_after_loading(self, ops: KernelTable | None) -> None:
        """After the experts packed theirs (the loader runs children first): the grouped
        path's panels, where it applies."""
        self.grouped = self._grouped_panels() or ([], [], 0)
        self.kept_grouped = None if self.grouped[0] else KeptExperts.of(self.experts, ops)

    def _grouped_panels(self) -> tuple[list[torch.Tensor], list[torch.Tensor], int] | None:
        """Where every expert is a dense bfloat16 Llama MLP on the own GEMM (no bias), the
        experts of a step run grouped: one kernel call for the gate-ups of all chosen
        experts (SiLU-mul fused), one for the downs, bit for bit what the per-expert calls
        give. Returns (the gate-up panels, the down panels, the rows up to which the own
        GEMM runs them grouped; above, AMX tiles or oneDNN, expert by expert), else None."""
        if self.ops is None or self.ops.gemm_bf16_grouped is None:
            return None
        gate_ups, downs = [], []
        for expert in self.experts:
            if not isinstance(expert, GatedMLP):
                return None
            gemms = expert.gate_up_proj.gemm, expert.down_proj.gemm
            if any(type(g) is not PackedGemm or g.kernel is None or g.panels is None
                   or g.panel_bias is not None for g in gemms) or not gemms[0].silu_mul:
                return None
            gate_ups.append(gemms[0].panels)
            downs.append(gemms[1].panels)
        return gate_ups, downs, min(g.grouped_rows for e in self.experts
                                    for g in (e.gate_up_proj.gemm, e.down_proj.gemm))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        experts, weights = self.route(x)  # [tokens, k]
        # The (token, choice) pairs sorted by expert: each expert's tokens are one run of
        # rows, gathered once; within a run in token order, as transformers takes them.
        order = torch.argsort(experts.flatten(), stable=True)
        tokens = order // self.top_k
        counts = torch.bincount(experts.flatten(), minlength=self.num_experts).tolist()
        longest = max(counts)
        rows = torch.index_select(x, 0, tokens, out=empty_rows(  # [tokens * k, hidden]
            len(tokens), x.shape[-1], x, longest))
        gate_ups, downs, own_rows = self.grouped
        if gate_ups and longest <= own_rows:
            chosen = [e for e, count in enumerate(counts) if count]
            offsets = [0, *itertools.accumulate(counts[e] for e in chosen)]
            assert self.ops is not None and self.ops.gemm_bf16_grouped is not None
            hidden = empty_rows(rows.shape[0], gate_ups[0].shape[0] * 16, rows, longest)
            self.ops.gemm_bf16_grouped(hidden, rows, [gate_ups[e] for e in chosen], offsets,
                                       True)
            out_rows = rows.new_empty(rows.shape)
            self.ops.gemm_bf16_grouped(out_rows, hidden, [downs[e] for e in chosen], offsets,
                                       False)
        elif self.kept_grouped is not None and longest <= VNNI_MAX_ROWS:
            out_rows = self.kept_grouped(rows, counts, self.experts[0].activate)
        else:
            out_rows = torch.empty_like(rows)
            start = 0
            for expert, count in enumerate(counts):
                if count:  # only the experts some token chose
                    out_rows[start:start + count] = self.experts[expert](
                        rows[start:start + count])
                    start += count
        out_rows *= weights.flatten()[order, None]
        # one add of every (token, choice) into its token's row, in expert order per token
        out = torch.zeros_like(x).index_add_(0, tokens, out_rows)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return distributed.tp_all_reduce(out)


@dataclass
class KeptExperts:
    """Experts whose gate-up and down projections are each one kept-quantized weight of one
    layout (AWQ, GPTQ, MXFP4, GGUF, ...): a step's chosen experts run in two kernel calls
    (``quant_gemm_grouped``: all gate-ups, then, after the activation on all their rows,
    all downs), bit for bit what the per-expert calls give."""

    gate_ups: list[QuantizedWeight]
    gate_up_biases: list[torch.Tensor] | None
    downs: list[QuantizedWeight]
    down_biases: list[torch.Tensor] | None
    ops: KernelTable

    @classmethod
    def of(cls, experts: nn.ModuleList, ops: KernelTable | None) -> KeptExperts | None:
        if ops is None:
            return None
        projections = []
        for name in ("gate_up_proj", "down_proj"):
            layers = [getattr(expert, name, None) for expert in experts]
            if not all(isinstance(layer, LinearBase) and len(getattr(layer, "segments", ())) == 1
                       and layer.segments[0].quantized is not None
                       and layer.segments[0].perm is None for layer in layers):
                return None  # (dense layers have no segments)
            weights = [layer.segments[0].quantized for layer in layers]
            first = weights[0]
            if first.grouped_kernel(ops) is None or any(
                    type(w) is not type(first) or w.fmt != first.fmt
                    or w.data.shape != first.data.shape or w.scales.dtype != first.scales.dtype
                    or not w.kernels_run(ops, layers[0].compute_dtype) for w in weights):
                return None
            biases = [layer.bias for layer in layers]
            if any((b is None) != (biases[0] is None) for b in biases):
                return None
            projections += [weights, None if biases[0] is None else biases]
        if not hasattr(experts[0], "activate"):
            return None
        return cls(*projections, ops)

    def __call__(self, rows: torch.Tensor, counts: list[int],
                 activate: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """The experts' outputs for ``rows``, sorted by expert (``counts`` rows each)."""
        chosen = [e for e, count in enumerate(counts) if count]
        offsets = [0, *itertools.accumulate(counts[e] for e in chosen)]

        def pick(items: list[Any] | None) -> list[Any] | None:
            return None if items is None else [items[e] for e in chosen]

        hidden = rows.new_empty(rows.shape[0], self.gate_ups[0].n)
        QuantizedWeight.matmul_grouped(hidden, rows, pick(self.gate_ups), pick(self.gate_up_biases),
                                       offsets, self.ops)
        hidden = activate(hidden).contiguous()
        out = rows.new_empty(rows.shape[0], self.downs[0].n)
        QuantizedWeight.matmul_grouped(out, hidden, pick(self.downs), pick(self.down_biases),
                                       offsets, self.ops)
        return out
