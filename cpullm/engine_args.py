"""EngineArgs: every engine flag in one place, with vLLM's names and defaults."""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass

import torch

from cpullm import envs
from cpullm.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from cpullm.logger import init_logger
from cpullm.platform import resolve_dtype
from cpullm.transformers_utils import DEFAULT_MODEL_NAME, load_hf_config, resolve_model

logger = init_logger(__name__)

GiB = 1 << 30
_DEFAULT_KV_CACHE_SPACE = 4 * GiB  # vLLM CPU's default when VLLM_CPU_KVCACHE_SPACE is unset


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


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
    enable_prefix_caching: bool = True
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    served_model_name: str | None = None
    chat_template: str | None = None
    enforce_eager: bool = False

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        d = EngineArgs()
        parser.add_argument("--tokenizer", default=d.tokenizer,
                            help="tokenizer folder (default: the model's own)")
        parser.add_argument("--dtype", default=d.dtype,
                            choices=["auto", "float32", "bfloat16", "float16", "half", "float"])
        parser.add_argument("--seed", type=int, default=d.seed)
        parser.add_argument("--max-model-len", type=int, default=d.max_model_len,
                            help="context length (default: the model's)")
        parser.add_argument("--block-size", type=int, default=d.block_size,
                            help="tokens per KV cache block, a multiple of 32")
        parser.add_argument("--kv-cache-memory-bytes", type=int, default=d.kv_cache_memory_bytes,
                            help="KV cache size in bytes; wins over VLLM_CPU_KVCACHE_SPACE")
        parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                            default=d.enable_prefix_caching)
        parser.add_argument("--max-num-seqs", type=int, default=None,
                            help="most requests in one step")
        parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                            help="most tokens in one step (prompt chunks plus decodes)")
        parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
        parser.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
        parser.add_argument("--data-parallel-size", "-dp", type=int, default=1)
        parser.add_argument("--served-model-name", default=None)
        parser.add_argument("--chat-template", default=None,
                            help="a Jinja chat template, or a file holding one")
        parser.add_argument("--enforce-eager", action="store_true")
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, **defaults: int) -> EngineArgs:
        """Build from parsed flags; ``defaults`` fill flags left unset (serve vs offline)."""
        values = {}
        for f in dataclasses.fields(cls):
            value = getattr(args, f.name, None)
            if value is None:
                value = defaults.get(f.name, f.default)
            values[f.name] = value
        return cls(**values)

    def create_engine_config(self) -> EngineConfig:
        source = resolve_model(self.model)
        hf_config = load_hf_config(source)
        model_dtype = getattr(hf_config, "dtype", None)
        if isinstance(model_dtype, str):
            model_dtype = getattr(torch, model_dtype, None)
        dtype = resolve_dtype(self.dtype, model_dtype)

        max_position = getattr(hf_config, "max_position_embeddings", None) or 2048
        max_model_len = self.max_model_len or max_position
        if max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
        if max_model_len > max_position:
            raise ValueError(f"max_model_len={max_model_len} is larger than the model's "
                             f"max_position_embeddings={max_position}")
        chat_template = self.chat_template
        if chat_template and "{" not in chat_template:
            with open(chat_template) as f:
                chat_template = f.read()
        model_config = ModelConfig(
            source=source, hf_config=hf_config, dtype=dtype, max_model_len=max_model_len,
            seed=self.seed, tokenizer=self.tokenizer, chat_template=chat_template,
            served_model_name=self.served_model_name or (self.model or DEFAULT_MODEL_NAME),
            enforce_eager=self.enforce_eager)
        parallel = ParallelConfig(self.tensor_parallel_size, self.pipeline_parallel_size,
                                  self.data_parallel_size)
        scheduler = SchedulerConfig(self.max_num_seqs, self.max_num_batched_tokens, max_model_len)
        cache = CacheConfig(self.block_size, self._num_kv_blocks(model_config),
                            self.enable_prefix_caching)
        return EngineConfig(model_config, cache, scheduler, parallel)

    def _num_kv_blocks(self, model_config: ModelConfig) -> int:
        if self.block_size <= 0 or self.block_size % 32:
            raise ValueError(f"block_size must be a positive multiple of 32, got {self.block_size}")
        block_bytes = model_config.kv_bytes_per_token() * self.block_size
        blocks_per_seq = math.ceil(model_config.max_model_len / self.block_size)
        if self.kv_cache_memory_bytes is not None:
            budget, origin = self.kv_cache_memory_bytes, "--kv-cache-memory-bytes"
        elif envs.VLLM_CPU_KVCACHE_SPACE:
            budget, origin = int(envs.VLLM_CPU_KVCACHE_SPACE * GiB), "VLLM_CPU_KVCACHE_SPACE"
        else:
            # No more than the scheduler could ever fill, nor half of the free memory.
            budget = min(_DEFAULT_KV_CACHE_SPACE,
                         self.max_num_seqs * blocks_per_seq * block_bytes)
            available = _mem_available()
            if available is not None:
                budget = min(budget, available // 2)
            origin = "default"
        num_blocks = budget // block_bytes
        if num_blocks < blocks_per_seq:
            raise ValueError(
                f"KV cache of {budget / GiB:.3f} GiB ({origin}) holds {num_blocks} blocks of "
                f"{self.block_size} tokens, but one request at max_model_len="
                f"{model_config.max_model_len} needs {blocks_per_seq} blocks "
                f"({blocks_per_seq * block_bytes / GiB:.3f} GiB); raise the KV cache size "
                "or lower --max-model-len")
        logger.info("KV cache: %.2f GiB (%s), %d blocks of %d tokens, max concurrency %.1fx "
                    "at %d tokens per request", num_blocks * block_bytes / GiB, origin,
                    num_blocks, self.block_size, num_blocks / blocks_per_seq,
                    model_config.max_model_len)
        return num_blocks
