"""What this CPU is (facts) and what cpullm does about it (policies)."""

from cpullm.platform.binding import BindingPlan, plan_binding
from cpullm.platform.cpu import CpuInfo, cpu_info, resolve_dtype
from cpullm.platform.topology import CpuTopology, format_cpu_list, parse_cpu_list

__all__ = ["BindingPlan", "CpuInfo", "CpuTopology", "cpu_info", "format_cpu_list",
           "parse_cpu_list", "plan_binding", "resolve_dtype"]
