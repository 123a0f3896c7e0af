"""PoolingRunner: the model runner of an encoder (a pooling model), over whole inputs.

An encoder attends in both directions within each input, so an input is computed in one
step, whole, and leaves nothing behind: no KV cache, no sampler. Each step's inputs run as
one flat batch (cpullm/model_executor/models/bert.py); the runner pools each input's hidden
states as its request asks (an embedding by the model's pooler, or a classifier's
probabilities of its [CLS] state) and returns them in ``ModelRunnerOutput.pooled``.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from cpullm.config import EngineConfig
from cpullm.engine.sched_output import ModelRunnerOutput, SchedulerOutput
from cpullm.logger import init_logger
from cpullm.model_executor.layers.ops import load_ops
from cpullm.model_executor.layers.pooler import finish_embeddings, pool
from cpullm.model_executor.loader import get_model
from cpullm.model_executor.models.bert import EncoderBatch
from cpullm.pooling_params import PoolingParams
from cpullm.transformers_utils import load_tokenizer
from cpullm.worker.model_runner import RunnerBase
from cpullm.worker.request_state import RequestState

logger = init_logger(__name__)


class PoolingRunner(RunnerBase):
    def __init__(self, config: EngineConfig, eos_token_ids: set[int]) -> None:
        super().__init__(config)
        model_config = config.model
        ops = None if model_config.enforce_eager else load_ops()
        self.model = get_model(model_config, ops)
        self.pooler = model_config.pooler_config
        # BERT's pairs: the tokens after the first [SEP] are the second segment's
        self.typed_pairs = getattr(model_config.hf_config, "type_vocab_size", 1) > 1
        logger.info("No KV cache: an encoder attends within each input, computed whole in "
                    "one step")

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.bind_threads()
        output = ModelRunnerOutput()
        items = self.requests.update(scheduler_output)
        if not items:
            return output
        assert all(r.num_computed_tokens == 0 and r.sample for r in items)
        lengths = torch.tensor([r.num_tokens for r in items])
        input_ids = torch.from_numpy(np.fromiter(
            (t for r in items for t in r.token_ids), dtype=np.int64, count=int(lengths.sum())))
        batch = EncoderBatch(lengths)
        hidden = self.model(input_ids, batch.offset, self._token_types(items, input_ids, batch),
                            batch)
        params: list[PoolingParams] = [r.sampling_params for r in items]  # type: ignore[misc]
        embed = [i for i, p in enumerate(params) if p.task == "embed"]
        if embed:
            vectors = pool(hidden, lengths, self.pooler.pooling_type)[embed]
            finished = finish_embeddings(
                vectors, [self.pooler.normalize if params[i].normalize is None
                          else params[i].normalize for i in embed],
                [params[i].dimensions for i in embed])
            for i, vector in zip(embed, finished, strict=True):
                output.pooled[items[i].request_id] = vector
        scored = [i for i, p in enumerate(params) if p.task != "embed"]
        if scored:
            logits = self.model.classify(pool(hidden, lengths, "CLS")[scored]).float()
            for i, row in zip(scored, logits, strict=True):
                if params[i].activation is not False:
                    row = torch.sigmoid(row) if len(row) == 1 else torch.softmax(row, 0)
                output.pooled[items[i].request_id] = row
        return output

    @functools.cached_property
    def sep_token_id(self) -> int | None:
        """The tokenizer's [SEP] id (read at the first scored pair)."""
        model = self.config.model
        return load_tokenizer(model.source, model.tokenizer, model.hf_config).sep_token_id

    def _token_types(self, items: list[RequestState], input_ids: torch.Tensor,
                     batch: EncoderBatch) -> torch.Tensor:
        """0 for every token, but 1 after the first [SEP] of an input to classify or score
        (BERT's second segment of a pair; a single text's one [SEP] ends it). An
        embedding's are all 0, as sentence-transformers runs them."""
        types = torch.zeros_like(input_ids)
        pairs = [i for i, r in enumerate(items) if r.sampling_params.task != "embed"]
        if not pairs or not self.typed_pairs or self.sep_token_id is None:
            return types  # (no [SEP] token: one segment)
        is_pair = torch.zeros(len(items), dtype=torch.bool)
        is_pair[pairs] = True
        sep = (input_ids == self.sep_token_id) & is_pair[batch.owner]
        before = torch.cumsum(sep.long(), 0) - sep.long()  # [SEP]s before, in the batch
        starts = torch.cumsum(batch.lengths, 0) - batch.lengths
        before = before - before[starts][batch.owner]  # ... in the token's input
        types[(before > 0) & is_pair[batch.owner]] = 1
        return types
