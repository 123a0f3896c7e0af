"""The engine's adapters: the model's LoRA layers, the adapters read from disk (the
``max_cpu_loras`` used last), and which adapter each of the ``max_loras`` slots holds.

The scheduler runs requests of at most ``max_loras`` adapters at once (engine/scheduler.py),
so a step always finds its adapters in slots, loading one into a slot that no step in
flight uses where it must."""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from typing import Any

import numpy as np
import torch
from torch import nn

from cpullm.logger import init_logger
from cpullm.lora.adapter import TARGETS, LoRAAdapter, linear_shapes, read_adapter
from cpullm.lora.layers import LoRALinearMethod
from cpullm.lora.request import LoRAConfig, LoRARequest

logger = init_logger(__name__)

# per output shard of a layer: (A, B) of the adapter, or None
SlotWeights = list[tuple[torch.Tensor, torch.Tensor] | None]


def wrap_lora_layers(model: nn.Module, dtype: torch.dtype, config: LoRAConfig) -> int:
    """Put a LoRALinearMethod around the method of each projection LoRA goes on, before the
    weights load; the number of layers wrapped."""
    from cpullm.model_executor.layers.linear import LinearBase

    wrapped = 0
    for name, module in model.named_modules():
        if isinstance(module, LinearBase) and name.rsplit(".", 1)[-1] in TARGETS \
                and ".experts." not in name:
            module.method = LoRALinearMethod(module.method, config.max_loras,
                                             config.max_lora_rank)
            module.lora_dtype = dtype
            wrapped += 1
    return wrapped


class LoRAModel:
    def __init__(self, model: nn.Module, hf_config: Any, config: LoRAConfig) -> None:
        self.config = config
        self.layers = {name: module for name, module in model.named_modules()
                       if isinstance(getattr(module, "method", None), LoRALinearMethod)}
        if not self.layers:
            raise ValueError(f"LoRA: {type(model).__name__} has none of the projections LoRA "
                             f"goes on ({', '.join(sorted(TARGETS))})")
        self.stacked: dict[str, tuple[str, Any]] = getattr(model, "stacked_params", {})
        self.dtype = next(iter(self.layers.values())).lora_dtype
        # the base model's linear layers as adapters name them: read at startup, not in the
        # step loop at an adapter's first request
        self.shapes = linear_shapes(hf_config)
        self.known: dict[int, LoRARequest] = {}
        self.read: OrderedDict[int, LoRAAdapter] = OrderedDict()
        self.slots: list[int | None] = [None] * config.max_loras
        self.slot_tick = [0] * config.max_loras
        self.pinned: Counter[int] = Counter()  # slot -> steps in flight that use it
        self.tick = 0
        self.lock = threading.Lock()

    def add(self, request: LoRARequest) -> str:
        """Read (or find) the adapter; its prefix-cache key. ValueError for a bad adapter,
        or an id another adapter has."""
        with self.lock:
            known = self.known.get(request.lora_int_id)
            if known is not None and (known.lora_name, known.lora_path) != \
                    (request.lora_name, request.lora_path):
                raise ValueError(f"LoRA adapter {request.lora_name!r}: lora_int_id "
                                 f"{request.lora_int_id} is adapter {known.lora_name!r} "
                                 f"({known.lora_path}) already")
            adapter = self._read(request)
            self.known[request.lora_int_id] = request
            return adapter.key

    def _read(self, request: LoRARequest) -> LoRAAdapter:
        adapter = self.read.get(request.lora_int_id)
        if adapter is None:
            adapter = read_adapter(request, self.shapes, self.config.max_lora_rank)
            for module in adapter.modules:
                self._target(adapter, module)  # every module has a layer here
            self.read[request.lora_int_id] = adapter
            logger.info("LoRA adapter %r read: rank %d, %d modules, from %s",
                        request.lora_name, adapter.rank, len(adapter.modules),
                        request.lora_path)
            while len(self.read) > self.config.cpu_loras:
                self.read.popitem(last=False)
        self.read.move_to_end(request.lora_int_id)
        return adapter

    def _target(self, adapter: LoRAAdapter, module: str) -> tuple[str, int | None]:
        """(layer here, output shard index or None for all of them) of a Hugging Face
        module: q_proj is shard "q" of qkv_proj, up_proj shard 1 of gate_up_proj."""
        parent, leaf = module.rsplit(".", 1)
        merged = self.stacked.get(leaf)
        name, shard = (f"{parent}.{merged[0]}", merged[1]) if merged else (module, None)
        layer = self.layers.get(name)
        if layer is None:
            raise ValueError(f"LoRA adapter {adapter.request.lora_name!r}: no LoRA layer for "
                             f"{module!r} in the base model")
        if shard is None:
            return name, None if len(layer.shard_ids) > 1 else 0
        return name, layer.shard_ids.index(shard)

    def _slot_weights(self, adapter: LoRAAdapter | None) -> dict[str, SlotWeights]:
        weights: dict[str, SlotWeights] = {
            name: [None] * len(layer.shard_ids) for name, layer in self.layers.items()}
        if adapter is None:
            return weights
        for module, (a, b) in adapter.modules.items():
            name, shard = self._target(adapter, module)
            if shard is not None:
                weights[name][shard] = (a, b)
                continue
            layer = self.layers[name]  # a merged layer's adapter, whole: B by shards
            for i, shard_id in enumerate(layer.shard_ids):
                start, end = layer.shard_range(shard_id)
                weights[name][i] = (a, b[start:end])
        return weights

    def _load(self, slot: int, lora_id: int) -> None:
        request = self.known.get(lora_id)
        if request is None:
            raise RuntimeError(f"LoRA adapter id {lora_id} was never added")
        adapter = self._read(request)
        for name, shards in self._slot_weights(adapter).items():
            method: LoRALinearMethod = self.layers[name].method
            for i, pair in enumerate(shards):
                method.load_slot(slot, i, None if pair is None else
                                 (pair[0].to(self.dtype), pair[1].to(self.dtype)))
        self.slots[slot] = lora_id

    def begin_step(self, lora_ids: list[int], query_lens: np.ndarray
                   ) -> tuple[torch.Tensor | None, list[int]]:
        """The mask of a step whose requests have ``lora_ids`` (0: the base model) and
        ``query_lens`` tokens, and the slots it pins until ``end_step``."""
        wanted = {i for i in lora_ids if i}
        if not wanted:
            return None, []
        with self.lock:
            self.tick += 1
            slot_of = {}
            loaded = False
            for lora_id in sorted(wanted):
                if lora_id in self.slots:
                    slot = self.slots.index(lora_id)
                else:
                    free = [s for s in range(len(self.slots))
                            if not self.pinned[s] and self.slots[s] not in wanted]
                    if not free:
                        raise RuntimeError(f"LoRA: no free slot of {len(self.slots)} for a "
                                           "step's adapters")
                    slot = min(free, key=lambda s: (self.slots[s] is not None,
                                                    self.slot_tick[s]))
                    self._load(slot, lora_id)
                    loaded = True
                slot_of[lora_id] = slot
                self.slot_tick[slot] = self.tick
            if loaded:  # once for the step's new slots, not once a slot
                for layer in self.layers.values():
                    layer.method.pack()
            pins = sorted(slot_of.values())
            self.pinned.update(pins)
        slots = np.array([slot_of.get(i, -1) for i in lora_ids], dtype=np.int64)
        token_slots = torch.from_numpy(np.repeat(slots, query_lens))
        one_hot = token_slots[:, None] == torch.arange(len(self.slots))
        return one_hot.to(self.dtype).repeat_interleave(self.config.max_lora_rank, dim=1), pins

    def end_step(self, pins: list[int]) -> None:
        if pins:
            with self.lock:
                self.pinned.subtract(pins)
