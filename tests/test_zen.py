"""The AMD Zen platform: when it is selected, its float16 rule, and zentorch's GEMMs where
they are chosen (those tests need zentorch: pip install 'cpullm[zen]')."""

from __future__ import annotations

import logging
import types

import pytest
import torch
import torch.nn.functional as F
from conftest import kernels_or_skip
from cpu_platform.machines import MACHINES, make_machine

from cpullm.platform import CpuTopology, resolve_dtype
from cpullm.platform.zen import fast_fp16, import_zentorch, is_zen_cpu, zen_platform_selected

ZENTORCH = types.ModuleType("zentorch")  # what the selection sees of an importable zentorch


@pytest.mark.parametrize("machine, zentorch, selected", [
    ("zen4", ZENTORCH, True),       # AuthenticAMD with AVX-512, zentorch imports
    ("zen4", None, False),          # zentorch not installed
    ("xeon-2s", ZENTORCH, False),   # an Intel CPU
    ("arm", ZENTORCH, False),
])
def test_selected_on_amd_with_avx512_and_zentorch(tmp_path, machine, zentorch, selected):
    info = CpuTopology.detect(make_machine(tmp_path, **MACHINES[machine])).info
    assert zen_platform_selected(info, zentorch) is selected


def test_an_amd_cpu_without_avx512_is_not_zen(tmp_path):
    spec = {**MACHINES["zen4"], "flags": "fpu sse2 avx avx2 fma"}  # Zen 3
    info = CpuTopology.detect(make_machine(tmp_path, **spec)).info
    assert not is_zen_cpu(info)
    assert not zen_platform_selected(info, ZENTORCH)


def test_float16_follows_zentorch(tmp_path, caplog):
    """On the Zen platform float16 is kept only where zentorch reports AVX512-FP16."""
    info = CpuTopology.detect(make_machine(tmp_path, **MACHINES["zen4"])).info
    no_fp16 = types.SimpleNamespace(_C=types.SimpleNamespace(is_fp16_supported=lambda: False))
    has_fp16 = types.SimpleNamespace(_C=types.SimpleNamespace(is_fp16_supported=lambda: True))
    with caplog.at_level(logging.WARNING):
        assert resolve_dtype("float16", None, info, fast_fp16(no_fp16)) == torch.bfloat16
    assert "Falling back to torch.bfloat16" in caplog.text
    assert resolve_dtype("float16", None, info, fast_fp16(has_fp16)) == torch.float16
    assert resolve_dtype("bfloat16", None, info, fast_fp16(no_fp16)) == torch.bfloat16
    assert fast_fp16(None) is None  # elsewhere the CPU's flags decide
    assert resolve_dtype("float16", None, info, None) == torch.bfloat16  # zen4: no avx512_fp16


@pytest.fixture
def zentorch():
    module = import_zentorch()
    if module is None:
        pytest.skip("zentorch is not installed (pip install 'cpullm[zen]')")
    return module


@pytest.mark.parametrize("small, large", [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("silu_mul", [False, True])
def test_zentorch_gemms_where_chosen(zentorch, monkeypatch, small, large, silu_mul):
    from cpullm.model_executor.layers import platform_gemm as zen
    from cpullm.model_executor.layers.activation import SiluAndMul
    from cpullm.model_executor.layers.ops import load_ops
    from cpullm.model_executor.layers.packed_gemm import PackedGemm

    ops = load_ops()
    kernels_or_skip(ops is not None, {"avx2"}, "the CPU kernels")
    monkeypatch.setattr(zen, "_choices", {})
    monkeypatch.setattr(zen, "_measure", lambda *args: (small, large))
    torch.manual_seed(0)
    weight = (torch.randn(256, 128) * 0.1).to(torch.bfloat16)
    bias = None if silu_mul else torch.randn(256).to(torch.bfloat16)
    act = SiluAndMul() if silu_mul else None
    own = PackedGemm(weight, bias, ops, act)
    gemm = zen.zen_gemm(own, weight, bias, zentorch)
    assert isinstance(gemm, zen.ZenGemm) and "zentorch" in gemm.describe()
    assert (gemm.panels is None) is (small and large)  # the unused copy is dropped
    for rows in (1, 8, 40):
        x = torch.randn(2, rows, 128).to(torch.bfloat16)
        ref = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
        if silu_mul:
            ref = F.silu(ref[..., :128]) * ref[..., 128:]
        out = gemm(x)
        assert out.shape == ref.shape
        torch.testing.assert_close(out.float(), ref, atol=0.05, rtol=0.02)


def test_a_slower_zentorch_is_not_used(zentorch, monkeypatch):
    from cpullm.model_executor.layers import platform_gemm as zen
    from cpullm.model_executor.layers.ops import load_ops
    from cpullm.model_executor.layers.packed_gemm import PackedGemm

    ops = load_ops()
    kernels_or_skip(ops is not None, {"avx2"}, "the CPU kernels")
    monkeypatch.setattr(zen, "_choices", {})
    monkeypatch.setattr(zen, "_measure", lambda *args: (False, False))
    weight = torch.randn(64, 64).to(torch.bfloat16)
    own = PackedGemm(weight, None, ops, None)
    assert zen.zen_gemm(own, weight, None, zentorch) is own
