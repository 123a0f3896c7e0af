"""Pooling models: embeddings of the real all-MiniLM-L6-v2 against sentence-transformers,
tiny random encoders and cross-encoders of each architecture against transformers, and
the engine's batching of whole inputs with no KV cache."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from cpullm import LLM
from cpullm.pooling_params import PoolingParams
from cpullm.transformers_utils import default_embedding_model_path

TEXTS = ["A man is eating food.", "hi",
         "The weather is lovely today, and the sun is out over the hills near the sea.",
         "Embeddings map text to vectors; " * 12, "Ein Satz auf Deutsch, mit Umlauten: äöü.",
         "12 + 30 = 42"]
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=160)


def cosines(got: list[list[float]], want: torch.Tensor) -> torch.Tensor:
    return F.cosine_similarity(torch.tensor(got), want.float(), dim=1)


@pytest.fixture(scope="module")
def reference():
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(default_embedding_model_path(), device="cpu")
    return model.encode(TEXTS, convert_to_tensor=True, batch_size=2)


@pytest.mark.parametrize("dtype,bound", [("float32", 0.99999), ("bfloat16", 0.999)])
def test_minilm_equals_sentence_transformers(reference, dtype, bound):
    """The default embedding model, texts of mixed lengths sent together and one by one."""
    llm = LLM(task="embed", dtype=dtype)
    together = [o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)]
    alone = [llm.embed(text, use_tqdm=False)[0].outputs.embedding for text in TEXTS]
    for got in (together, alone):
        assert min(cosines(got, reference)) > bound
        assert all(abs(torch.tensor(v).norm() - 1) < 1e-3 for v in got)  # its Normalize
    model = llm.llm_engine.config.model
    assert model.max_model_len == 256  # sentence_bert_config.json
    assert model.served_model_name == "sentence-transformers/all-MiniLM-L6-v2"


@pytest.fixture(scope="module")
def bert_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("bert-tokenizer")
    AutoTokenizer.from_pretrained(default_embedding_model_path()).save_pretrained(path)
    return path


def make_encoder(path: Path, tokenizer_dir: Path, arch: str, **extra) -> Path:
    """A tiny random encoder (or cross-encoder) of ``arch``, saved with its tokenizer."""
    import transformers
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    family = "XLMRoberta" if arch.startswith("XLMRoberta") else \
        "Roberta" if arch.startswith("Roberta") else "Bert"
    config = getattr(transformers, f"{family}Config")(
        vocab_size=len(tokenizer), **TINY, **({"pad_token_id": 1, "type_vocab_size": 1}
                                              if family != "Bert" else {}), **extra)
    torch.manual_seed(0)
    model = getattr(transformers, arch)(config).eval()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def transformers_pooled(path: Path, arch: str, texts: list[str], pooling: str) -> torch.Tensor:
    """The reference: transformers' hidden states, pooled as the test asks."""
    import transformers
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = getattr(transformers, arch).from_pretrained(path, dtype=torch.float32).eval()
    rows = []
    for text in texts:
        batch = tokenizer(text, return_tensors="pt")
        with torch.no_grad():
            hidden = model(**batch).last_hidden_state[0]
        rows.append({"MEAN": hidden.mean(0), "CLS": hidden[0], "LAST": hidden[-1]}[pooling])
    return torch.stack(rows)


@pytest.mark.parametrize("arch", ["BertModel", "RobertaModel", "XLMRobertaModel"])
@pytest.mark.parametrize("pooling,normalize", [("MEAN", True), ("CLS", False),
                                               ("LAST", True)])
def test_tiny_encoders_equal_transformers(tmp_path, bert_tokenizer, arch, pooling, normalize):
    path = make_encoder(tmp_path / arch, bert_tokenizer, arch)
    llm = LLM(str(path), dtype="float32", override_pooler_config=json.dumps(
        {"pooling_type": pooling, "normalize": normalize}))
    got = torch.tensor([o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)])
    want = transformers_pooled(path, arch, TEXTS, pooling)
    if normalize:
        want = F.normalize(want, dim=1)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_sentence_transformers_files_set_the_pooler(tmp_path, bert_tokenizer):
    """modules.json and 1_Pooling/config.json: the pooling sentence-transformers runs
    (here mean, no Normalize module: vectors as they are)."""
    path = make_encoder(tmp_path / "st", bert_tokenizer, "BertModel")
    (path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"}]))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, "pooling_mode_mean_tokens": True}))
    llm = LLM(str(path), dtype="float32")
    assert llm.llm_engine.config.model.pooler_config.pooling_type == "MEAN"
    got = torch.tensor([o.outputs.embedding for o in llm.embed(TEXTS[:3], use_tqdm=False)])
    torch.testing.assert_close(got, transformers_pooled(path, "BertModel", TEXTS[:3], "MEAN"),
                               atol=2e-5, rtol=1e-4)


def save_sentence_transformer(path: Path, encoder: Path, mode: str, normalize: bool) -> Path:
    """A sentence-transformers folder over ``encoder``, saved by the installed release (so
    that its next change of format shows here)."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.models import Normalize, Pooling, Transformer

    transformer = Transformer(str(encoder))
    modules = [transformer, Pooling(transformer.get_embedding_dimension(), pooling_mode=mode)]
    SentenceTransformer(modules=modules + [Normalize()] * normalize, device="cpu").save(
        str(path))
    return path


@pytest.mark.parametrize("mode,normalize", [("cls", True), ("mean", False),
                                            ("lasttoken", True)])
def test_folders_saved_by_sentence_transformers_embed_as_it_does(tmp_path, bert_tokenizer,
                                                                 mode, normalize):
    """A folder as ``SentenceTransformer.save`` writes it today (``pooling_mode`` as a name,
    the modules' new type names): its pooling and Normalize, and sentence-transformers'
    own vectors."""
    from sentence_transformers import SentenceTransformer

    encoder = make_encoder(tmp_path / "bert", bert_tokenizer, "BertModel")
    path = save_sentence_transformer(tmp_path / "st", encoder, mode, normalize)
    llm = LLM(str(path), dtype="float32")
    pooler = llm.llm_engine.config.model.pooler_config
    assert (pooler.pooling_type, pooler.normalize) == (
        {"cls": "CLS", "mean": "MEAN", "lasttoken": "LAST"}[mode], normalize)
    got = torch.tensor([o.outputs.embedding for o in llm.embed(TEXTS[:3], use_tqdm=False)])
    want = SentenceTransformer(str(path), device="cpu").encode(TEXTS[:3], convert_to_tensor=True)
    torch.testing.assert_close(got, want.float(), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("mode", ["max", "weightedmean", "mean_sqrt_len_tokens",
                                  ["cls", "mean"]])
def test_other_sentence_transformers_poolings_are_refused_by_name(tmp_path, bert_tokenizer,
                                                                   mode):
    encoder = make_encoder(tmp_path / "bert", bert_tokenizer, "BertModel")
    path = save_sentence_transformer(tmp_path / "st", encoder, mode, False)
    asked = mode if isinstance(mode, str) else " + ".join(mode)
    with pytest.raises(ValueError, match=re.escape(f"sentence-transformers pooling '{asked}' "
                                                   "is not supported")):
        LLM(str(path), dtype="float32")


PAIRS = [("What is the capital of France?", "Paris is the capital of France."),
         ("What is the capital of France?", "Bananas are yellow."),
         ("how to bake bread", "Mix flour, water, salt and yeast; knead; let it rise; bake.")]


@pytest.mark.parametrize("arch", ["BertForSequenceClassification",
                                  "XLMRobertaForSequenceClassification"])
@pytest.mark.parametrize("num_labels", [1, 3])
def test_tiny_cross_encoders_equal_transformers(tmp_path, bert_tokenizer, arch, num_labels):
    """Pairs read together (BERT's second segment as token type 1): one label is a score
    (sigmoid), several are class probabilities (softmax)."""
    import transformers
    from transformers import AutoTokenizer

    path = make_encoder(tmp_path / arch, bert_tokenizer, arch, num_labels=num_labels)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = getattr(transformers, arch).from_pretrained(path, dtype=torch.float32).eval()
    batches = [tokenizer(a, b, return_tensors="pt") for a, b in PAIRS]
    if not arch.startswith("Bert"):  # one token type (the test borrows BERT's tokenizer)
        for batch in batches:
            batch.pop("token_type_ids")
    with torch.no_grad():
        logits = torch.cat([model(**batch).logits for batch in batches])
    llm = LLM(str(path), dtype="float32", task="score")
    if num_labels == 1:
        scores = llm.score(PAIRS[0][0], [b for _, b in PAIRS[:2]], use_tqdm=False)
        scores += llm.score([PAIRS[2][0]], [PAIRS[2][1]], use_tqdm=False)
        torch.testing.assert_close(torch.tensor([s.outputs.score for s in scores]),
                                   torch.sigmoid(logits[:, 0]), atol=1e-5, rtol=1e-4)
    else:
        pairs = [{"prompt_token_ids": tokenizer(a, b)["input_ids"]} for a, b in PAIRS]
        probs = torch.tensor([o.outputs.probs for o in llm.classify(pairs, use_tqdm=False)])
        torch.testing.assert_close(probs, torch.softmax(logits, 1), atol=1e-5, rtol=1e-4)


@pytest.fixture(scope="module")
def minilm():
    return LLM(task="embed", dtype="float32")


def test_inputs_arriving_together_share_one_step(minilm):
    """Forty inputs in one step (the token budget holds them): whole inputs, no KV."""
    engine = minilm.llm_engine
    assert engine.config.cache.num_blocks == 0
    for i in range(40):
        engine.add_request(f"r{i}", f"sentence number {i} of the batch", PoolingParams())
    outputs = engine.step()
    assert len(outputs) == 40 and not engine.has_unfinished_requests()
    assert engine.last_step_num_tokens == sum(len(o.prompt_token_ids) for o in outputs)


def test_embedding_models_score_by_cosine(minilm, reference):
    scores = minilm.score(TEXTS[0], TEXTS[1:3], use_tqdm=False)
    want = F.cosine_similarity(reference[0:1], reference[1:3])
    torch.testing.assert_close(torch.tensor([s.outputs.score for s in scores]), want.float(),
                               atol=1e-4, rtol=1e-4)


def test_truncation_and_limits(minilm):
    long = "word " * 400
    with pytest.raises(ValueError, match="maximum model length is 256"):
        minilm.embed(long, use_tqdm=False)
    cut = minilm.embed(long, truncate_prompt_tokens=100, use_tqdm=False)[0]
    ids = minilm.get_tokenizer().encode(long)[-100:]
    assert cut.prompt_token_ids == ids
    assert cut.outputs.embedding == minilm.embed({"prompt_token_ids": ids},
                                                 use_tqdm=False)[0].outputs.embedding
    with pytest.raises(ValueError, match="Matryoshka"):
        minilm.embed("hi", PoolingParams(dimensions=32), use_tqdm=False)
    with pytest.raises(ValueError, match="it does not classify"):
        minilm.classify("hi", use_tqdm=False)
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        PoolingParams(truncate_prompt_tokens=0)


def test_tasks_that_do_not_fit_the_model_are_refused(tiny_model):
    with pytest.raises(ValueError, match="does not classify"):
        LLM(str(tiny_model("llama")), task="score")
    with pytest.raises(ValueError, match="is a pooling model"):
        LLM(default_embedding_model_path(), task="generate")
    llm = LLM(str(tiny_model("llama")), dtype="float32", max_model_len=64)
    with pytest.raises(ValueError, match="generates text"):
        llm.embed("hi", use_tqdm=False)


# ---- through the server -----------------------------------------------------------------

@pytest.fixture(scope="module")
def embed_server():
    from server_utils import RemoteServer

    server = RemoteServer(["--task", "embed", "--dtype", "float32",
                           "--served-model-name", "minilm"])
    yield server
    server.stop()


def test_openai_client_embeddings(embed_server, reference):
    import base64

    import httpx
    import openai

    client = openai.OpenAI(base_url=f"{embed_server.url}/v1", api_key="unused")
    response = client.embeddings.create(model="minilm", input=TEXTS, encoding_format="float")
    assert [d.index for d in response.data] == list(range(len(TEXTS)))
    assert min(cosines([d.embedding for d in response.data], reference)) > 0.99999
    tokenized = [httpx.post(f"{embed_server.url}/tokenize", timeout=30,
                            json={"prompt": t}).json()["tokens"] for t in TEXTS]
    assert response.usage.prompt_tokens == sum(map(len, tokenized))
    tokenizer_ids = tokenized[:2]
    by_ids = client.embeddings.create(model="minilm", input=tokenizer_ids,
                                      encoding_format="float")
    assert min(cosines([d.embedding for d in by_ids.data], reference[:2])) > 0.99999
    one = client.embeddings.create(model="minilm", input=tokenizer_ids[0],
                                   encoding_format="float")
    assert len(one.data) == 1
    # the client's default: it asks for base64 and decodes it
    decoded_by_client = client.embeddings.create(model="minilm", input=TEXTS[:2])
    torch.testing.assert_close(torch.tensor([d.embedding for d in decoded_by_client.data]),
                               torch.tensor([d.embedding for d in response.data[:2]]))
    raw = httpx.post(f"{embed_server.url}/v1/embeddings", timeout=30, json={
        "input": TEXTS[:2], "encoding_format": "base64"}).json()
    decoded = [torch.frombuffer(bytearray(base64.b64decode(d["embedding"])),
                                dtype=torch.float32) for d in raw["data"]]
    torch.testing.assert_close(torch.stack(decoded),
                               torch.tensor([d.embedding for d in response.data[:2]]))


def test_score_and_rerank_with_an_embedding_model(embed_server, reference):
    import httpx

    query, documents = TEXTS[0], TEXTS[1:]
    want = F.cosine_similarity(reference[0:1], reference[1:]).tolist()
    scored = httpx.post(f"{embed_server.url}/score", timeout=30, json={
        "text_1": query, "text_2": documents}).json()
    assert [d["index"] for d in scored["data"]] == list(range(len(documents)))
    torch.testing.assert_close(torch.tensor([d["score"] for d in scored["data"]]),
                               torch.tensor(want), atol=1e-4, rtol=1e-4)
    ranked = httpx.post(f"{embed_server.url}/v1/rerank", timeout=30, json={
        "query": query, "documents": documents, "top_n": 3}).json()
    order = sorted(range(len(documents)), key=lambda i: -want[i])[:3]
    assert [r["index"] for r in ranked["results"]] == order
    assert [r["document"]["text"] for r in ranked["results"]] == [documents[i] for i in order]


@pytest.mark.parametrize("body,message", [
    ({"input": []}, "input"),
    ({"input": ""}, "input"),
    ({"input": 5}, "input"),
    ({"input": [[1, 2], []]}, "input"),
    ({"input": ["a"] * 2049}, "input"),
    ({"input": "word " * 400}, "maximum model length is 256"),
    ({"input": "hi", "dimensions": 32}, "Matryoshka"),
    ({"input": "hi", "encoding_format": "hex"}, "encoding_format"),
    ({"input": [999999]}, "Token ids must be in"),
    ({"input": "hi", "model": "other"}, "does not exist"),
])
def test_bad_embedding_requests_get_a_400(embed_server, body, message):
    import httpx

    response = httpx.post(f"{embed_server.url}/v1/embeddings", timeout=30, json=body)
    assert response.status_code in (400, 404), response.text
    error = response.json()["error"]
    assert message in error["message"] and error["code"] == response.status_code


def test_long_inputs_truncated_and_generation_refused(embed_server):
    import httpx

    response = httpx.post(f"{embed_server.url}/v1/embeddings", timeout=30, json={
        "input": "word " * 400, "truncate_prompt_tokens": 50})
    assert response.status_code == 200 and response.json()["usage"]["prompt_tokens"] == 50
    for route, body in (("/v1/completions", {"prompt": "hi"}),
                        ("/v1/chat/completions", {"messages": [{"role": "user",
                                                                "content": "hi"}]})):
        response = httpx.post(f"{embed_server.url}{route}", timeout=30, json=body)
        assert response.status_code == 400 and "pooling model" in response.text
    assert httpx.get(f"{embed_server.url}/health", timeout=10).status_code == 200


def test_cross_encoder_server_and_a_generative_one(tmp_path, bert_tokenizer, tiny_model):
    """/rerank on a cross-encoder orders by transformers' scores; /v1/embeddings on a
    generative server is a 400."""
    import httpx
    from server_utils import RemoteServer
    from transformers import AutoTokenizer, BertForSequenceClassification

    path = make_encoder(tmp_path / "ce", bert_tokenizer, "BertForSequenceClassification",
                        num_labels=1)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = BertForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    query, documents = PAIRS[0][0], [b for _, b in PAIRS] + ["Lyon is in France."]
    with torch.no_grad():
        want = [float(torch.sigmoid(model(**tokenizer(query, d, return_tensors="pt")).logits[0, 0]))
                for d in documents]
    server = RemoteServer([str(path), "--dtype", "float32"])
    try:
        ranked = httpx.post(f"{server.url}/rerank", timeout=30, json={
            "query": query, "documents": documents, "return_documents": False}).json()
        assert [r["index"] for r in ranked["results"]] == sorted(
            range(len(documents)), key=lambda i: -want[i])
        torch.testing.assert_close(torch.tensor([r["relevance_score"] for r in ranked["results"]]),
                                   torch.tensor(sorted(want, reverse=True)), atol=1e-5, rtol=1e-4)
        response = httpx.post(f"{server.url}/v1/embeddings", timeout=30, json={"input": "hi"})
        assert response.status_code == 400 and "cross-encoder" in response.text
    finally:
        server.stop()
    server = RemoteServer([str(tiny_model("llama")), "--dtype", "float32", "--max-model-len",
                           "128"])
    try:
        response = httpx.post(f"{server.url}/v1/embeddings", timeout=30, json={"input": "hi"})
        assert response.status_code == 400 and "generates text" in response.text
    finally:
        server.stop()


@pytest.mark.parametrize("pooling", ["LAST", "MEAN", "CLS"])
def test_decoder_as_embedder_equals_transformers(tiny_model, pooling):
    """A Llama-layout model with --task embed: its final hidden states pooled (by the last
    token unless told otherwise, as Qwen3-Embedding runs), with prompts in chunks over the
    KV cache (a budget of 32 tokens) and batched with each other."""
    from transformers import AutoModel

    path = tiny_model("llama")
    texts = [t for t in TEXTS if t != "hi"][:4]
    llm = LLM(str(path), dtype="float32", task="embed", max_num_batched_tokens=32,
              max_model_len=256, override_pooler_config=json.dumps({"pooling_type": pooling}))
    assert llm.llm_engine.config.model.pooler_config.pooling_type == pooling
    got = torch.tensor([o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)])
    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    rows = []
    for text in texts:
        ids = torch.tensor([llm.get_tokenizer().encode(text)])
        with torch.no_grad():
            hidden = model(input_ids=ids).last_hidden_state[0]
        rows.append({"MEAN": hidden.mean(0), "CLS": hidden[0], "LAST": hidden[-1]}[pooling])
    torch.testing.assert_close(got, F.normalize(torch.stack(rows), dim=1), atol=1e-5,
                               rtol=1e-4)
