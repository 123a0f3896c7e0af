"""KV cache size from the flag, the environment variable, or the default."""

from __future__ import annotations

import pytest

from cpullm.engine_args import EngineArgs

BLOCK_BYTES = 32 * 512  # tiny llama in float32: 512 bytes of K and V per token


def blocks(model_dir, **kwargs) -> int:
    args = EngineArgs(model=str(model_dir), dtype="float32", block_size=32, max_model_len=256,
                      **kwargs)
    return args.create_engine_config().cache.num_blocks


def test_flag_env_and_default(tiny_model, monkeypatch):
    model = tiny_model("llama")
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    assert blocks(model, kv_cache_memory_bytes=1 << 20) == (1 << 20) // BLOCK_BYTES
    # default: what max_num_seqs requests at max_model_len can use, no more
    assert blocks(model, max_num_seqs=4) == 4 * 8
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "0.001")
    assert blocks(model) == int(0.001 * 2**30) // BLOCK_BYTES
    assert blocks(model, kv_cache_memory_bytes=1 << 20) == 64  # the flag wins


def test_too_small_for_one_request_is_refused(tiny_model):
    with pytest.raises(ValueError, match=r"holds 3 blocks .* needs 8 blocks"):
        blocks(tiny_model("llama"), kv_cache_memory_bytes=3 * BLOCK_BYTES)


def test_more_than_memory_is_refused(tiny_model):
    with pytest.raises(ValueError, match="GiB available"):
        blocks(tiny_model("llama"), kv_cache_memory_bytes=1 << 50)


def test_bad_environment_values(tiny_model, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "lots")
    with pytest.raises(ValueError, match="VLLM_CPU_KVCACHE_SPACE"):
        blocks(tiny_model("llama"))
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-999")
    with pytest.raises(ValueError, match="do not exist"):
        blocks(tiny_model("llama"))


def test_prefix_caching_hash_algo(tiny_model):
    model = tiny_model("llama")
    assert blocks(model, prefix_caching_hash_algo="sha256") > 0
    with pytest.raises(ValueError, match="'xxhash' is not supported; supported: sha256"):
        blocks(model, prefix_caching_hash_algo="xxhash")


def test_data_parallel_replicas_share_the_memory(tiny_model, monkeypatch):
    """Each replica holds the weights and its own KV cache of the size asked for."""
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    model = tiny_model("llama")
    args = EngineArgs(model=str(model), dtype="float32", block_size=32, max_model_len=256,
                      kv_cache_memory_bytes=1 << 20, data_parallel_size=2)
    config = args.create_engine_config()
    assert config.cache.num_blocks == (1 << 20) // BLOCK_BYTES  # per replica
    assert [config.replica(i).parallel.data_parallel_rank for i in (0, 1)] == [0, 1]
    with pytest.raises(ValueError, match="for each of 2 ranks"):
        EngineArgs(model=str(model), dtype="float32", block_size=32, max_model_len=256,
                   kv_cache_memory_bytes=1 << 50, data_parallel_size=2).create_engine_config()
