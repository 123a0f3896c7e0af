"""Encoders for pooling: BERT and RoBERTa / XLM-RoBERTa (embeddings), and their
sequence-classification heads (cross-encoders that score pairs).

Parameter names mirror Hugging Face's (``embeddings.*``, ``encoder.layer.N.*``), except
that query, key and value are merged into ``attention.self.qkv``. A batch is flat: the
tokens of all inputs one after another, ``lengths`` saying where each ends, so the linear
layers, norms and activations run over real tokens only. Attention is bidirectional within
each input: the heads of inputs of similar lengths are scattered into an [inputs, longest,
heads, head_dim] block by one index, attended with a key mask of the lengths in one call,
and gathered back (``EncoderBatch``).

RoBERTa counts positions from ``pad_token_id + 1``, as its checkpoints were trained, and
has one token type; BERT's second segment of a pair (after the first [SEP]) is token
type 1, which the runner derives from the ids for classifying and scoring.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from cpullm.model_executor.layers.linear import MergedColumnLinear, ReplicatedLinear
from cpullm.model_executor.layers.ops import KernelTable
from cpullm.model_executor.layers.quantization.base import QuantizationConfig
from cpullm.model_executor.loader.weights import load_named_weights

_ACTIVATIONS = {"gelu": lambda x: F.gelu(x), "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
                "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu}


class _Block:
    """Inputs of similar lengths, attended together in one call: padded to the longest of
    them (nothing to pad where they have one length), keys past each one's end masked."""

    def __init__(self, lengths: torch.Tensor, tokens: torch.Tensor | None) -> None:
        self.tokens = tokens  # their flat token indices in the batch (None: all of them)
        self.count, self.longest = len(lengths), int(lengths.max())
        starts = torch.cumsum(lengths, 0) - lengths
        owner = torch.repeat_interleave(torch.arange(self.count), lengths)
        uniform = bool((lengths == self.longest).all())
        # where each token goes in the padded block, flat
        self.slot = None if uniform else \
            owner * self.longest + torch.arange(len(owner)) - starts[owner]
        # [inputs, 1, 1, longest]: the keys each input's queries see
        self.mask = None if uniform else \
            (torch.arange(self.longest)[None] < lengths[:, None])[:, None, None, :]

    def attend(self, qkv: torch.Tensor) -> torch.Tensor:
        """[tokens, 3, heads, head_dim] of these inputs -> [tokens, heads, head_dim]."""
        shape = (self.count, self.longest, *qkv.shape[1:])
        if self.slot is None:
            padded = qkv.view(shape)
        else:
            padded = qkv.new_zeros(self.count * self.longest, *qkv.shape[1:])
            padded.index_copy_(0, self.slot, qkv)
            padded = padded.view(shape)
        q, k, v = padded.permute(2, 0, 3, 1, 4).unbind(0)  # [inputs, heads, longest, dim]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask).transpose(1, 2)
        flat = out.reshape(self.count * self.longest, *out.shape[2:])
        return flat if self.slot is None else flat.index_select(0, self.slot)


class EncoderBatch:
    """The layout of a flat batch, built once and shared by the layers: each token's place
    in its input, and the blocks the attention runs in. Inputs go to a block by the power
    of two below their length, so that padding never doubles an input's attention: a long
    input among short ones is attended apart from them."""

    def __init__(self, lengths: torch.Tensor) -> None:
        self.lengths = lengths
        starts = torch.cumsum(lengths, 0) - lengths
        self.owner = owner = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
        self.offset = torch.arange(int(lengths.sum())) - starts[owner]
        kind = torch.log2(lengths.double()).floor().long()
        kinds = torch.unique(kind)
        if len(kinds) == 1:
            self.blocks = [_Block(lengths, None)]
        else:
            self.blocks = [_Block(lengths[kind == k], torch.nonzero(kind[owner] == k)[:, 0])
                           for k in kinds]

    def attend(self, qkv: torch.Tensor) -> torch.Tensor:
        """Bidirectional attention within each input: [tokens, 3, heads, head_dim] ->
        [tokens, heads, head_dim]."""
        if len(self.blocks) == 1:
            return self.blocks[0].attend(qkv)
        out = qkv.new_empty(qkv.shape[0], *qkv.shape[2:])
        for block in self.blocks:
            out.index_copy_(0, block.tokens, block.attend(qkv.index_select(0, block.tokens)))
        return out


class BertSelfAttention(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype,
                 quant_config: QuantizationConfig | None) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = hidden // self.num_heads
        self.qkv = MergedColumnLinear(hidden, [hidden] * 3, bias=True, dtype=dtype,
                                      quant_config=quant_config)

    def forward(self, hidden: torch.Tensor, batch: EncoderBatch) -> torch.Tensor:
        qkv = self.qkv(hidden).view(-1, 3, self.num_heads, self.head_dim)
        return batch.attend(qkv).reshape(-1, self.num_heads * self.head_dim)


class BertDenseNorm(nn.Module):
    """dense, then LayerNorm over the output plus the block's input (BERT's "output")."""

    def __init__(self, input_size: int, config: Any, dtype: torch.dtype,
                 quant_config: QuantizationConfig | None) -> None:
        super().__init__()
        self.dense = ReplicatedLinear(input_size, config.hidden_size, bias=True, dtype=dtype,
                                      quant_config=quant_config)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps,
                                      dtype=dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class BertAttention(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype,
                 quant_config: QuantizationConfig | None) -> None:
        super().__init__()
        self.self = BertSelfAttention(config, dtype, quant_config)
        self.output = BertDenseNorm(config.hidden_size, config, dtype, quant_config)

    def forward(self, hidden: torch.Tensor, batch: EncoderBatch) -> torch.Tensor:
        return self.output(self.self(hidden, batch), hidden)


class BertIntermediate(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype,
                 quant_config: QuantizationConfig | None) -> None:
        super().__init__()
        if config.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"hidden activation {config.hidden_act!r} is not supported "
                             f"({', '.join(_ACTIVATIONS)})")
        self.act = _ACTIVATIONS[config.hidden_act]
        self.dense = ReplicatedLinear(config.hidden_size, config.intermediate_size, bias=True,
                                      dtype=dtype, quant_config=quant_config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(x))


class BertLayer(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype,
                 quant_config: QuantizationConfig | None) -> None:
        super().__init__()
        self.attention = BertAttention(config, dtype, quant_config)
        self.intermediate = BertIntermediate(config, dtype, quant_config)
        self.output = BertDenseNorm(config.intermediate_size, config, dtype, quant_config)

    def forward(self, hidden: torch.Tensor, batch: EncoderBatch) -> torch.Tensor:
        hidden = self.attention(hidden, batch)
        return self.output(self.intermediate(hidden), hidden)


class BertEncoder(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype,
                 quant_config: QuantizationConfig | None) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config, dtype, quant_config)
                                   for _ in range(config.num_hidden_layers))


class BertEmbeddings(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype, position_offset: int) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.position_offset = position_offset
        self.word_embeddings = nn.Embedding(config.vocab_size, hidden, dtype=dtype)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, hidden,
                                                dtype=dtype)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, hidden, dtype=dtype)
        self.LayerNorm = nn.LayerNorm(hidden, eps=config.layer_norm_eps, dtype=dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                token_type_ids: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.word_embeddings(input_ids)
                              + self.position_embeddings(positions + self.position_offset)
                              + self.token_type_embeddings(token_type_ids))


class BertModel(nn.Module):
    """The encoder: flat token ids, positions within each input and token types ->
    final hidden states [tokens, hidden]. Its ``pooler`` (BERT's dense + tanh over the
    [CLS] token) is kept where a classification head needs it."""

    is_encoder = True
    stacked_params = {"query": ("qkv", 0), "key": ("qkv", 1), "value": ("qkv", 2)}
    prefix = "bert."  # the checkpoint's prefix of a model with a head

    def __init__(self, config: Any, max_position: int, dtype: torch.dtype,
                 ops: KernelTable | None = None,
                 quant_config: QuantizationConfig | None = None,
                 add_pooler: bool = False) -> None:
        super().__init__()
        self.config = config
        self.embeddings = BertEmbeddings(config, dtype, self.position_offset(config))
        self.encoder = BertEncoder(config, dtype, quant_config)
        self.pooler = BertPooler(config, dtype) if add_pooler else None

    @staticmethod
    def position_offset(config: Any) -> int:
        return 0

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                token_type_ids: torch.Tensor, batch: EncoderBatch) -> torch.Tensor:
        hidden = self.embeddings(input_ids, positions, token_type_ids)
        for layer in self.encoder.layer:
            hidden = layer(hidden, batch)
        return hidden

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        def own(named: Iterable[tuple[str, torch.Tensor]]):
            for name, tensor in named:
                name = name.removeprefix(self.prefix)
                if name.startswith("pooler.") and self.pooler is None:
                    continue  # the checkpoint's pooler, unused by embeddings
                if name.endswith("position_ids"):
                    continue  # a buffer of the positions, which the runner gives
                yield name, tensor

        load_named_weights(self, own(weights), self.stacked_params, set())


class BertPooler(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size, dtype=dtype)

    def forward(self, cls_hidden: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(cls_hidden))


class RobertaModel(BertModel):
    prefix = "roberta."

    @staticmethod
    def position_offset(config: Any) -> int:
        return config.pad_token_id + 1


class BertForSequenceClassification(nn.Module):
    """The encoder, its pooler over [CLS] and a linear classifier: [inputs, num_labels]
    logits from the [CLS] hidden states."""

    is_encoder = True
    encoder_class: type[BertModel] = BertModel

    @classmethod
    def position_offset(cls, config: Any) -> int:
        return cls.encoder_class.position_offset(config)

    def __init__(self, config: Any, max_position: int, dtype: torch.dtype,
                 ops: KernelTable | None = None,
                 quant_config: QuantizationConfig | None = None) -> None:
        super().__init__()
        self.config = config
        self.num_labels = config.num_labels
        self.make_parts(config, max_position, dtype, ops, quant_config)

    def make_parts(self, config: Any, max_position: int, dtype: torch.dtype,
                   ops: KernelTable | None, quant_config: QuantizationConfig | None) -> None:
        self.bert = BertModel(config, max_position, dtype, ops, quant_config, add_pooler=True)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels, dtype=dtype)

    @property
    def encoder_model(self) -> BertModel:
        return self.bert

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                token_type_ids: torch.Tensor, batch: EncoderBatch) -> torch.Tensor:
        return self.encoder_model(input_ids, positions, token_type_ids, batch)

    def classify(self, cls_hidden: torch.Tensor) -> torch.Tensor:
        assert self.bert.pooler is not None
        return self.classifier(self.bert.pooler(cls_hidden))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        encoder, head = self.encoder_model, []
        prefix = encoder.prefix

        def encoder_weights():
            for name, tensor in weights:
                if name.startswith(prefix):
                    yield name, tensor
                else:
                    head.append((name, tensor))

        encoder.load_weights(encoder_weights())
        params = dict(self.named_parameters())
        missing = {n for n in params if not n.startswith(prefix)}
        for name, tensor in head:
            if name not in params:
                raise ValueError(f"checkpoint tensor {name} has no matching parameter in "
                                 f"{type(self).__name__}")
            params[name].data.copy_(tensor)
            missing.discard(name)
        if missing:
            raise ValueError(f"checkpoint lacks weights for: {', '.join(sorted(missing))}")


class RobertaClassificationHead(nn.Module):
    """RoBERTa's head: dense + tanh over [CLS], then the projection to the labels."""

    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size, dtype=dtype)
        self.out_proj = nn.Linear(config.hidden_size, config.num_labels, dtype=dtype)

    def forward(self, cls_hidden: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.tanh(self.dense(cls_hidden)))


class RobertaForSequenceClassification(BertForSequenceClassification):
    encoder_class = RobertaModel

    def make_parts(self, config: Any, max_position: int, dtype: torch.dtype,
                   ops: KernelTable | None, quant_config: QuantizationConfig | None) -> None:
        self.roberta = RobertaModel(config, max_position, dtype, ops, quant_config)
        self.classifier = RobertaClassificationHead(config, dtype)

    @property
    def encoder_model(self) -> BertModel:
        return self.roberta

    def classify(self, cls_hidden: torch.Tensor) -> torch.Tensor:
        return self.classifier(cls_hidden)
