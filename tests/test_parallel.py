"""Tensor and pipeline parallelism: ranks in worker processes give the greedy float32 tokens
of one rank (transformers' tokens), for every architecture, quantized layers included, with
several steps in flight under pipeline parallelism."""

from __future__ import annotations

import argparse
import os

import pytest
import torch
from conftest import (
    ARCHITECTURES,
    GREEDY_PROMPTS,
    assert_greedy_follows,
    hf_greedy,
    quantized_kernels,
)
from test_gguf_quant import mixed_gguf  # noqa: F401, F811 - the fixture

from cpullm import LLM, SamplingParams
from cpullm.model_executor.layers.quantization.kept import QuantizedWeight

pytestmark = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one core per rank")

NUM_NEW_TOKENS = 16
PROMPT_LENS = [5, 17, 40, 71]
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)


def make_prompts(vocab_size: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(99)
    return [torch.randint(100, vocab_size, (n,), generator=generator).tolist()
            for n in PROMPT_LENS]


def generate(model: str, prompts: list[list[int]], params: SamplingParams = GREEDY,
             **kwargs) -> list:
    llm = LLM(model, dtype=kwargs.pop("dtype", "float32"), block_size=32, **kwargs)
    try:
        return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.llm_engine.shutdown()


def step_to_the_end(engine) -> dict[str, list[int]]:
    """Step ``engine`` until every request and every step in flight is done (an aborted
    request's step too); the token ids of each request that finished."""
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output.outputs[0].token_ids
    while engine.core.has_unfinished_requests():  # the aborted request's step, if still out
        engine.core.step()
    return finished


SIZES = {"tp2": dict(tensor_parallel_size=2), "pp2": dict(pipeline_parallel_size=2)}
# Every family splits its own way over tensor-parallel ranks; over two stages they differ
# only in what sits at a stage's edges and in the kinds of layers a stage holds: plain,
# tied (the head's table on the last stage), scaled embeddings and logits, per-layer
# windows and soft-caps, per-layer rotaries, mixtures with shared experts, sinks.
PIPELINE_ARCHITECTURES = ("llama", "llama3-rope-tied", "granite", "gemma2", "gemma3",
                          "qwen2_moe", "gpt_oss")


@pytest.mark.parametrize("arch, sizes", [(arch, "tp2") for arch in ARCHITECTURES]
                         + [(arch, "pp2") for arch in PIPELINE_ARCHITECTURES])
def test_parallel_matches_transformers(arch, sizes, tiny_model):
    model = tiny_model(arch)
    from transformers import AutoConfig

    prompts = make_prompts(AutoConfig.from_pretrained(model).vocab_size)
    got = generate(str(model), prompts, **SIZES[sizes])
    assert [o.token_ids for o in got] == hf_greedy(model, prompts, NUM_NEW_TOKENS)


# preemption: 6 blocks of 32 tokens (the sequences grow to 9) on each rank, which holds half
# of a token's K and V (one of the 2 KV heads, or one of the 2 layers, of 16 float32 dims)
VARIANTS = {"chunked-prefill-7": dict(max_num_batched_tokens=7),
            "preemption": dict(kv_cache_memory_bytes=6 * 32 * 256, max_model_len=192)}


@pytest.mark.parametrize("sizes", list(SIZES))
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_parallel_with_chunks_and_preemption(variant, sizes, tiny_model):
    model = tiny_model("llama")
    prompts = make_prompts(49152)
    llm = LLM(str(model), dtype="float32", block_size=32, **SIZES[sizes], **VARIANTS[variant])
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert got == hf_greedy(model, prompts, 32)
        if variant == "preemption":
            assert llm.llm_engine.core.scheduler.num_preemptions > 0
    finally:
        llm.llm_engine.shutdown()


def test_tensor_times_pipeline_parallel(tiny_model, monkeypatch):
    """Two stages of two tensor-parallel ranks each."""
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # four ranks on two cores
    model = tiny_model("qwen3")
    prompts = make_prompts(49152)[:3]
    got = generate(str(model), prompts, tensor_parallel_size=2, pipeline_parallel_size=2)
    assert [o.token_ids for o in got] == hf_greedy(model, prompts, NUM_NEW_TOKENS)


def test_default_model_in_two_stages():
    """The default model (a Q4_1 GGUF file, 30 layers, 9 heads: no tensor parallelism) in
    two pipeline stages of 15 layers: float32, the tokens of one stage."""
    prompts = [[1, 2, 3, 4, 5], list(range(200, 260))]
    one = generate(None, prompts, max_model_len=512)
    two = generate(None, prompts, max_model_len=512, pipeline_parallel_size=2)
    assert [o.token_ids for o in two] == [o.token_ids for o in one]


def test_pipeline_keeps_steps_in_flight_and_survives_aborts(tiny_model):
    """With two stages the engine has two steps in flight, of disjoint requests; a request
    aborted while its step is in flight is dropped when the step returns, its blocks
    freed, and the others finish with their tokens."""
    from cpullm.engine.llm_engine import LLMEngine
    from cpullm.engine_args import EngineArgs

    model = tiny_model("llama")
    prompts = make_prompts(49152)
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=str(model), dtype="float32", block_size=32, pipeline_parallel_size=2,
        max_num_batched_tokens=25))  # prompts 0 and 1, then a chunk of 2
    try:
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), {"prompt_token_ids": prompt}, GREEDY)
        core = engine.core
        engine.step()  # two steps submitted (two requests each at most), the first collected
        assert len(core._in_flight) == 1
        second = {r.request_id for r in core._in_flight[0].scheduled}
        assert core.scheduler.in_flight == second == {"2"}
        victim = "2"
        engine.abort_request(victim)
        finished = step_to_the_end(engine)
        kv = core.scheduler.kv_cache_manager
        assert kv.num_free_blocks == kv.pool.num_blocks and not core.scheduler.in_flight
        expected = hf_greedy(model, prompts, NUM_NEW_TOKENS)
        assert set(finished) == {str(i) for i in range(len(prompts))} - {victim}
        for request_id, tokens in finished.items():
            assert tokens == expected[int(request_id)]
    finally:
        engine.shutdown()


def test_fewer_kv_heads_than_ranks(tiny_model, monkeypatch):
    """Four ranks, two KV heads: each KV head is held by two ranks, one query head each."""
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # four ranks on two cores
    model = tiny_model("qwen2")
    prompts = make_prompts(49152)[:2]
    got = generate(str(model), prompts, tensor_parallel_size=4)
    assert [o.token_ids for o in got] == hf_greedy(model, prompts, NUM_NEW_TOKENS)


def test_gptq_layers_split_over_ranks(tmp_path, tokenizer_dir):
    """A GPTQ checkpoint's integer groups split by rows (q/k/v, gate/up) and by whole groups
    of columns (o, down): in float32, dequantized, exactly the reference's tokens; in
    bfloat16, kept quantized, following one rank's tokens."""
    from test_int_groups import write_checkpoint

    quantized, reference = write_checkpoint(tmp_path, tokenizer_dir, "gptq", 4, 64, False,
                                            False)
    expected = hf_greedy(reference, GREEDY_PROMPTS, NUM_NEW_TOKENS)
    got = generate(str(quantized), GREEDY_PROMPTS, tensor_parallel_size=2, max_model_len=256)
    assert [o.token_ids for o in got] == expected
    ops, _ = quantized_kernels()
    if not QuantizedWeight.kernels_run(ops, torch.bfloat16):
        return
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True,
                            logprobs=5)
    one = generate(str(quantized), GREEDY_PROMPTS, params, dtype="bfloat16", max_model_len=256)
    two = generate(str(quantized), GREEDY_PROMPTS, params, dtype="bfloat16", max_model_len=256,
                   tensor_parallel_size=2)
    assert_greedy_follows(one, two)


def test_heads_that_do_not_split_are_refused():
    """The default model has 9 attention heads: not for 2 ranks."""
    with pytest.raises(ValueError, match="9 attention heads do not split over 2 ranks"):
        LLM(None, tensor_parallel_size=2)


# (qwen2's biased q/k/v over ranks: test_fewer_kv_heads_than_ranks, the golden checks)
@pytest.mark.parametrize("mixed_gguf", ["llama"], indirect=True)
def test_gguf_blocks_split_over_ranks(mixed_gguf):  # noqa: F811
    """A file mixing K-quant and legacy blocks: rows split for q/k/v and gate/up, whole
    blocks of columns (256 weights for Q6_K) for o and down, the Q8_0 embedding table by
    vocabulary rows: float32 (dequantized) exactly one rank's tokens, bfloat16 (kept
    quantized) following them."""
    prompts = [[1, 2, 3, 4, 5], [100, 2000, 30000, 7]]
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True,
                            logprobs=5)
    kwargs = dict(max_model_len=256, kv_cache_memory_bytes=1 << 24)
    one = generate(str(mixed_gguf), prompts, params, **kwargs)
    two = generate(str(mixed_gguf), prompts, params, tensor_parallel_size=2, **kwargs)
    assert [o.token_ids for o in two] == [o.token_ids for o in one]
    ops, _ = quantized_kernels()
    if not QuantizedWeight.kernels_run(ops, torch.bfloat16):
        return
    one = generate(str(mixed_gguf), prompts, params, dtype="bfloat16", **kwargs)
    two = generate(str(mixed_gguf), prompts, params, dtype="bfloat16", tensor_parallel_size=2,
                   **kwargs)
    assert_greedy_follows(one, two)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie waiting for its parent is gone too
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_tensor_parallel_server_and_a_dead_rank(tiny_model):
    """TP=2 behind the real server answers the official client with transformers' greedy
    tokens. SIGKILL of one rank: within 10 s /health fails and requests get a 5xx, and
    no rank process is left."""
    import re
    import signal
    import time

    import httpx
    import openai
    from server_utils import RemoteServer

    model = tiny_model("llama")
    prompt = make_prompts(49152)[2]
    server = RemoteServer([str(model), "--dtype", "float32", "--block-size", "32",
                           "--max-model-len", "512", "-tp", "2"])
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
        completion = client.completions.create(model=str(model), prompt=prompt, max_tokens=16,
                                               temperature=0, logprobs=0)
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model)
        expected = hf_greedy(model, [prompt], 16)[0]
        assert completion.choices[0].text == tokenizer.decode(expected)
        pids = {int(rank): int(pid) for rank, pid in
                re.findall(r"(\d+) \(pid (\d+)\)", server.log().split("Started ranks", 1)[1]
                           .splitlines()[0])}
        assert sorted(pids) == [0, 1] and all(_alive(p) for p in pids.values())
        os.kill(pids[1], signal.SIGKILL)
        deadline = time.monotonic() + 10
        while httpx.get(f"{server.url}/health", timeout=5).status_code == 200:
            assert time.monotonic() < deadline, "/health still passes 10 s after the kill"
            time.sleep(0.2)
        health = httpx.get(f"{server.url}/health", timeout=5)
        assert health.status_code >= 500 and "rank 1" in health.text
        response = httpx.post(f"{server.url}/v1/completions", timeout=10,
                              json={"prompt": "hi", "max_tokens": 3})
        assert response.status_code >= 500
        while any(_alive(p) for p in pids.values()):
            assert time.monotonic() < deadline + 5, "a rank process outlived the engine"
            time.sleep(0.2)
    finally:
        server.stop()


def test_two_nodes_on_loopback(tiny_model):
    """Two `cpullm serve` processes started apart, as on two hosts: node 0 serves, node 1
    (--headless) runs rank 1; TP=2 across them gives transformers' greedy tokens. When node
    0 stops, node 1's rank and launcher exit."""
    import subprocess
    import sys

    import openai
    from server_utils import RemoteServer, free_port

    model = tiny_model("llama")
    prompt = make_prompts(49152)[1]
    port = free_port()
    common = [str(model), "--dtype", "float32", "--block-size", "32", "--max-model-len", "512",
              "-tp", "2", "--nnodes", "2", "--master-addr", "127.0.0.1",
              "--master-port", str(port)]
    node1 = subprocess.Popen(
        [sys.executable, "-m", "cpullm.entrypoints.cli", "serve", *common, "--node-rank", "1",
         "--headless"], env={**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "1"},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    server = None
    try:
        server = RemoteServer([*common, "--node-rank", "0"],
                              env={"VLLM_CPU_OMP_THREADS_BIND": "0"})
        assert "Started ranks 0 (pid" in server.log()
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
        completion = client.completions.create(model=str(model), prompt=prompt, max_tokens=16,
                                               temperature=0, logprobs=0)
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model)
        assert completion.choices[0].text == tokenizer.decode(
            hf_greedy(model, [prompt], 16)[0])
        server.stop()
        server = None
        assert node1.wait(30) == 0
    finally:
        if server is not None:
            server.stop()
        if node1.poll() is None:
            node1.kill()
        output = node1.communicate()[0]
        assert "Started ranks 1 (pid" in output, output


def test_default_budgets_scale_with_the_ranks(tiny_model):
    """Unset, the scheduling budgets are the job's per rank times the ranks of a replica
    (as vLLM CPU's); set, they are as given."""
    from cpullm.engine_args import EngineArgs
    from cpullm.entrypoints.openai.cli_args import add_serve_args

    model = str(tiny_model("llama"))

    def budgets(args: EngineArgs) -> tuple[int, int]:
        scheduler = args.create_engine_config().scheduler
        return scheduler.max_num_seqs, scheduler.max_num_batched_tokens

    assert budgets(EngineArgs(model=model)) == (256, 4096)
    assert budgets(EngineArgs(model=model, tensor_parallel_size=2)) == (512, 8192)
    assert budgets(EngineArgs(model=model, pipeline_parallel_size=2, max_num_seqs=7,
                              max_num_batched_tokens=99)) == (7, 99)
    served = add_serve_args(argparse.ArgumentParser()).parse_args(["--model", model, "-tp", "2"])
    assert budgets(EngineArgs.from_cli_args(served)) == (256, 1024)


def _sum_on_rank(rank: int, port: int, queue) -> None:
    import datetime

    import torch.distributed as dist

    from cpullm import distributed

    store = dist.TCPStore("127.0.0.1", port, is_master=rank == 0,
                          timeout=datetime.timedelta(seconds=30))
    distributed.init_distributed(distributed.RankLayout(2, 1, rank), store,
                                 datetime.timedelta(seconds=30), shared_memory=True)
    results = {"shared": distributed._shared is not None}
    for name, numel in (("small", 1000), ("chunked", 5_000_000)):  # 20 MB: 3 slots
        x = torch.arange(numel, dtype=torch.float32) * (rank + 1)
        distributed.tp_all_reduce(x)
        results[name] = bool(torch.equal(x, torch.arange(numel, dtype=torch.float32) * 3))
    gathered = distributed.tp_gather(torch.full((3, 4), float(rank)))
    if rank == 0:
        results["gather"] = gathered.tolist() == [[0.0] * 4 + [1.0] * 4] * 3
        queue.put(results)
    else:
        assert gathered is None
    distributed.shutdown_distributed()


def test_shared_memory_all_reduce_and_gather():
    """The shared-memory sum of two ranks, one slot and several slots' worth, and the
    gather of the logits' slices; the segment is gone from /dev/shm once opened."""
    import multiprocessing

    from server_utils import free_port

    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    port = free_port()
    ranks = [context.Process(target=_sum_on_rank, args=(r, port, queue)) for r in (0, 1)]
    for process in ranks:
        process.start()
    results = queue.get(timeout=60)
    for process in ranks:
        process.join(30)
    assert results == {"shared": True, "small": True, "chunked": True, "gather": True}
    assert not [f for f in os.listdir("/dev/shm") if f.startswith("cpullm-allreduce")]


def test_tensor_parallel_through_gloo(tiny_model, monkeypatch):
    """CPULLM_SHM_ALLREDUCE=0: the same tokens with every sum through gloo."""
    monkeypatch.setenv("CPULLM_SHM_ALLREDUCE", "0")
    model = tiny_model("qwen2")
    prompts = make_prompts(49152)[:2]
    got = generate(str(model), prompts, tensor_parallel_size=2)
    assert [o.token_ids for o in got] == hf_greedy(model, prompts, NUM_NEW_TOKENS)


def test_data_parallel_replicas_of_tensor_parallel_ranks(tiny_model):
    """-dp 2 -tp 2: two engine cores of two ranks each behind one server; concurrent
    requests reach both replicas and get transformers' greedy tokens."""
    from concurrent.futures import ThreadPoolExecutor

    import openai
    from server_utils import RemoteServer
    from transformers import AutoTokenizer

    model = tiny_model("llama")
    prompts = make_prompts(49152)
    server = RemoteServer([str(model), "--dtype", "float32", "--block-size", "32",
                           "--max-model-len", "512", "-tp", "2", "-dp", "2"],
                          env={"VLLM_CPU_OMP_THREADS_BIND": "nobind"})  # 4 ranks, 2 cores
    try:
        assert server.log().count("Started ranks 0 (pid") == 2
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")

        def complete(prompt: list[int]) -> str:
            return client.completions.create(model=str(model), prompt=prompt, max_tokens=16,
                                              temperature=0).choices[0].text

        with ThreadPoolExecutor(len(prompts)) as pool:
            texts = list(pool.map(complete, prompts))
        tokenizer = AutoTokenizer.from_pretrained(model)
        assert texts == [tokenizer.decode(t) for t in hf_greedy(model, prompts, 16)]
        metrics = httpx_text(f"{server.url}/metrics")
        for replica in ("0", "1"):
            assert f'vllm:request_success_total{{engine="{replica}"' in metrics
    finally:
        server.stop()


def httpx_text(url: str) -> str:
    import httpx

    return httpx.get(url, timeout=10).text
