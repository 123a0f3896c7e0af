"""CPU facts from /proc/cpuinfo and the dtype policy built on them."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from cpullm.logger import init_logger

logger = init_logger(__name__)

_FP16_FALLBACK_WARNING = (
    "Your device 'cpu' doesn't support torch.float16. "
    "Falling back to torch.bfloat16 for compatibility."
)


@dataclass(frozen=True)
class CpuInfo:
    """Facts about the CPU, parsed from a /proc/cpuinfo text."""

    vendor: str
    model_name: str
    flags: frozenset[str]

    @property
    def supports_fast_bf16(self) -> bool:
        return bool({"avx512_bf16", "amx_bf16"} & self.flags) or "bf16" in self.flags

    @property
    def supports_fast_fp16(self) -> bool:
        return bool({"avx512_fp16", "amx_fp16"} & self.flags) or "fphp" in self.flags

    @classmethod
    def parse(cls, text: str) -> CpuInfo:
        fields: dict[str, str] = {}
        for line in text.splitlines():
            key, sep, value = line.partition(":")
            if not sep:
                if fields:  # the first processor block is enough
                    break
                continue
            fields.setdefault(key.strip(), value.strip())
        flags = fields.get("flags") or fields.get("Features") or ""
        vendor = fields.get("vendor_id") or ("ARM" if "CPU implementer" in fields else "unknown")
        model = fields.get("model name") or fields.get("CPU part") or "unknown"
        return cls(vendor=vendor, model_name=model, flags=frozenset(flags.split()))


@functools.cache
def cpu_info() -> CpuInfo:
    try:
        with open("/proc/cpuinfo") as f:
            return CpuInfo.parse(f.read())
    except OSError:
        return CpuInfo(vendor="unknown", model_name="unknown", flags=frozenset())


_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
}


def resolve_dtype(requested: str | torch.dtype, model_dtype: torch.dtype | None,
                  info: CpuInfo | None = None) -> torch.dtype:
    """Pick the compute dtype: ``auto`` means the checkpoint's dtype (bfloat16 when the
    checkpoint is float32 or unknown, as vLLM CPU does), float16 falls back to bfloat16
    where this CPU has no fast float16."""
    info = info or cpu_info()
    if isinstance(requested, torch.dtype):
        dtype = requested
    elif requested == "auto":
        dtype = model_dtype if model_dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
    elif requested in _DTYPES:
        dtype = _DTYPES[requested]
    else:
        raise ValueError(f"dtype: unknown value {requested!r}; "
                         f"choose from auto, float32, bfloat16, float16")
    if dtype == torch.float16 and not info.supports_fast_fp16:
        logger.warning(_FP16_FALLBACK_WARNING)
        dtype = torch.bfloat16
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype: {dtype} is not supported; use float32, bfloat16 or float16")
    return dtype
