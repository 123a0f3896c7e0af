"""The pooling routes: /v1/embeddings (OpenAI's), /score and /rerank (vLLM's, Jina's and
Cohere's shapes), on a pooling model (``--task embed`` or ``score``).

Every input of a request is an engine request of its own, all sent at once, so that they
share the engine's steps with each other and with other clients' inputs. An embedding
model scores a pair by the cosine similarity of the two embeddings; a cross-encoder reads
the pair together, as its tokenizer joins them.
"""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import numpy as np
import torch

from cpullm.entrypoints.openai.protocol import (
    EmbeddingRequest,
    RerankRequest,
    ScoreRequest,
    now,
    random_id,
)
from cpullm.entrypoints.openai.serving_engine import OpenAIError, ServingBase
from cpullm.outputs import PoolingRequestOutput
from cpullm.pooling_params import PoolingParams


class ServingPooling(ServingBase):
    route = "/v1/embeddings"

    @property
    def task(self) -> str:
        return self.engine.config.model.task

    def check_task(self, asked: str) -> None:
        """Refuse a route this model does not serve (a generative model's embeddings, an
        embedding model's classes)."""
        if self.task == "generate":
            raise OpenAIError(f"The model `{self.served_model_name}` generates text; it does "
                              f"not serve {asked} (serve a pooling model: --task embed or "
                              "score).", 400, "model")
        if asked == "embeddings" and self.task != "embed":
            raise OpenAIError(f"The model `{self.served_model_name}` is a cross-encoder "
                              "(--task score): use /score or /rerank.", 400, "model")

    def _prompt_ids(self, value: str | list[int], add_special_tokens: bool = True,
                    truncating: bool = False) -> list[int]:
        if isinstance(value, str):
            return self.encode(value, add_special_tokens, limit=not truncating)
        if max(value) >= self.vocab_size:
            raise OpenAIError(f"Token ids must be in [0, {self.vocab_size}).", 400, "input")
        return value

    def _pair_ids(self, first: str, second: str, truncating: bool) -> list[int]:
        """A cross-encoder's input: the two texts joined as its tokenizer joins pairs."""
        for text in (first, second):
            self.encode(text, limit=not truncating)  # (the checks: valid text, not too long)
        return self.engine.tokenizer.backend_tokenizer.encode(first, second).ids

    async def _pool(self, request_id: str, inputs: list[list[int]],
                    params: PoolingParams) -> list[PoolingRequestOutput]:
        """The pooled outputs of all ``inputs``, sent to the engine at once."""
        async def one(index: int, token_ids: list[int]) -> PoolingRequestOutput:
            result = None
            async for output in self.generate(f"{request_id}-{index}", token_ids, params):
                result = output
            assert isinstance(result, PoolingRequestOutput)
            return result

        tasks = [asyncio.ensure_future(one(i, ids)) for i, ids in enumerate(inputs)]
        try:
            return list(await asyncio.gather(*tasks))
        finally:  # one failed (or the client left): the others are cancelled, and aborted
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def embeddings(self, request: EmbeddingRequest) -> dict[str, Any]:
        self.check_model(request.model)
        self.check_capacity()
        self.check_task("embeddings")
        values = request.input
        if isinstance(values, str) or (values and isinstance(values[0], int)):
            values = [values]  # type: ignore[list-item]
        truncating = request.truncate_prompt_tokens is not None
        inputs = [self._prompt_ids(v, request.add_special_tokens, truncating)  # type: ignore
                  for v in values]
        try:
            params = PoolingParams(task="embed", dimensions=request.dimensions,
                                   normalize=request.normalize,
                                   truncate_prompt_tokens=request.truncate_prompt_tokens)
        except ValueError as e:
            raise OpenAIError.from_value_error(e) from None
        request_id = random_id("embd")
        outputs = await self._pool(request_id, inputs, params)
        data = [{"object": "embedding", "index": i,
                 "embedding": _encode(o.outputs.data, request.encoding_format)}
                for i, o in enumerate(outputs)]
        tokens = sum(len(o.prompt_token_ids) for o in outputs)
        return {"id": request_id, "object": "list", "created": now(),
                "model": self.served_model_name, "data": data,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    async def _scores(self, request_id: str, firsts: list[str], seconds: list[str],
                      truncate: int | None) -> tuple[list[float], int]:
        """Each pair's relevance, and the tokens read."""
        truncating = truncate is not None
        try:
            if self.task == "embed":
                params = PoolingParams(task="embed", truncate_prompt_tokens=truncate)
                texts = list(dict.fromkeys(firsts + seconds))  # each text embedded once
                outputs = await self._pool(request_id, [self._prompt_ids(t, True, truncating)
                                                        for t in texts], params)
                vectors = dict(zip(texts, (o.outputs.data for o in outputs), strict=True))
                scores = [float(torch.nn.functional.cosine_similarity(
                    vectors[a], vectors[b], dim=0)) for a, b in zip(firsts, seconds, strict=True)]
            else:
                params = PoolingParams(task="score", truncate_prompt_tokens=truncate)
                outputs = await self._pool(request_id, [
                    self._pair_ids(a, b, truncating) for a, b in zip(firsts, seconds,
                                                                     strict=True)], params)
                scores = [float(o.outputs.data[0]) for o in outputs]
        except ValueError as e:
            raise OpenAIError.from_value_error(e) from None
        return scores, sum(len(o.prompt_token_ids) for o in outputs)

    async def score(self, request: ScoreRequest) -> dict[str, Any]:
        self.check_model(request.model)
        self.check_capacity()
        self.check_task("scores")
        firsts = [request.text_1] if isinstance(request.text_1, str) else request.text_1
        seconds = [request.text_2] if isinstance(request.text_2, str) else request.text_2
        if len(firsts) == 1:
            firsts = firsts * len(seconds)
        if len(firsts) != len(seconds):
            raise OpenAIError(f"text_1 has {len(firsts)} texts and text_2 {len(seconds)}: give "
                              "one text_1, or as many as text_2.", 400, "text_1")
        request_id = random_id("score")
        scores, tokens = await self._scores(request_id, firsts, seconds,
                                            request.truncate_prompt_tokens)
        return {"id": request_id, "object": "list", "created": now(),
                "model": self.served_model_name,
                "data": [{"index": i, "object": "score", "score": s}
                         for i, s in enumerate(scores)],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    async def rerank(self, request: RerankRequest) -> dict[str, Any]:
        self.check_model(request.model)
        self.check_capacity()
        self.check_task("reranking")
        request_id = random_id("rerank")
        documents = request.documents
        scores, tokens = await self._scores(request_id, [request.query] * len(documents),
                                            documents, request.truncate_prompt_tokens)
        order = sorted(range(len(documents)), key=lambda i: -scores[i])[:request.top_n]
        results = [{"index": i, "relevance_score": scores[i],
                    **({"document": {"text": documents[i]}} if request.return_documents
                       else {})} for i in order]
        return {"id": request_id, "model": self.served_model_name, "results": results,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def _encode(vector: torch.Tensor, encoding_format: str) -> list[float] | str:
    """An embedding as OpenAI sends it: floats, or the base64 of its little-endian
    float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
    return vector.tolist()
