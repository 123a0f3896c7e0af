"""ModelRunner: one flat forward pass over all scheduled tokens of a step.

It owns the model, the KV cache tensors, the sampler and the per-request random
generators. It reads a SchedulerOutput and returns a ModelRunnerOutput; it never edits
scheduler state, so it can move into a worker process behind the same contract.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import threading
import time

import numpy as np
import torch

from cpullm import distributed
from cpullm.config import EngineConfig, KVCacheGroups
from cpullm.engine.sched_output import ModelRunnerOutput, SchedulerOutput
from cpullm.logger import init_logger
from cpullm.lora.layers import set_step_mask
from cpullm.lora.manager import LoRAModel
from cpullm.model_executor.layers.attention import (
    AttentionMetadata,
    KVCacheQuant,
    PagedAttention,
)
from cpullm.model_executor.layers.ops import load_ops
from cpullm.model_executor.layers.pooler import finish_embeddings
from cpullm.model_executor.loader import get_model
from cpullm.multimodal import set_step_embeds
from cpullm.platform.affinity import bind_compute_threads, prefer_local_memory
from cpullm.platform.memory import tune_malloc
from cpullm.platform.topology import CpuTopology
from cpullm.pooling_params import PoolingParams
from cpullm.sampling_params import SamplingParams
from cpullm.structured_output import GuidedDecoding
from cpullm.transformers_utils import load_tokenizer
from cpullm.utils import cdiv
from cpullm.worker.request_state import RequestState, RequestStates
from cpullm.worker.sampler import Sampler, compute_logprobs
from cpullm.worker.step_sampler import StepSampler

logger = init_logger(__name__)


# Linux 5.14+: fault a range in for writing, without writing it.
_MADV_POPULATE_WRITE = 23
_RESERVE_CHUNK = 32 << 20  # a multiple of the huge page size


def _kv_cache_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed tensor in its own anonymous mapping, on huge pages where the kernel has
    them (``_reserve`` then makes it resident). Zero matters: attention reads padding slots
    (masked), and garbage there could be NaN, which a mask does not remove."""
    numel = torch.Size(shape).numel()
    nbytes = numel * torch.tensor([], dtype=dtype).element_size()
    buffer = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(AttributeError, OSError):  # where there are no huge pages
        buffer.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(buffer, dtype=dtype, count=numel).view(shape)


def _reserve(tensors: list[torch.Tensor]) -> None:
    """Fault every page of ``tensors`` in now, as vLLM CPU reserves its KV space: pages
    faulted in while requests run put page faults in the prompt steps, and on 4 KiB pages
    the attention kernels miss the TLB on every block they walk (huge pages: 2-6% more
    offline throughput on a 135M model). Huge pages faulted lazily measured 4% slower than
    4 KiB pages: each first touch then clears and backs 2 MiB. The calls wait in the
    kernel with the GIL released, so this runs beside the weight loading; each covers 32
    MiB, so the loader's own mappings never wait long on the address-space lock."""
    libc = ctypes.CDLL(None, use_errno=True)
    for tensor in tensors:
        start, end = tensor.data_ptr(), tensor.data_ptr() + tensor.nbytes
        for chunk in range(start, end, _RESERVE_CHUNK):
            length = min(_RESERVE_CHUNK, end - chunk)
            if libc.madvise(ctypes.c_void_p(chunk), ctypes.c_size_t(length),
                            _MADV_POPULATE_WRITE) != 0:
                tensor.zero_()  # a kernel before 5.14: write the zeros instead
                break


class RunnerBase:
    """What every model runner does around its model: memory on the NUMA node of its
    compute threads, those threads pinned to the rank's CPUs, and the requests' state."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        tune_malloc()
        self.layout = distributed.layout()
        binding = self._binding()
        if binding is not None:  # weights and KV cache on the NUMA node of the compute threads
            prefer_local_memory(*binding)
        # per thread that steps the engine: whether its pool is pinned, its affinity before,
        # and a compute lane's generator (executor/uniproc.py)
        self._bound = threading.local()
        self.requests = RequestStates()  # what the steps' SchedulerOutputs sent so far

    def _binding(self) -> tuple[CpuTopology, list[int]] | None:
        """The topology and the CPUs this rank's compute threads are pinned to; None when
        unbound."""
        parallel = self.config.parallel
        if parallel.binding.mode == "nobind" or parallel.topology is None:
            return None
        local = self.layout.rank - parallel.local_ranks.start  # this host's plan
        return parallel.topology, list(parallel.binding.rank_cpus[local])

    def bound_cpus(self) -> list[int] | None:
        """The CPUs of this rank's compute threads; None when unbound."""
        binding = self._binding()
        return None if binding is None else binding[1]

    def bind_threads(self, cpus: list[int] | None = None,
                     generator: torch.Generator | None = None) -> None:
        """Pin the compute threads of the calling thread, the one that runs the model
        (OpenMP keeps one pool per calling thread, so ``execute`` calls this on the first
        step of each thread that steps the engine). A compute lane's thread is pinned to its
        share of the CPUs (``cpus``) and draws its unseeded requests' random numbers from
        its own ``generator``, so that they do not depend on how the lanes' steps
        interleave."""
        if getattr(self._bound, "done", False):
            return
        self._bound.done = True
        self._bound.generator = generator
        binding = self._binding()
        if binding is None:
            return
        topology, all_cpus = binding
        cpus = all_cpus if cpus is None else cpus
        self._bound.affinity = os.sched_getaffinity(0)
        got = bind_compute_threads(cpus, load_ops())
        prefer_local_memory(topology, cpus)
        logger.info("Compute threads pinned: %s", ", ".join(
            f"thread {i} -> CPU {cpu}" for i, cpu in enumerate(got)))

    def release_calling_thread(self) -> None:
        """Give the thread that ran the model its CPUs back (``LLM.generate`` calls this as
        it returns, so that the caller, and a second engine it plans, are not left on one
        CPU); the next step on it pins it again."""
        if not getattr(self._bound, "done", False):
            return
        self._bound.done = False
        affinity = getattr(self._bound, "affinity", None)
        if affinity is not None:
            os.sched_setaffinity(0, affinity)
            self._bound.affinity = None


class ModelRunner(RunnerBase):
    """One rank's model runner: under tensor and pipeline parallelism (a worker process,
    cpullm/executor/multiproc.py) it holds its rank's share of the model and of the KV
    heads, and the first rank of the last stage samples."""

    def __init__(self, config: EngineConfig, eos_token_ids: set[int]) -> None:
        super().__init__(config)
        model_config = config.model
        self.block_size = config.cache.block_size
        self.sliding_window = model_config.sliding_window
        # LongRoPE: the rotary tables' long factors start here (layers/rotary.py)
        self.long_rope_offset = model_config.longrope_edge
        groups = config.cache.groups or KVCacheGroups.plan([0] * model_config.num_layers)
        # one tensor per layer slot of the groups (config.KVCacheGroups), each with the NULL
        # page past the pool's where sliding groups drop blocks
        shape = (2, config.cache.num_blocks + groups.has_windows, self.block_size,
                 model_config.kv_heads_per_rank(self.layout.tp_size), model_config.head_dim)
        stage = self.layout.stage_layers(model_config.num_layers)
        slots = {slot: _kv_cache_tensor(shape, model_config.kv_storage_dtype)
                 for slot in sorted({groups.layer_slot[layer] for layer in stage})}
        self.kv_caches = [slots[groups.layer_slot[layer]] for layer in stage]  # per layer
        # an int8 cache's float16 scales, K's and V's per row, one tensor per layer slot
        self.kv_scales = {slot: _kv_cache_tensor(shape[:-1], torch.float16) for slot in slots} \
            if model_config.kv_cache_dtype == "int8" else {}
        # Where the host backs a VM's memory page by page, reserving takes seconds.
        reserving = threading.Thread(target=_reserve,
                                     args=([*slots.values(), *self.kv_scales.values()],),
                                     name="kv-reserve", daemon=True)
        start = time.perf_counter()
        reserving.start()
        ops = None if model_config.enforce_eager else load_ops()
        self.model = get_model(model_config, ops)
        self._assign_kv_groups(groups, stage)
        self.lora = LoRAModel(self.model, model_config.hf_config, model_config.lora) \
            if model_config.lora is not None else None
        reserving.join()
        logger.info("KV cache of %.2f GiB reserved (%.1f s with the model loading)",
                    sum(c.nbytes for c in [*slots.values(), *self.kv_scales.values()]) / (1 << 30),
                    time.perf_counter() - start)
        self.sampler = StepSampler(
            Sampler(model_config.vocab_size, eos_token_ids, ops),
            GuidedDecoding(lambda: load_tokenizer(model_config.source, model_config.tokenizer,
                                                  model_config.hf_config),
                           model_config.vocab_size))
        if self.layout.rank == self.layout.output_rank and not model_config.is_pooling:
            self.sampler.guided.warm()  # (on the rank that samples)
        # a decoder's embedding requests: id -> (sum, count, first) of their hidden states
        self._pooling: dict[str, tuple[torch.Tensor, int, torch.Tensor]] = {}
        # a vision-language model's encoded images: request id -> {image index: embeddings},
        # each kept until the request's computed tokens pass the image's
        self._encoded: dict[str, dict[int, torch.Tensor]] | None = \
            {} if model_config.mm_config is not None else None

    def _step_images(self, items: list[RequestState], query_ends: np.ndarray
                     ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The step's image embeddings: (flat token indices, rows) for the image tokens
        it computes, each image encoded when a step first reaches it."""
        assert self._encoded is not None
        indices, rows = [], []
        for item, end in zip(items, query_ends, strict=True):
            start, stop = item.num_computed_tokens, item.num_computed_tokens + item.num_tokens
            first = int(end) - item.num_tokens  # the flat index of its position start
            for i, image in enumerate(item.images):
                lo, hi = max(start, image.offset), min(stop, image.offset + image.length)
                if lo >= hi:
                    continue
                encoded = self._encoded.setdefault(item.request_id, {})
                if i not in encoded:
                    pixels = image.pixel_values[None].to(self.config.model.dtype)
                    encoded[i] = self.model.encode_images(pixels)[0]
                indices.append(torch.arange(first + lo - start, first + hi - start))
                rows.append(encoded[i][lo - image.offset:hi - image.offset])
                if hi == image.offset + image.length:  # its last tokens: not needed again
                    del encoded[i]
        if not indices:
            return None
        return torch.cat(indices), torch.cat(rows)

    def _assign_kv_groups(self, groups: KVCacheGroups, stage: range) -> None:
        """Tell each attention layer of this stage which group's block tables it reads,
        and check that a group that drops blocks has the window of each of its layers."""
        attentions = [m for m in self.model.modules() if isinstance(m, PagedAttention)]
        if len(attentions) != len(stage):
            raise RuntimeError(f"{len(attentions)} attention layers for {len(stage)} decoder "
                               "layers")
        for layer, attention in zip(stage, attentions, strict=True):
            window = attention.window if attention.window is not None else \
                (self.sliding_window or 0)
            attention.kv_group = groups.layer_group[layer]
            if self.config.model.kv_cache_quantized:
                attention.kv_quant = KVCacheQuant(
                    self.config.model.kv_storage_dtype,
                    self.kv_scales.get(groups.layer_slot[layer]),
                    calculate=self.config.model.calculate_kv_scales)
            if groups.windows[attention.kv_group] not in (0, window):
                raise RuntimeError(f"layer {layer} attends to a window of {window} tokens, "
                                   f"but its KV cache group keeps "
                                   f"{groups.windows[attention.kv_group]}")

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.bind_threads()
        for request_id in scheduler_output.finished_request_ids:
            self.sampler.drop(request_id)
            self._pooling.pop(request_id, None)
            if self._encoded is not None:
                self._encoded.pop(request_id, None)
        items = self.requests.update(scheduler_output)
        if not items:
            return ModelRunnerOutput()
        # Decoding requests first (one new token, and any proposed after it): attention runs
        # them on its decode path.
        items.sort(key=lambda r: r.num_tokens - len(r.spec_token_ids) > 1)
        input_ids, positions, meta, query_ends = self._prepare_inputs(items)
        layout = self.layout
        intermediate = None
        if not layout.is_first_stage:  # the previous stage's hidden states and residual
            shape = (len(input_ids), self.config.model.hf_config.hidden_size)
            hidden, residual = distributed.recv_from_previous_stage([shape, shape],
                                                                    self.config.model.dtype)
            intermediate = (hidden, residual)
        mask, pins = (None, []) if self.lora is None else self.lora.begin_step(
            [item.lora_id for item in items],
            np.fromiter((r.num_tokens for r in items), dtype=np.int64, count=len(items)))
        set_step_mask(mask)
        set_step_embeds(self._step_images(items, query_ends) if self._encoded is not None
                        else None)
        try:
            hidden = self.model(input_ids, positions, self.kv_caches, meta, intermediate)
        finally:
            set_step_mask(None)
            set_step_embeds(None)
            if self.lora is not None:
                self.lora.end_step(pins)
        if not layout.is_last_stage:
            distributed.send_to_next_stage(list(hidden))
            return ModelRunnerOutput()

        output = ModelRunnerOutput()
        pooling = [i for i, item in enumerate(items)
                   if isinstance(item.sampling_params, PoolingParams)]
        if pooling:
            self._pool([items[i] for i in pooling], hidden, query_ends[pooling], output)
        rows = [i for i, item in enumerate(items)
                if item.sample and isinstance(item.sampling_params, SamplingParams)]
        prompt_rows = self._prompt_logprob_rows(items, query_ends)
        # a sampling request's last num_rows positions (more than one with proposals)
        logits_index = [position for i in rows for position in
                        range(int(query_ends[i]) - items[i].num_rows, int(query_ends[i]))]
        num_rows = len(logits_index)
        for _, flat_index, _ in prompt_rows:
            logits_index.extend(flat_index)
        if not logits_index:
            return output
        logits = self.model.compute_logits(hidden[logits_index])
        if self.layout.tp_size > 1:  # every rank computed its slice of the vocabulary
            logits = self.model.lm_head.gather_logits(logits)
            if logits is None:
                return output  # the first rank samples
        # [rows, vocab] in the model's dtype: the sampler widens them where a row needs
        # float32 (an argmax or the fused draw widens bfloat16 as it reads it)

        if rows:
            self.sampler.sample([items[i] for i in rows], logits[:num_rows], output,
                                getattr(self._bound, "generator", None))
        offset = num_rows
        for item, flat_index, targets in prompt_rows:
            chunk = logits[offset:offset + len(flat_index)]
            offset += len(flat_index)
            output.prompt_logprobs[item.request_id] = compute_logprobs(
                chunk.float(), torch.tensor(targets), item.sampling_params.prompt_logprobs or 0)
        return output

    def _pool(self, items: list[RequestState], hidden: torch.Tensor,
              query_ends: np.ndarray, output: ModelRunnerOutput) -> None:
        """A decoder's embedding requests (``--task embed`` on the Llama layout): each
        chunk's final hidden states folded into its request's pooling state (a sum and a
        count, the first token's), and the embedding when the last chunk is computed."""
        pooler = self.config.model.pooler_config
        for item, end in zip(items, query_ends, strict=True):
            chunk = hidden[int(end) - item.num_tokens:int(end)].float()
            if item.num_computed_tokens == 0:  # (from the start again after a preemption)
                self._pooling[item.request_id] = (torch.zeros(chunk.shape[1]), 0, chunk[0])
            total, count, first = self._pooling[item.request_id]
            self._pooling[item.request_id] = (total + chunk.sum(0), count + len(chunk), first)
            if not item.sample:
                continue
            total, count, first = self._pooling.pop(item.request_id)
            vector = {"MEAN": total / count, "CLS": first, "LAST": chunk[-1]}[
                pooler.pooling_type]
            params: PoolingParams = item.sampling_params  # type: ignore[assignment]
            output.pooled[item.request_id] = finish_embeddings(
                vector[None], [pooler.normalize if params.normalize is None
                               else params.normalize], [params.dimensions])[0]

    def _prepare_inputs(self, items: list[RequestState]
                        ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, np.ndarray]:
        bs = self.block_size
        query_lens = np.array([r.num_tokens for r in items], dtype=np.int64)
        starts = np.array([r.num_computed_tokens for r in items], dtype=np.int64)
        query_ends = np.cumsum(query_lens)
        num_tokens = int(query_ends[-1])
        seq_lens = starts + query_lens
        input_ids = np.fromiter((t for r in items for t in r.token_ids), dtype=np.int64,
                                count=num_tokens)
        # position of every flat token = its request's start + its offset in the request
        request_of_token = np.repeat(np.arange(len(items)), query_lens)
        positions = (np.arange(num_tokens) - np.repeat(query_ends - query_lens, query_lens)
                     + np.repeat(starts, query_lens))
        long_rope = np.fromiter((r.long_rope for r in items), dtype=bool, count=len(items))
        if long_rope.any():  # their rotary positions index the long factors' tables
            rope_positions = positions + np.repeat(long_rope, query_lens) * self.long_rope_offset
        else:
            rope_positions = positions
        # [groups, requests, blocks]; every group's table of a request is as long
        num_groups = len(items[0].block_tables)
        max_blocks = max(len(r.block_tables[0]) for r in items)
        block_tables = np.zeros((num_groups, len(items), max_blocks), dtype=np.int64)
        for i, r in enumerate(items):
            for group, table in enumerate(r.block_tables):
                block_tables[group, i, :len(table)] = table
        #   slot = block_table[position // block_size] * block_size + position % block_size
        # [groups, tokens], each group's row contiguous (the KV-store kernel's slots)
        slot_mapping = np.ascontiguousarray(block_tables[:, request_of_token, positions // bs] * bs
                                            + positions % bs)

        # The decoding requests' tokens are each a query of its own on the decode path: one
        # with proposed tokens is several decodes over the same blocks, the context of each
        # ending at its own position (so the causal mask is their lengths):
        #   positions c, c+1, c+2 (a token, two proposals) -> seq_lens c+1, c+2, c+3
        decoding = int(((query_lens - [len(r.spec_token_ids) for r in items]) == 1).sum())
        nd = int(query_ends[decoding - 1]) if decoding else 0  # decode tokens
        decode_seq_lens = positions[:nd] + 1
        decode_blocks = cdiv(int(decode_seq_lens.max()), bs) if nd else 0
        p_lens, p_starts = query_lens[decoding:], starts[decoding:]
        max_q = int(p_lens.max()) if len(p_lens) else 0
        prefill_blocks = cdiv(int(seq_lens[decoding:].max()), bs) if len(p_lens) else 0
        prefill_query_index = (np.repeat(np.arange(len(p_lens)) * max_q, p_lens)
                               + np.arange(num_tokens - nd)
                               - np.repeat(np.cumsum(p_lens) - p_lens, p_lens))
        decode_rows = request_of_token[:nd]
        meta = AttentionMetadata(
            slot_mapping=list(torch.from_numpy(slot_mapping)),
            num_decode_tokens=nd,
            decode_block_tables=[
                torch.from_numpy(np.ascontiguousarray(tables[decode_rows, :decode_blocks]))
                for tables in block_tables],
            decode_seq_lens=torch.from_numpy(decode_seq_lens),
            sliding_window=self.sliding_window or 0,
            prefill_block_tables=[
                torch.from_numpy(np.ascontiguousarray(tables[decoding:, :prefill_blocks]))
                for tables in block_tables],
            prefill_query_index=torch.from_numpy(prefill_query_index),
            prefill_max_query_len=max_q,
            prefill_starts=torch.from_numpy(p_starts),
            prefill_query_lens=torch.from_numpy(p_lens),
            prefill_fresh=bool(len(p_starts)) and not p_starts.any(),
            block_size=bs)
        return torch.from_numpy(input_ids), torch.from_numpy(rope_positions), meta, query_ends

    @staticmethod
    def _prompt_logprob_rows(items: list[RequestState], query_ends: np.ndarray
                             ) -> list[tuple[RequestState, list[int], list[int]]]:
        """(request, flat token indices, next prompt tokens) for the prompt positions whose
        logprobs were asked: position p predicts prompt token p + 1."""
        rows = []
        for item, end in zip(items, query_ends, strict=True):
            if getattr(item.sampling_params, "prompt_logprobs", None) is None:
                continue  # (none asked, or a pooling request)
            first = item.num_computed_tokens
            last = min(first + item.num_tokens, len(item.prompt_token_ids) - 1)
            if first >= last:
                continue
            flat_start = int(end) - item.num_tokens
            rows.append((item, list(range(flat_start, flat_start + last - first)),
                         item.prompt_token_ids[first + 1:last + 1]))
        return rows
