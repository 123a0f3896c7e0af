"""CPU facts from /proc/cpuinfo and the dtype and ISA policies built on them."""

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
# ISA features that change what cpullm can do fast, in the order they are reported.
X86_FEATURES = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_bf16",
                "amx_int8")
ARM_FEATURES = ("asimd", "sve", "sve2", "bf16", "fphp", "i8mm")


@dataclass(frozen=True)
class CpuInfo:
    """Facts about the CPU, parsed from a /proc/cpuinfo text."""

    vendor: str  # GenuineIntel, AuthenticAMD, ARM or unknown
    model_name: str
    flags: frozenset[str]
    family: int = 0  # x86's "cpu family" (AMD: 25 Zen 3/4, 26 Zen 5); 0 where unknown

    @property
    def is_x86(self) -> bool:
        return self.vendor in ("GenuineIntel", "AuthenticAMD") or "avx" in self.flags \
            or "sse2" in self.flags

    @property
    def is_arm(self) -> bool:
        return self.vendor == "ARM"

    @property
    def features(self) -> list[str]:
        """The ISA features that matter, present on this CPU."""
        wanted = ARM_FEATURES if self.is_arm else X86_FEATURES
        return [f for f in wanted if f in self.flags]

    @property
    def supports_fast_bf16(self) -> bool:
        return bool({"avx512_bf16", "amx_bf16"} & self.flags) or (
            self.is_arm and "bf16" in self.flags)

    @property
    def bf16_dots_outrun_vnni(self) -> bool:
        """Whether the CPU runs AVX-512's BF16 dot products at twice the rate of its VNNI
        ones, so that on 32 multiply-adds against 64 the two are even: AMD Zen 5 (two BF16
        dot products a cycle, one VNNI). Zen 4 runs both at one a cycle, Intel's cores
        likewise."""
        return self.vendor == "AuthenticAMD" and self.family >= 26

    @property
    def supports_fast_fp16(self) -> bool:
        return bool({"avx512_fp16", "amx_fp16"} & self.flags) or (
            self.is_arm and "fphp" in self.flags)

    def check_supported(self) -> None:
        """Refuse x86 CPUs without AVX2; warn when AVX2 is all there is."""
        if not self.is_x86:
            return
        if "avx2" not in self.flags:
            raise RuntimeError(f"cpullm needs a CPU with AVX2; {self.model_name} has none")
        if "avx512f" not in self.flags:
            logger.warning("This CPU has AVX2 but no AVX-512: performance is limited")

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
        family = fields.get("cpu family", "")
        return cls(vendor=vendor, model_name=model, flags=frozenset(flags.split()),
                   family=int(family) if family.isdigit() else 0)


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
                  info: CpuInfo | None = None, fast_fp16: bool | None = None) -> torch.dtype:
    """Pick the compute dtype: ``auto`` means bfloat16 first (the checkpoint's float16
    included, by the float16 rule below), float16 falls back to bfloat16 where this CPU
    has no fast float16 (``fast_fp16``: a platform's own word on it, else the CPU's flags),
    with vLLM's warning."""
    info = info or cpu_info()
    if isinstance(requested, torch.dtype):
        dtype = requested
    elif requested == "auto":
        dtype = model_dtype if model_dtype == torch.float16 else torch.bfloat16
    elif requested in _DTYPES:
        dtype = _DTYPES[requested]
    else:
        raise ValueError(f"dtype: unknown value {requested!r}; "
                         f"choose from auto, float32, bfloat16, float16")
    if dtype == torch.float16 and not (info.supports_fast_fp16 if fast_fp16 is None
                                       else fast_fp16):
        logger.warning(_FP16_FALLBACK_WARNING)
        dtype = torch.bfloat16
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype: {dtype} is not supported; use float32, bfloat16 or float16")
    return dtype
