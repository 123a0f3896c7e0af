"""Benchmark workloads: random token prompts, or a ShareGPT-format JSON file."""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int
    prompt: str  # the same prompt as text, for the chat endpoint


def add_dataset_args(parser: argparse.ArgumentParser, num_prompts: int = 1000,
                     with_seed: bool = True) -> None:
    """Dataset flags; ``with_seed=False`` where the engine's --seed is already a flag."""
    parser.add_argument("--dataset-name", choices=["random", "sharegpt"], default="random",
                        help="random token prompts, or conversations from --dataset-path")
    parser.add_argument("--dataset-path", default=None, help="ShareGPT-format JSON file")
    parser.add_argument("--num-prompts", type=int, default=num_prompts,
                        help="requests to send")
    parser.add_argument("--random-input-len", type=int, default=1024,
                        help="prompt tokens of each random request")
    parser.add_argument("--random-output-len", type=int, default=128,
                        help="generated tokens of each random request")
    parser.add_argument("--random-range-ratio", type=float, default=0.0,
                        help="lengths drawn uniformly from len * [1 - r, 1 + r]")
    parser.add_argument("--sharegpt-output-len", type=int, default=None,
                        help="output length for every ShareGPT request; unset: the reply's")
    if with_seed:
        parser.add_argument("--seed", type=int, default=0, help="seed of the workload")


def sample_requests(args: argparse.Namespace, tokenizer: Any, max_model_len: int | None = None
                    ) -> list[BenchRequest]:
    if args.num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {args.num_prompts}")
    rng = random.Random(args.seed)
    if args.dataset_name == "sharegpt" or args.dataset_path:
        if not args.dataset_path:
            raise ValueError("dataset_path: --dataset-name sharegpt needs --dataset-path")
        return _sharegpt(args, tokenizer, rng, max_model_len)
    return _random(args, tokenizer, rng)


def _random(args: argparse.Namespace, tokenizer: Any, rng: random.Random) -> list[BenchRequest]:
    ratio = args.random_range_ratio
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"random_range_ratio must be in [0, 1), got {ratio}")

    def length(n: int) -> int:
        return max(1, rng.randint(int(n * (1 - ratio)), int(n * (1 + ratio))))

    vocab_size = len(tokenizer)
    # Ids well inside the vocabulary: the first hundred hold most special tokens.
    low = min(100, vocab_size - 1)

    def random_ids(n: int) -> list[int]:
        return [rng.randrange(low, vocab_size) for _ in range(n)]

    requests = []
    for _ in range(args.num_prompts):
        target = length(args.random_input_len)
        ids = random_ids(target)
        # Random ids decoded and encoded again come back as other, often more, tokens: adjust
        # until the text is `target` tokens long (as vLLM's random prompts are), so the chat
        # endpoint, which takes text, gets prompts of the asked length too.
        for _ in range(10):
            text = tokenizer.decode(ids)
            ids = tokenizer.encode(text, add_special_tokens=False)
            if len(ids) == target:
                break
            ids = ids[:target] + random_ids(target - len(ids))
        requests.append(BenchRequest(ids, length(args.random_output_len), text))
    return requests


def _sharegpt(args: argparse.Namespace, tokenizer: Any, rng: random.Random,
              max_model_len: int | None) -> list[BenchRequest]:
    with open(args.dataset_path) as f:
        data = json.load(f)
    conversations = [d["conversations"] for d in data
                     if len(d.get("conversations", [])) >= 2]
    rng.shuffle(conversations)
    requests = []
    for conversation in conversations:
        prompt = tokenizer.encode(conversation[0]["value"])
        output_len = args.sharegpt_output_len or len(tokenizer.encode(conversation[1]["value"]))
        if len(prompt) < 4 or output_len < 4:
            continue  # too short to say anything about throughput
        if max_model_len is not None and len(prompt) + output_len > max_model_len:
            continue
        requests.append(BenchRequest(prompt, output_len, conversation[0]["value"]))
        if len(requests) == args.num_prompts:
            break
    if not requests:
        raise ValueError(f"dataset_path: no usable conversations in {args.dataset_path}")
    return requests
