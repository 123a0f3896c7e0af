"""The vision towers of the vision-language models against transformers' on the same
random weights: CLIP's hidden states at every layer and SigLIP's last (post-normed) ones,
in float32 and, on the packed bfloat16 GEMMs, in bfloat16."""

from __future__ import annotations

import pytest
import torch
from conftest import kernels_or_skip

from cpullm.model_executor.layers.ops import load_ops
from cpullm.model_executor.loader import finish_loading
from cpullm.model_executor.models.vision import VisionTransformer

TINY_VISION = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                   num_attention_heads=4, image_size=56, patch_size=14)


def reference(kind: str) -> torch.nn.Module:
    from transformers import (
        CLIPVisionConfig,
        CLIPVisionModel,
        SiglipVisionConfig,
        SiglipVisionModel,
    )

    torch.manual_seed(0)
    if kind == "clip":
        model = CLIPVisionModel(CLIPVisionConfig(**TINY_VISION))
    else:
        model = SiglipVisionModel(SiglipVisionConfig(**TINY_VISION))
    with torch.no_grad():  # wider than the init, so that every part matters
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0, 0.1)
    return model.eval()


def tower(model: torch.nn.Module, dtype: torch.dtype, ops) -> VisionTransformer:
    ours = VisionTransformer(model.config, dtype)
    prefix = "vision_model."
    ours.load_weights((name.removeprefix(prefix), tensor.to(dtype))
                      for name, tensor in model.state_dict().items())
    finish_loading(ours, ops)
    return ours.eval()


@pytest.mark.parametrize("kind", ["clip", "siglip"])
def test_vision_towers_match_transformers(kind):
    model = reference(kind)
    pixels = torch.randn(2, 3, 56, 56)
    with torch.no_grad():
        expected = model(pixels, output_hidden_states=True)
        ours = tower(model, torch.float32, None)
        for layer in range(-4, 4):  # every hidden state, counted from either end
            torch.testing.assert_close(ours(pixels, layer), expected.hidden_states[layer],
                                       atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(ours(pixels), expected.last_hidden_state,
                                   atol=2e-5, rtol=2e-5)
        # bfloat16 on the packed GEMMs: within bfloat16's rounding of float32's
        ops = load_ops()
        kernels_or_skip(ops is not None, {"avx2"}, "the compiled kernels")
        half = tower(model, torch.bfloat16, ops)
        assert half.encoder.layers[0].mlp.fc1.gemm is not None  # (the packed weights)
        got = half(pixels.bfloat16()).float()
        cosine = torch.nn.functional.cosine_similarity(got.flatten(1),
                                                       expected.last_hidden_state.flatten(1))
        assert cosine.min() > 0.999, cosine


def test_a_wrong_image_size_is_refused():
    model = reference("clip")
    ours = tower(model, torch.float32, None)
    with pytest.raises(ValueError, match="positions in an image of 70x70"):
        ours(torch.randn(1, 3, 70, 70))
    with pytest.raises(ValueError, match="patches of 14 pixels and 3 channels"):
        ours(torch.randn(1, 3, 50, 56))


@pytest.mark.parametrize("layers, strategy", [(-2, "default"), ([-3, -1], "full")])
def test_llava_image_features_match_transformers(layers, strategy):
    """A LLaVA checkpoint loads (vision tower, projector, language model) and its image
    features equal transformers' get_image_features."""
    from transformers import (
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
    )

    from cpullm.model_executor.models.llava import LlavaForConditionalGeneration as Ours

    config = LlavaConfig(vision_config=CLIPVisionConfig(**TINY_VISION).to_dict(),
                         text_config=LlamaConfig(hidden_size=48, intermediate_size=96,
                                                 num_hidden_layers=2, num_attention_heads=4,
                                                 num_key_value_heads=2,
                                                 vocab_size=300).to_dict(),
                         image_token_index=299, vision_feature_layer=layers,
                         vision_feature_select_strategy=strategy)
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0, 0.1)
    ours = Ours(config, 256, torch.float32)
    ours.load_weights(model.state_dict().items())
    finish_loading(ours, None)
    pixels = torch.randn(2, 3, 56, 56)
    with torch.no_grad():
        expected = torch.stack(model.model.get_image_features(pixels).pooler_output)
        got = ours.encode_images(pixels)
    assert got.shape == (2, 16 + (strategy == "full"), 48)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(ours.language_model.lm_head.weight, model.lm_head.weight)
