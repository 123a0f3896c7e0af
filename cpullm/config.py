"""Frozen configuration of one engine: model, KV cache, scheduler, parallelism.

EngineArgs (user flags) builds these; everything downstream reads them and never
changes them. Derived values are properties of the config's own fields; what depends on
the model class, the kernels or the checkpoint's files is resolved once into fields
(``model_executor/loader/sizes.py``), so that no property does I/O.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from cpullm.lora.request import LoRAConfig
from cpullm.model_executor.layers.pooler import PoolerConfig
from cpullm.platform.binding import BindingPlan
from cpullm.platform.topology import CpuTopology
from cpullm.sampling_params import DEFAULT_MAX_LOGPROBS
from cpullm.transformers_utils import ModelSource
from cpullm.utils import cdiv, json_object

# --kv-cache-dtype: vLLM's names (fp8 is fp8_e4m3) and int8 (llama.cpp's q8_0 rows)
KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "int8")
_KV_QUANTIZED = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
                 "fp8_e5m2": torch.float8_e5m2, "int8": torch.int8}
KV_INT8_SCALE_BYTES = 2  # an int8 row's float16 scale (one per token and KV head)


def text_architecture(hf_config: Any) -> str:
    """A config's architecture: its ``architectures``, or, for the configs that carry a
    model_type only (GGUF files', a vision-language model's text_config), the usual one."""
    archs = getattr(hf_config, "architectures", None) or []
    if archs:
        return archs[0]
    model_type = hf_config.model_type
    return {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
            "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
            "qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
            "gemma3_text": "Gemma3ForCausalLM"}.get(model_type, model_type)


@dataclass(frozen=True)
class ModelConfig:
    source: ModelSource
    hf_config: Any  # transformers.PretrainedConfig
    dtype: torch.dtype
    max_model_len: int
    seed: int = 0
    served_model_name: str = "default"
    tokenizer: str | None = None
    chat_template: str | None = None
    enforce_eager: bool = False
    quantization: str | None = None  # the checkpoint's format (vLLM's names); None: dense
    # "generate", or a pooling model's: "embed" (an encoder's vectors) or "classify" (a
    # cross-encoder's class or score logits); the pooling of its hidden states
    task: str = "generate"
    pooler_config: PoolerConfig = field(default_factory=PoolerConfig)
    lm_head_quantization: str | None = None  # "int8": the LM head quantized at load
    max_logprobs: int = DEFAULT_MAX_LOGPROBS  # per request, for logprobs and prompt_logprobs
    # Resolved once from the model class, the kernels and the checkpoint's files
    # (EngineArgs.create_engine_config, model_executor/loader/sizes.py), so that the config
    # stays plain data:
    # an encoder (BERT, ...): inputs computed whole, with no KV cache (a decoder that embeds
    # runs as the generative models do, its prompt in chunks over a KV cache)
    is_encoder: bool = False
    # each decoder layer's sliding window (0: the whole context), as its attention takes it
    layer_windows: tuple[int, ...] = ()
    # LongRoPE: the sequence length past which a sequence runs (and is recomputed) on the
    # long factors; None for other rotaries or where max_model_len stays within it
    longrope_edge: int | None = None
    # whether quantized weights stay quantized (the quantized kernels run, bfloat16 compute)
    keeps_quantized: bool = False
    weight_bytes: int = 0  # memory the weights take once loaded
    # how the KV cache stores keys and values: "auto" (the compute dtype), or a quantized
    # format of KV_CACHE_DTYPES (EngineArgs checks the name; "fp8" arrives as "fp8_e4m3")
    kv_cache_dtype: str = "auto"
    # fp8: each layer's K and V scales from its first prompt's keys and values (vLLM's
    # --calculate-kv-scales), else 1.0
    calculate_kv_scales: bool = False
    lora: LoRAConfig | None = None  # --enable-lora's limits; None: no adapters
    # a vision-language model's whole config (hf_config is then its text_config)
    mm_config: Any = None

    @property
    def is_pooling(self) -> bool:
        """A pooling model: inputs pooled (embedded or scored), nothing sampled."""
        return self.task != "generate"

    @property
    def architecture(self) -> str:
        return text_architecture(self.mm_config if self.mm_config is not None
                                 else self.hf_config)

    @property
    def num_layers(self) -> int:
        return self.hf_config.num_hidden_layers

    @property
    def num_heads(self) -> int:
        return self.hf_config.num_attention_heads

    @property
    def num_kv_heads(self) -> int:
        return getattr(self.hf_config, "num_key_value_heads", None) or self.num_heads

    @property
    def head_dim(self) -> int:
        return (getattr(self.hf_config, "head_dim", None)
                or self.hf_config.hidden_size // self.num_heads)

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size

    @property
    def sliding_window(self) -> int | None:
        if getattr(self.hf_config, "use_sliding_window", True) is False:
            return None
        return getattr(self.hf_config, "sliding_window", None)

    def kv_heads_per_rank(self, tensor_parallel_size: int = 1) -> int:
        """The KV heads each tensor-parallel rank holds: its share, or one (replicated)
        where there are fewer KV heads than ranks."""
        return max(1, self.num_kv_heads // tensor_parallel_size)

    def check_parallel(self, parallel: ParallelConfig) -> None:
        """Refuse, by what does not divide, a model that cannot split over the ranks."""
        tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
        c = self.hf_config
        if tp > 1:
            sizes = {"attention heads": self.num_heads,
                     "intermediate size": getattr(c, "intermediate_size", tp)}
            for name in ("moe_intermediate_size", "shared_expert_intermediate_size"):
                if getattr(c, name, None):
                    sizes[name.replace("_", " ")] = getattr(c, name)
            for what, size in sizes.items():
                if size % tp:
                    raise ValueError(f"tensor_parallel_size={tp}: the model's {size} {what} do "
                                     f"not split over {tp} ranks")
            kv = self.num_kv_heads
            if kv % tp and tp % kv:
                raise ValueError(f"tensor_parallel_size={tp}: the model's {kv} KV heads neither "
                                 f"split over {tp} ranks nor divide them")
        if pp > self.num_layers:
            raise ValueError(f"pipeline_parallel_size={pp}: the model has only "
                             f"{self.num_layers} layers")

    @property
    def kv_storage_dtype(self) -> torch.dtype:
        """The element type of the KV cache tensors."""
        return _KV_QUANTIZED.get(self.kv_cache_dtype, self.dtype)

    @property
    def kv_cache_quantized(self) -> bool:
        return self.kv_cache_dtype in _KV_QUANTIZED

    @property
    def kv_cache_dtype_name(self) -> str:
        """What the cache holds, by name: the compute dtype's or the quantized format's."""
        return self.kv_cache_dtype if self.kv_cache_quantized else \
            str(self.dtype).removeprefix("torch.")

    def kv_bytes_per_token(self, parallel: ParallelConfig | None = None,
                           layers: int | None = None) -> int:
        """K and V of one token over all layers (or ``layers`` of them), in bytes; given
        ``parallel``, on the rank that holds the most (the stage with the most layers)."""
        element = torch.tensor([], dtype=self.kv_storage_dtype).element_size()
        row = self.head_dim * element + (KV_INT8_SCALE_BYTES if self.kv_cache_dtype == "int8"
                                         else 0)
        heads = self.num_kv_heads
        if layers is None:
            layers = self.num_layers if parallel is None else \
                -(-self.num_layers // parallel.pipeline_parallel_size)
        if parallel is not None:
            heads = self.kv_heads_per_rank(parallel.tensor_parallel_size)
        return 2 * layers * heads * row


@dataclass(frozen=True)
class KVCacheGroups:
    """How the decoder layers share the KV cache's pages, so that a sliding-window layer
    can give back the blocks that have left its window while a full-attention layer keeps
    them (as vLLM's hybrid KV cache manager does).

    The layers are split into groups of ``group_size`` layers of one window each, the
    largest size that splits every window's layers evenly (the gcd of their counts). A
    page of the cache is one block of ``group_size`` layers; the pages come from one pool,
    and each group holds its own block table per request. Layer slot s of every group lives
    in cache tensor s, so a model whose layers all attend to the whole context is one group
    of all layers: one block table and one tensor per layer, as without groups.

        Gemma 3 1B: 22 sliding layers, 4 full -> size 2: 11 sliding groups, 2 full groups
        block tables per request: full groups hold every block, sliding groups the NULL
        page (one extra, never written) for the blocks before their window
    """

    windows: tuple[int, ...]  # per group: its layers' sliding window, 0 for none
    layer_group: tuple[int, ...]  # per layer: its group
    layer_slot: tuple[int, ...]  # per layer: its place in the group (its cache tensor)
    group_size: int

    @classmethod
    def plan(cls, layer_windows: list[int]) -> KVCacheGroups:
        by_window: dict[int, list[int]] = {}
        for layer, window in enumerate(layer_windows):
            by_window.setdefault(window, []).append(layer)
        size = math.gcd(*map(len, by_window.values()))
        windows, layer_group, layer_slot = [], [0] * len(layer_windows), [0] * len(layer_windows)
        for window, layers in by_window.items():
            for start in range(0, len(layers), size):
                for slot, layer in enumerate(layers[start:start + size]):
                    layer_group[layer], layer_slot[layer] = len(windows), slot
                windows.append(window)
        return cls(tuple(windows), tuple(layer_group), tuple(layer_slot), size)

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def has_windows(self) -> bool:
        """Whether some group drops blocks (the pool then has a NULL page past its end)."""
        return any(self.windows)

    def slots_per_rank(self, pipeline_parallel_size: int) -> int:
        """Cache tensors on the pipeline stage that holds the most."""
        from cpullm.distributed import RankLayout

        layout = RankLayout(pp_size=pipeline_parallel_size)
        return max(len({self.layer_slot[layer]
                        for layer in layout.stage_layers(len(self.layer_slot), stage)})
                   for stage in range(pipeline_parallel_size))

    def blocks_per_request(self, num_tokens: int, block_size: int, chunk: int = 1) -> int:
        """Pages a request of ``num_tokens`` tokens holds at most, over all groups, in a
        step that computes ``chunk`` of them (1: while it decodes): a sliding group the
        blocks that its window and the chunk span."""
        blocks = cdiv(num_tokens, block_size)
        return sum(blocks if not window else
                   min(blocks, cdiv(window + chunk - 2, block_size) + 1)
                   for window in self.windows)


@dataclass(frozen=True)
class CacheConfig:
    block_size: int
    num_blocks: int  # pages in the pool (a NULL page past them where groups drop blocks)
    enable_prefix_caching: bool = True
    groups: KVCacheGroups | None = None  # None: one group of every layer

    def __post_init__(self) -> None:
        self.check_block_size(self.block_size)

    @staticmethod
    def check_block_size(block_size: int) -> None:
        """Refuse a block size that is not a positive multiple of 32."""
        if block_size <= 0 or block_size % 32:
            raise ValueError(f"block_size must be a positive multiple of 32, got {block_size}")


SPECULATIVE_METHODS = ("ngram", "draft_model")
# vLLM's other methods, refused by name until they are built
_SPECULATIVE_LATER = ("eagle", "eagle3", "mtp", "medusa", "mlp_speculator", "suffix")
_SPECULATIVE_INT_KEYS = ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
                         "disable_by_batch_size")
_SPECULATIVE_KEYS = ("method", *_SPECULATIVE_INT_KEYS, "model", "adaptive")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's ``--speculative-config``): each decode step also
    verifies up to ``num_speculative_tokens`` proposed tokens. ``ngram`` proposes the
    tokens that followed the latest earlier occurrence of the request's last n tokens
    (n from ``prompt_lookup_max`` down to ``prompt_lookup_min``); ``draft_model`` the
    greedy continuation of a smaller model of the same vocabulary (``model``)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 5
    prompt_lookup_max: int = 5
    # no proposals in a step that runs this many requests or more (None: any number)
    disable_by_batch_size: int | None = None
    model: str | None = None  # draft_model: the draft's folder or GGUF file
    # cpullm's: propose only as much as pays, by step times measured at startup and the
    # acceptance rate (spec_decode/policy.py); False: k tokens every step, as vLLM
    adaptive: bool = True

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative config: method must be one of "
                             f"{', '.join(SPECULATIVE_METHODS)}, got {self.method!r}")
        if self.num_speculative_tokens < 1:
            raise ValueError("speculative config: num_speculative_tokens must be >= 1, got "
                             f"{self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("speculative config: need 1 <= prompt_lookup_min <= "
                             f"prompt_lookup_max, got {self.prompt_lookup_min} and "
                             f"{self.prompt_lookup_max}")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 2:
            raise ValueError("speculative config: disable_by_batch_size must be >= 2, got "
                             f"{self.disable_by_batch_size}")
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError("speculative config: model (the draft) is required with method "
                             "draft_model, and only there")

    @classmethod
    def parse(cls, value: str | dict[str, Any] | None) -> SpeculativeConfig | None:
        """From a user's JSON text or dict with vLLM's keys; None stays None. As vLLM, a
        missing n-gram bound takes the other's value, and both missing are 5."""
        if value is None:
            return None
        value = json_object(value, "speculative config")
        method = value.get("method") or ("draft_model" if value.get("model") else None)
        if method in _SPECULATIVE_LATER:
            raise ValueError(f"speculative config: method {method!r} is not supported yet; "
                             "supported: " + ", ".join(SPECULATIVE_METHODS))
        unknown = sorted(set(value) - set(_SPECULATIVE_KEYS))
        if unknown:
            raise ValueError(f"speculative config: unknown keys {unknown} ("
                             + ", ".join(_SPECULATIVE_KEYS) + ")")
        fields = dict(value)
        if fields.get("model") is not None and not isinstance(fields["model"], str):
            raise ValueError("speculative config: model must be a path")
        if not isinstance(fields.get("adaptive", True), bool):
            raise ValueError("speculative config: adaptive must be true or false")
        for key in _SPECULATIVE_INT_KEYS:
            if fields.get(key) is not None and (not isinstance(fields[key], int)
                                                or isinstance(fields[key], bool)):
                raise ValueError(f"speculative config: {key} must be an integer")
        if "num_speculative_tokens" not in fields:
            raise ValueError("speculative config: num_speculative_tokens is required")
        low, high = fields.get("prompt_lookup_min"), fields.get("prompt_lookup_max")
        fields["prompt_lookup_min"] = low or high or 5
        fields["prompt_lookup_max"] = high or low or 5
        fields["method"] = method
        return cls(**fields)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    whole_inputs: bool = False  # an encoder's: each input in one step, no KV blocks
    # LongRoPE: a request longer than this runs on the long factors, recomputed (ModelConfig)
    longrope_edge: int | None = None
    speculative: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    # Which CPUs each rank computes on (every replica's ranks, replica after replica, until
    # ``EngineConfig.replica`` keeps one replica's), and the machine the plan was made for.
    binding: BindingPlan = field(default_factory=lambda: BindingPlan("nobind", ()))
    topology: CpuTopology | None = None
    data_parallel_rank: int = 0  # which replica this config is for
    # Where the ranks of a tensor/pipeline-parallel replica meet (the driver's TCPStore);
    # port 0: a free one.
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    # Hosts the ranks span, and this one's place (0: the one that serves). Rank r runs on
    # host r // ranks_per_node.
    nnodes: int = 1
    node_rank: int = 0

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size",
                     "nnodes"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, {self.nnodes}), got {self.node_rank}")
        if self.nnodes > 1:
            if self.world_size % self.nnodes:
                raise ValueError(f"{self.world_size} ranks (tensor x pipeline parallel) do "
                                 f"not spread evenly over {self.nnodes} nodes")
            if self.data_parallel_size > 1:
                raise ValueError("data parallelism across nodes is not supported; run a "
                                 "server per node")

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    @property
    def local_ranks(self) -> range:
        """The ranks of a replica that run on this host."""
        first = self.node_rank * self.ranks_per_node
        return range(first, first + self.ranks_per_node)

    @property
    def world_size(self) -> int:
        """Ranks of one replica."""
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    # speculative decoding with a draft model: the draft's engine, in the same process
    draft: EngineConfig | None = None

    def replica(self, rank: int) -> EngineConfig:
        """The config of data-parallel replica ``rank``: the CPUs of its own ranks only."""
        parallel = self.parallel
        if not 0 <= rank < parallel.data_parallel_size:
            raise ValueError(f"replica {rank} of {parallel.data_parallel_size}")
        size = parallel.world_size
        binding = parallel.binding
        if binding.rank_cpus:
            binding = dataclasses.replace(
                binding, rank_cpus=binding.rank_cpus[rank * size:(rank + 1) * size])
        parallel = dataclasses.replace(parallel, binding=binding, data_parallel_rank=rank)
        draft = None if self.draft is None else dataclasses.replace(self.draft,
                                                                    parallel=parallel)
        return dataclasses.replace(self, parallel=parallel, draft=draft)
