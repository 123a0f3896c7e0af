"""The Llama family: Llama (SmolLM2, Llama 3.x), Mistral, Qwen2, Qwen3, Granite and Phi-3.

They differ in three switches: bias on the QKV projection (Qwen2), an RMSNorm on each
query and key head (Qwen3), and bias on the output projection; and Granite's four
multipliers, read from its config (``embedding_multiplier`` on the embeddings,
``attention_multiplier`` as the attention scale, ``residual_multiplier`` on each block's
output before it joins the residual, ``logits_scaling`` dividing the logits), which other
configs lack. Parameter names mirror Hugging Face's, except that q/k/v and gate/up are
merged (see ``stacked_params``; Phi-3's checkpoints store them merged already).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from cpullm import distributed
from cpullm.model_executor.layers.attention import AttentionMetadata, PagedAttention
from cpullm.model_executor.layers.embedding import LMHead, VocabEmbedding
from cpullm.model_executor.layers.linear import QKVLinear, RowParallelLinear
from cpullm.model_executor.layers.mlp import GatedMLP
from cpullm.model_executor.layers.norm import RMSNorm
from cpullm.model_executor.layers.ops import KernelTable
from cpullm.model_executor.layers.quantization.base import QuantizationConfig
from cpullm.model_executor.layers.rotary import RotaryEmbedding
from cpullm.model_executor.layers.stage import (
    StagedDecoder,
    build_layers,
    first_stage_only,
    last_stage_only,
)
from cpullm.model_executor.loader.weights import load_named_weights

# a decoder layer's decode step: (positions, hidden, residual, kv_cache, meta) -> (hidden,
# residual), as LlamaDecoderLayer.forward
DecodeStep = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None", torch.Tensor,
                       AttentionMetadata], tuple[torch.Tensor, torch.Tensor]]


class LlamaAttention(nn.Module):
    def __init__(self, config: Any, rotary: RotaryEmbedding, qkv_bias: bool, o_bias: bool,
                 qk_norm: bool, dtype: torch.dtype, ops: KernelTable | None,
                 quant_config: QuantizationConfig | None, scale: float | None = None,
                 window: int | None = None, norm: type[RMSNorm] = RMSNorm,
                 softcap: float = 0.0, sinks: bool = False) -> None:
        """``scale``: of the attention scores (default: Granite's multiplier, else 1 / sqrt
        of the head size); ``window``: this layer's own sliding window (0: none; default:
        the model's); ``norm``: the q/k norm's class; ``softcap``: the scores' soft-cap;
        ``sinks``: a learned attention-sink logit per head (gpt-oss's ``sinks``)."""
        super().__init__()
        num_heads = config.num_attention_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        self.qkv_proj = QKVLinear(config.hidden_size, self.head_dim, num_heads,
                                  getattr(config, "num_key_value_heads", None) or num_heads,
                                  bias=qkv_bias, dtype=dtype, quant_config=quant_config)
        # this rank's heads (all of them without tensor parallelism)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.o_proj = RowParallelLinear(num_heads * self.head_dim, config.hidden_size,
                                        bias=o_bias, dtype=dtype, quant_config=quant_config)
        if qk_norm:
            self.q_norm = norm(self.head_dim, config.rms_norm_eps, dtype, ops)
            self.k_norm = norm(self.head_dim, config.rms_norm_eps, dtype, ops)
        self.qk_norm = qk_norm
        self.rotary = rotary
        # a reorder of each head's dims, applied to q and k before the rotary (GLM's
        # interleaved rotary where the checkpoint's rows cannot be reordered at load)
        self.qk_order: torch.Tensor | None = None
        if scale is None:
            scale = getattr(config, "attention_multiplier", None) or self.head_dim ** -0.5
        self.attn = PagedAttention(self.num_heads, self.head_dim, self.num_kv_heads,
                                   scale=scale, ops=ops, window=window, softcap=softcap)
        self.sinks: nn.Parameter | None = None
        if sinks:  # float32 whatever the dtype, as the softmax they join; this rank's heads
            self.sinks = nn.Parameter(torch.zeros(self.num_heads), requires_grad=False)
            first = distributed.tp_rank() * self.num_heads

            def load_sinks(param: nn.Parameter, loaded: torch.Tensor, shard_id: Any) -> None:
                if loaded.shape != (num_heads,):
                    raise ValueError(f"checkpoint {tuple(loaded.shape)}, model ({num_heads},)")
                param.data.copy_(loaded[first:first + self.num_heads])

            self.sinks.weight_loader = load_sinks  # type: ignore[attr-defined]

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)  # [num_tokens, num_heads, head_dim]
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # [num_tokens, num_kv_heads, head_dim]
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.qk_order is not None:
            q, k = q[..., self.qk_order], k[..., self.qk_order]
        q, k = self.rotary(positions, q, k)
        out = self.attn(q, k, v, kv_cache, meta, self.sinks)  # [num_tokens, num_heads, head_dim]
        return self.o_proj(out.view(-1, self.q_size))

    def decode_fn(self) -> tuple[Callable[..., torch.Tensor], int] | None:
        """forward as one function (positions, hidden, kv_cache, meta) of a decode-only step
        in bfloat16 (``LlamaDecoderLayer.decode_step``: the tensors as it takes them), and
        the most tokens it holds for: the projections' and the attention's kernels with
        forward's arguments (the q/k norms and the reorder of q and k as forward calls
        them). None where forward does more, or has no compiled kernels."""
        attn = self.attn
        if (type(self).forward is not LlamaAttention.forward
                or type(attn).forward is not PagedAttention.forward
                or type(self.rotary).forward is not RotaryEmbedding.forward
                or self.rotary.ops is None or attn.decode_attention is None or attn.ops is None):
            return None
        products = [self.qkv_proj.step_fn(torch.bfloat16), self.o_proj.step_fn(torch.bfloat16)]
        if any(product is None for product in products):
            return None
        (qkv, _), (o_proj, _) = products
        q_size, sizes = self.q_size, [self.q_size, self.kv_size, self.kv_size]
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        flat = (-1, kv_heads, head_dim)
        rotate, cos, sin = self.rotary.ops.rotary_embedding, self.rotary.cos, self.rotary.sin
        cache_kv, decode = attn.ops.cache_kv, attn.decode_attention
        scale, softcap, window, sinks = attn.scale, attn.softcap, attn.window, self.sinks
        qk_norm, order = self.qk_norm, self.qk_order

        def attend(positions: torch.Tensor, hidden: torch.Tensor, kv_cache: torch.Tensor,
                   meta: AttentionMetadata) -> torch.Tensor:
            q, k, v = qkv(hidden).split(sizes, dim=-1)
            q, k = q.view(-1, heads, head_dim), k.view(-1, kv_heads, head_dim)
            if qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            if order is not None:
                q, k = q[..., order], k[..., order]
            rotate(positions, q, k, cos, sin)
            key_cache, value_cache = kv_cache[0], kv_cache[1]
            group = attn.kv_group
            cache_kv(key_cache.view(flat), value_cache.view(flat), k,
                     v.view(-1, kv_heads, head_dim), meta.slot_mapping[group])
            out = torch.empty_like(q)
            decode(out, q, key_cache, value_cache, meta.decode_block_tables[group],
                   meta.decode_seq_lens, scale, meta.sliding_window if window is None else window,
                   softcap, sinks)
            return o_proj(out.view(-1, q_size))

        return attend, min(limit for _, limit in products)


def add_and_norm(norm: RMSNorm, hidden: torch.Tensor, residual: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's input norm: (norm(hidden + residual), hidden + residual); the first layer,
    with no residual yet, starts it from its input."""
    if residual is None:
        return norm(hidden), hidden
    return norm(hidden, residual)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: Any, rotary: RotaryEmbedding, flags: dict[str, bool],
                 dtype: torch.dtype, ops: KernelTable | None,
                 quant_config: QuantizationConfig | None, index: int = 0) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, rotary, dtype=dtype, ops=ops,
                                        quant_config=quant_config, **flags)
        self.mlp = self.make_mlp(config, index, dtype, ops, quant_config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, ops)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype,
                                                ops)
        self.residual_multiplier = float(getattr(config, "residual_multiplier", 1.0))

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = add_and_norm(self.input_layernorm, hidden, residual)
        hidden = self.scale_output(self.self_attn(positions, hidden, kv_cache, meta))
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.scale_output(self.mlp(hidden)), residual

    def decode_step(self) -> tuple[DecodeStep, int] | None:
        """This layer as one function of a decode-only step in bfloat16 (every token a
        sequence's next; hidden, residual and the KV caches contiguous, the slots int64),
        and the most tokens it holds for: forward's kernels called in forward's order with
        forward's arguments, without the module calls and checks between them (a single
        stream spends about as long in those as in its kernels; a residual multiplier as
        forward has it). None where forward does more: a family's own layer, experts,
        tensor parallelism, no compiled kernels."""
        mlp, norms = self.mlp, (self.input_layernorm, self.post_attention_layernorm)
        if (type(self).forward is not LlamaDecoderLayer.forward
                or type(mlp).forward is not GatedMLP.forward
                or any(type(norm).forward is not RMSNorm.forward or norm.kernel is None
                       or norm.weight.dtype != torch.bfloat16 for norm in norms)):
            return None
        made = [self.self_attn.decode_fn(), mlp.gate_up_proj.step_fn(torch.bfloat16),
                mlp.down_proj.step_fn(torch.bfloat16)]
        if any(m is None for m in made):
            return None
        (attend, _), (gate_up, _), (down, _) = made
        norm_in, norm_post = (norm.kernel for norm in norms)
        weight_in, weight_post = (norm.weight for norm in norms)
        eps_in, eps_post = (norm.eps for norm in norms)
        multiplier = self.residual_multiplier

        def step(positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                 kv_cache: torch.Tensor, meta: AttentionMetadata
                 ) -> tuple[torch.Tensor, torch.Tensor]:
            if residual is None:
                x, residual = torch.empty_like(hidden), hidden
                norm_in(x, hidden, None, weight_in, eps_in)
            else:
                x = hidden
                norm_in(x, x, residual, weight_in, eps_in)
            hidden = attend(positions, x, kv_cache, meta)
            if multiplier != 1.0:
                hidden = hidden * multiplier
            norm_post(hidden, hidden, residual, weight_post, eps_post)
            hidden = down(gate_up(hidden))
            return (hidden if multiplier == 1.0 else hidden * multiplier), residual

        return step, min(limit for _, limit in made)

    @staticmethod
    def make_mlp(config: Any, index: int, dtype: torch.dtype, ops: KernelTable | None,
                 quant_config: QuantizationConfig | None) -> nn.Module:
        """Layer ``index``'s feed-forward block (a mixture of experts overrides it)."""
        return GatedMLP(config.hidden_size, config.intermediate_size,
                        getattr(config, "mlp_bias", False), dtype, ops, quant_config)

    def scale_output(self, hidden: torch.Tensor) -> torch.Tensor:
        """A block's output as it joins the residual stream (Granite scales it)."""
        return hidden if self.residual_multiplier == 1.0 else hidden * self.residual_multiplier


class LlamaModel(StagedDecoder):
    def __init__(self, config: Any, max_position: int, flags: dict[str, bool],
                 dtype: torch.dtype, ops: KernelTable | None,
                 quant_config: QuantizationConfig | None,
                 layer_cls: type[LlamaDecoderLayer] = LlamaDecoderLayer) -> None:
        super().__init__()
        head_dim = (getattr(config, "head_dim", None)
                    or config.hidden_size // config.num_attention_heads)
        rotary = RotaryEmbedding(config, head_dim, max_position, ops)
        # Under pipeline parallelism, this stage's part (layers/stage.py): the table on the
        # first stage, and on the last where the LM head is tied to it.
        self.embed_tokens = first_stage_only(
            lambda: VocabEmbedding(config.vocab_size, config.hidden_size, dtype, quant_config),
            also_last=bool(getattr(config, "tie_word_embeddings", False)))
        self.layers = build_layers(config.num_hidden_layers, lambda i: layer_cls(
            config, rotary, flags, dtype, ops, quant_config, i))
        self.norm = last_stage_only(
            lambda: RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, ops))
        self.embedding_multiplier = float(getattr(config, "embedding_multiplier", 1.0))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        return hidden if self.embedding_multiplier == 1.0 else hidden * self.embedding_multiplier


def windows_by_layer_type(config: Any) -> list[int]:
    """Per layer: the sliding window for a ``sliding_attention`` layer of ``layer_types``
    (Gemma 2/3, gpt-oss), 0 for the others."""
    kinds = getattr(config, "layer_types", None) or ["full_attention"] * \
        config.num_hidden_layers
    window = getattr(config, "sliding_window", None) or 0
    return [window if kind == "sliding_attention" else 0 for kind in kinds]


class LlamaForCausalLM(nn.Module):
    decoder_layer = LlamaDecoderLayer
    # per layer sliding windows, for families whose layers differ (None: the model's
    # ``sliding_window`` in every layer); loader/sizes.py reads it into ModelConfig
    layer_windows: Callable[[Any], list[int]] | None = None
    # checkpoint name -> (merged parameter, shard id)
    stacked_params = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    @staticmethod
    def layer_flags(config: Any) -> dict[str, bool]:
        bias = bool(getattr(config, "attention_bias", False))
        return {"qkv_bias": bias, "o_bias": bias, "qk_norm": False}

    def __init__(self, config: Any, max_position: int, dtype: torch.dtype,
                 ops: KernelTable | None = None,
                 quant_config: QuantizationConfig | None = None) -> None:
        """``ops``: the compiled CPU kernels, or None for plain torch ops (enforce_eager);
        ``quant_config``: the checkpoint's quantization format, or None for dense weights."""
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, max_position, self.layer_flags(config), dtype, ops,
                                quant_config, self.decoder_layer)
        self.lm_head = last_stage_only(
            lambda: LMHead(config.vocab_size, config.hidden_size, dtype, quant_config))
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings and isinstance(self.lm_head, LMHead):
            self.lm_head.tie(self.model.embed_tokens)
        self.logits_scaling = float(getattr(config, "logits_scaling", 1.0))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata,
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return self.model(input_ids, positions, kv_caches, meta, intermediate)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head.compute_logits(hidden)
        return logits if self.logits_scaling == 1.0 else logits / self.logits_scaling

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        skip = {"lm_head.weight"} if self.tie_word_embeddings else set()
        load_named_weights(self, weights, self.stacked_params, skip)


class MistralForCausalLM(LlamaForCausalLM):
    pass


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def layer_flags(config: Any) -> dict[str, bool]:
        return {"qkv_bias": True, "o_bias": False, "qk_norm": False}


class Qwen3ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def layer_flags(config: Any) -> dict[str, bool]:
        bias = bool(getattr(config, "attention_bias", False))
        return {"qkv_bias": bias, "o_bias": bias, "qk_norm": True}


class GraniteForCausalLM(LlamaForCausalLM):
    """Llama with Granite's multipliers (see the module docstring)."""


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3, Phi-3.5 and Phi-4: Llama whose checkpoints store q/k/v and gate/up fused
    (``qkv_proj``, ``gate_up_proj``, gate first), loaded whole into the merged layers.
    Their LongRoPE and partial rotary are the rotary embedding's."""

    stacked_params: dict[str, tuple[str, str | int]] = {}
