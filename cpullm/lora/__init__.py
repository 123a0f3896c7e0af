"""LoRA adapters on a base model: PEFT folders read and checked (adapter.py), the layers'
products beside the kept weights (layers.py), the adapters' slots (manager.py)."""

from cpullm.lora.request import LoRAConfig, LoRARequest

__all__ = ["LoRAConfig", "LoRARequest"]
