from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cpullm import distributed
from cpullm.model_executor.layers.ops import Kernel, KernelTable
from cpullm.model_executor.layers.packed_gemm import PackedGemm
from cpullm.model_executor.layers.platform_gemm import create_gemm
from cpullm.model_executor.layers.quantization.base import QuantizationConfig
from cpullm.model_executor.layers.quantization.gguf import RawBlocks
from cpullm.model_executor.layers.quantization.int_groups import CheckpointScheme, IntGroups
from cpullm.model_executor.layers.quantization.kept import QuantizedWeight
from cpullm.utils import cdiv


class VocabEmbedding(nn.Module):
    """Token embedding table [vocab_size, hidden_size]; also the LM head when tied.

    With a quantization config, a checkpoint's block-quantized table stays quantized
    (``quantized``): a lookup dequantizes only the rows it reads. Under tensor parallelism
    each rank holds ``rows`` consecutive tokens of the vocabulary (the last rank fewer
    where it does not divide), looks up those of its tokens that fall in them, and the
    ranks sum their lookups."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype | None = None,
                 quant_config: QuantizationConfig | None = None) -> None:
        super().__init__()
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        ranks = distributed.tp_size()
        self.rows = cdiv(vocab_size, ranks)
        self.vocab_start = min(vocab_size, distributed.tp_rank() * self.rows)
        self.vocab_end = min(vocab_size, self.vocab_start + self.rows)
        self.weight = nn.Parameter(
            torch.empty(self.vocab_end - self.vocab_start, hidden_size, dtype=dtype),
            requires_grad=False)
        self.quantized: QuantizedWeight | None = None
        # tied to a packed LM head: its panels, read by the kernel (the plain table freed)
        self.panels: torch.Tensor | None = None
        self.from_panels: Kernel | None = None
        if quant_config is not None or ranks > 1:
            self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor | RawBlocks,
                      shard_id: str | int | None = None) -> None:
        if tuple(loaded.shape) != (self.vocab_size, self.hidden_size):
            raise ValueError(f"checkpoint {tuple(loaded.shape)}, model "
                             f"{(self.vocab_size, self.hidden_size)}")
        loaded = loaded.narrow(0, self.vocab_start, self.vocab_end - self.vocab_start)
        if isinstance(loaded, RawBlocks):
            self.quantized = loaded.to_weight()
            param.data = torch.empty(0, dtype=param.dtype)  # shared with a tied LM head
        else:
            param.data.copy_(loaded)

    def process_weights_after_loading(self, ops: KernelTable | None) -> None:
        """Where the quantized kernels do not run, the table is dequantized once (as the
        linear layers are); a tied LM head shares the dequantized weight."""
        if self.quantized is not None and not QuantizedWeight.kernels_run(ops, self.weight.dtype):
            self.weight.data = self.quantized.dequantize(self.weight.dtype)
            self.quantized = None

    def read_from(self, gemm: PackedGemm, ops: KernelTable) -> None:
        """Look the rows up in a tied LM head's packed panels and free the plain table,
        where the kernels can (the panels are bfloat16 ones of the whole table)."""
        if ops.embedding_from_panels is None or gemm.panels is None or gemm.silu_mul \
                or gemm.panels.dtype != torch.bfloat16:
            return
        self.panels, self.from_panels = gemm.panels, ops.embedding_from_panels
        self.weight.data = torch.empty(0, dtype=self.weight.dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        split = self.rows < self.vocab_size
        if split:  # this rank's tokens only; the others' rows come out zero
            input_ids = input_ids - self.vocab_start
            outside = (input_ids < 0) | (input_ids >= self.vocab_end - self.vocab_start)
            input_ids = input_ids.masked_fill(outside, 0)
        if self.quantized is not None:
            out = self.quantized.dequantize(self.weight.dtype, input_ids)
        elif self.from_panels is not None:
            ids = input_ids.reshape(-1).contiguous()
            out = torch.empty(len(ids), self.hidden_size, dtype=self.weight.dtype)
            self.from_panels(out, ids, self.panels)
            out = out.view(*input_ids.shape, self.hidden_size)
        else:
            out = F.embedding(input_ids, self.weight)
        if split:
            out.masked_fill_(outside[:, None], 0)
            distributed.tp_all_reduce(out)
        return out


class LMHead(VocabEmbedding):
    """Projects hidden states to vocabulary logits. ``tied``: the embedding table whose
    weight it shares (quantized or not). A checkpoint whose format quantizes the LM head
    too (GPTQ's ``lm_head``: the config's ``lm_head_scheme``) loads the format's tensors
    instead of a float weight, kept quantized as the linear layers are. ``int8``
    (--lm-head-quantization int8): a float head is quantized at load instead."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype | None = None,
                 quant_config: QuantizationConfig | None = None) -> None:
        super().__init__(vocab_size, hidden_size, dtype, quant_config)
        self.gemm: PackedGemm | None = None
        self.tied: VocabEmbedding | None = None  # an instance attribute: a submodule once set
        self.ops: KernelTable | None = None
        self.int8 = False
        self.scheme: CheckpointScheme | None = getattr(quant_config, "lm_head_scheme", None)
        if self.scheme is not None:
            self.pending: dict[str, torch.Tensor] = {}
            for name, integer in {"weight": False, **self.scheme.tensors}.items():
                param = nn.Parameter(torch.empty(0, dtype=torch.int32 if integer else dtype),
                                     requires_grad=False)
                param.weight_loader = lambda p, loaded, shard_id=None, name=name: (  # type: ignore[attr-defined]
                    self.pending.__setitem__(name, loaded))
                param.optional = True  # type: ignore[attr-defined]
                param.takes_integers = True  # type: ignore[attr-defined]
                setattr(self, name, param)  # (the float weight: filled after loading)

    def tie(self, embedding: VocabEmbedding) -> None:
        if self.scheme is not None:
            raise ValueError("quantization: a quantized lm_head tied to the embedding table "
                             "is not supported")
        self.weight = embedding.weight
        self.tied = embedding

    def _load_quantized(self, ops: KernelTable | None) -> None:
        """The checkpoint's quantized head (or its float weight) into ``quantized`` (or,
        where the kernels do not run, ``weight``): this rank's rows of the vocabulary."""
        assert self.scheme is not None
        tensors, self.pending, dtype = self.pending, {}, self.weight.dtype
        for name in self.scheme.tensors:
            delattr(self, name)
        rows = self.vocab_end - self.vocab_start
        if not self.scheme.is_quantized(tensors):
            if "weight" not in tensors:
                raise ValueError(f"lm_head: neither a weight nor the tensors of "
                                 f"{self.scheme.origin} (it has {sorted(tensors)})")
            self.weight.data = torch.empty(rows, self.hidden_size, dtype=dtype)
            self.weight_loader(self.weight, tensors["weight"])
            return
        try:
            groups = self.scheme.unpack(tensors, self.vocab_size, self.hidden_size)
        except (ValueError, RuntimeError) as e:
            raise ValueError(f"lm_head: {e}") from None
        if groups.shape != (self.vocab_size, self.hidden_size):
            raise ValueError(f"lm_head: checkpoint {groups.shape}, model "
                             f"{(self.vocab_size, self.hidden_size)}")
        groups = groups.narrow(0, self.vocab_start, rows)
        if groups.perm is not None:
            raise ValueError("quantization: a quantized lm_head in act order (desc_act) is "
                             "not supported")
        if groups.kernels_run(ops, dtype):
            self.quantized = groups.to_weight(self.scheme.qtype(groups), self.scheme.origin)
        if self.quantized is None:
            self.weight.data = groups.dequantize().to(dtype)

    def process_weights_after_loading(self, ops: KernelTable | None) -> None:
        """A packed copy for the bfloat16/float16 GEMMs (the weight itself may be shared
        with the embedding table, which needs the plain layout)."""
        if self.scheme is not None:
            self._load_quantized(ops)
        super().process_weights_after_loading(ops)  # an untied head's own blocks
        table = self.tied if self.tied is not None else self
        self.ops = ops
        if self.int8 and table.quantized is None:
            self._quantize_int8(table)
        if table.quantized is not None:
            table.quantized = table.quantized.for_kernels(ops)
            self.quantized = table.quantized
        else:
            self.gemm = create_gemm(self.weight.data, None, ops)
            if self.tied is not None and self.gemm is not None and ops is not None:
                self.tied.read_from(self.gemm, ops)

    def _quantize_int8(self, table: VocabEmbedding) -> None:
        """The float weight as int8 rows (``IntGroups.int8_rows``) into ``table.quantized``,
        read by the quantized kernels; the float weight is freed (a tied embedding table
        dequantizes the rows it looks up)."""
        w = table.weight.data
        weight = IntGroups.int8_rows(w).to_weight("int8 channel", "at load")
        if weight is None:
            raise ValueError(f"--lm-head-quantization int8: the hidden size {w.shape[1]} is "
                             "not a multiple of 16")
        table.quantized = weight
        table.weight.data = torch.empty(0, dtype=w.dtype)

    def describe(self) -> str:
        """Which kernel computes the logits, for the debug log."""
        if self.quantized is not None:
            return self.quantized.describe(self.ops, self.weight.dtype)
        return self.gemm.describe() if self.gemm is not None else "ATen linear"

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [rows, vocab_size]; under tensor parallelism this rank's ``rows`` tokens
        of the vocabulary (zeros past its end), which ``gather_logits`` puts together."""
        # float32 logits (QuantizedWeight.logits says why), from every path
        if self.quantized is not None:
            logits = self.quantized.logits(hidden.reshape(-1, hidden.shape[-1]), self.ops)
        elif self.gemm is not None:
            logits = self.gemm(hidden, torch.float32)
        else:
            logits = F.linear(hidden, self.weight).float()
        if logits.shape[-1] < self.rows:  # the last rank's short slice, to gather evenly
            logits = F.pad(logits, (0, self.rows - logits.shape[-1]))
        return logits

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor | None:
        """The whole vocabulary's logits from every rank's ``compute_logits``, on the first
        tensor-parallel rank of the stage; None on the others."""
        whole = distributed.tp_gather(logits)
        return None if whole is None else whole[..., :self.vocab_size]
