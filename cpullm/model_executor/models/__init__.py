"""Architecture name (config.json ``architectures``) -> model class, and what each family
brings. Adding a family is a model file and a line here."""

from __future__ import annotations

from torch import nn

from cpullm.model_executor.models.bert import (
    BertForSequenceClassification,
    BertModel,
    RobertaForSequenceClassification,
    RobertaModel,
)
from cpullm.model_executor.models.gemma import (
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    GemmaForCausalLM,
)
from cpullm.model_executor.models.glm import Glm4ForCausalLM, GlmForCausalLM
from cpullm.model_executor.models.gpt_oss import GptOssForCausalLM
from cpullm.model_executor.models.llama import (
    GraniteForCausalLM,
    LlamaForCausalLM,
    MistralForCausalLM,
    Phi3ForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
)
from cpullm.model_executor.models.llava import LlavaForConditionalGeneration
from cpullm.model_executor.models.qwen_moe import (
    MixtralForCausalLM,
    Qwen2MoeForCausalLM,
    Qwen3MoeForCausalLM,
)

# architecture -> (model class, what it needs beyond the Llama layout)
MODEL_REGISTRY: dict[str, tuple[type[nn.Module], str]] = {
    "LlamaForCausalLM": (LlamaForCausalLM, "Llama 2/3.x, SmolLM2; rope scaling (llama3, "
                         "yarn, linear)"),
    "MistralForCausalLM": (MistralForCausalLM, "Mistral; a sliding window"),
    "Qwen2ForCausalLM": (Qwen2ForCausalLM, "Qwen2, Qwen2.5; biased q/k/v"),
    "Qwen3ForCausalLM": (Qwen3ForCausalLM, "Qwen3 dense; q/k norms"),
    "GraniteForCausalLM": (GraniteForCausalLM, "Granite 3.x; embedding, attention, residual "
                           "and logits multipliers"),
    "Phi3ForCausalLM": (Phi3ForCausalLM, "Phi-3, Phi-3.5, Phi-4; fused q/k/v and gate-up, "
                        "LongRoPE, partial rotary"),
    "GemmaForCausalLM": (GemmaForCausalLM, "Gemma; (1 + w) norms, GeGLU, scaled embeddings"),
    "Gemma2ForCausalLM": (Gemma2ForCausalLM, "Gemma 2; and attention and logit soft-caps, "
                          "sliding and full layers, sandwich norms"),
    "Gemma3ForCausalLM": (Gemma3ForCausalLM, "Gemma 3 text; and q/k norms, rope per layer "
                          "kind"),
    "MixtralForCausalLM": (MixtralForCausalLM, "Mixtral; routed experts (w1/w3/w2)"),
    "Qwen2MoeForCausalLM": (Qwen2MoeForCausalLM, "Qwen1.5/2-MoE; routed experts and a "
                            "gated shared expert"),
    "Qwen3MoeForCausalLM": (Qwen3MoeForCausalLM, "Qwen3-MoE (30B-A3B, ...); routed experts, "
                            "q/k norms"),
    "GptOssForCausalLM": (GptOssForCausalLM, "gpt-oss-20b, gpt-oss-120b; attention sinks, "
                          "sliding and full layers, YaRN, biased router and experts, clamped "
                          "SwiGLU, MXFP4 experts (kept as 8-bit groups)"),
    "GlmForCausalLM": (GlmForCausalLM, "GLM-4; interleaved partial rotary, fused gate-up"),
    "Glm4ForCausalLM": (Glm4ForCausalLM, "GLM-4-0414; and post-block norms"),
    # vision-language models: images in the prompt (cpullm/multimodal.py)
    "LlavaForConditionalGeneration": (LlavaForConditionalGeneration, "LLaVA 1.5 layout: a "
                                      "CLIP or SigLIP tower, a projector, a Llama-family "
                                      "language model"),
    # encoders, for pooling (--task embed / score)
    "BertModel": (BertModel, "BERT encoders (all-MiniLM, BGE, E5, ...): embeddings"),
    "RobertaModel": (RobertaModel, "RoBERTa encoders: embeddings; positions from pad + 1"),
    "XLMRobertaModel": (RobertaModel, "XLM-RoBERTa encoders (multilingual E5, BGE-M3): "
                        "embeddings"),
    "BertForSequenceClassification": (BertForSequenceClassification, "BERT cross-encoders "
                                      "(ms-marco MiniLM, ...): scores and classes"),
    "RobertaForSequenceClassification": (RobertaForSequenceClassification, "RoBERTa "
                                         "cross-encoders"),
    "XLMRobertaForSequenceClassification": (RobertaForSequenceClassification, "XLM-RoBERTa "
                                            "cross-encoders (BGE rerankers)"),
}


def get_model_class(architecture: str) -> type[nn.Module]:
    try:
        return MODEL_REGISTRY[architecture][0]
    except KeyError:
        raise ValueError(f"architecture {architecture!r} is not supported; supported: "
                         f"{', '.join(sorted(MODEL_REGISTRY))}") from None


def describe_architectures() -> list[str]:
    """One line per supported architecture: its name and what it covers."""
    width = max(map(len, MODEL_REGISTRY))
    return [f"{name:<{width}}  {text}" for name, (_, text) in MODEL_REGISTRY.items()]
