"""What this CPU is (facts) and what cpullm does about it (policies)."""

from cpullm.platform.cpu import CpuInfo, cpu_info, resolve_dtype

__all__ = ["CpuInfo", "cpu_info", "resolve_dtype"]
