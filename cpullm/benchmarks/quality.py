"""``cpullm bench quality``: how faithful a run is to the same weights in float32.

Windows of a fixed text are scored as prompts (teacher forcing, as llama.cpp's
``llama-perplexity`` does); at every scored position the run under test (the candidate)
and the reference give a distribution over the next token. Reported, over the scored
positions of all windows:

- perplexity of each, and the candidate's drift (its perplexity over the reference's - 1);
- the KL divergence KL(reference || candidate): mean, median, 99th percentile, maximum;
- top-1 agreement: how often both put the same token first.

The reference is the same model run in float32 (a GGUF file's blocks dequantized once at
load, every kernel on its float32 path), or in bfloat16 (``--reference bfloat16``: what a
quantized KV cache is measured against), either with its KV cache in its own dtype; or a
file saved by ``--save-reference``, which
keeps the token ids and the reference's top ``--top-k`` log-probabilities of every scored
position (llama.cpp's ``--kl-divergence-base`` keeps the whole vocabulary instead). The KL
divergence is taken over those top k tokens and the rest of the vocabulary as one more
outcome; it is exact where k covers the vocabulary, and a lower bound otherwise (where
the run's own top k holds the reference's).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from cpullm.engine_args import OFFLINE_DEFAULTS, EngineArgs
from cpullm.entrypoints.llm import LLM
from cpullm.sampling_params import SamplingParams

REFERENCE_FORMAT = 1
_REFERENCE_DTYPES = ("float32", "bfloat16")  # --reference computed now, in this dtype


def add_quality_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="the model under test (as --model)")
    parser.add_argument("--text", default=None,
                        help="a UTF-8 text file to score; unset: the English text of Python's "
                        "own help topics (pydoc_data), which every Python ships")
    parser.add_argument("--windows", type=int, default=6, help="windows of the text to score")
    parser.add_argument("--window-len", type=int, default=384,
                        help="tokens per window; the first half of each is context and its "
                        "second half is scored, as llama-perplexity does")
    parser.add_argument("--top-k", type=int, default=100,
                        help="the reference's most likely tokens kept per position for the KL "
                        "divergence (exact where it covers the vocabulary)")
    parser.add_argument("--reference", default="float32",
                        help="'float32' or 'bfloat16' (the same model and flags in that dtype, "
                        "its KV cache in that dtype too), or a file written by "
                        "--save-reference")
    parser.add_argument("--save-reference", default=None, metavar="PATH",
                        help="write the reference's token ids and top log-probabilities to "
                        "this .npz file, for later runs' --reference")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--output-json", default=None, help="write the figures to this file")
    EngineArgs.add_cli_args(parser, **OFFLINE_DEFAULTS)


@dataclass
class Reference:
    """What the candidate is compared with: the windows' token ids [windows, len], and per
    scored position [windows, scored, ...] the log-probability of the text's next token
    and the ids and log-probabilities of the most likely tokens, most likely first."""

    token_ids: np.ndarray
    score_from: int
    target_logprobs: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray
    vocab_size: int
    description: str

    def save(self, path: str) -> None:
        np.savez_compressed(path, format=REFERENCE_FORMAT, token_ids=self.token_ids,
                            score_from=self.score_from, target_logprobs=self.target_logprobs,
                            top_ids=self.top_ids, top_logprobs=self.top_logprobs,
                            vocab_size=self.vocab_size, description=self.description)

    @classmethod
    def load(cls, path: str) -> Reference:
        try:
            data = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as e:
            raise ValueError(f"--reference: cannot read {path!r} as a saved reference: {e}"
                             ) from e
        with data:
            if "format" not in data or int(data["format"]) != REFERENCE_FORMAT:
                raise ValueError(f"--reference: {path!r} is not a reference written by "
                                 "--save-reference")
            return cls(data["token_ids"], int(data["score_from"]), data["target_logprobs"],
                       data["top_ids"], data["top_logprobs"], int(data["vocab_size"]),
                       str(data["description"]))


@dataclass
class Scores:
    """One run's log-probabilities at the scored positions [windows, scored, ...]."""

    target_logprobs: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray


def default_text() -> str:
    """English prose that every Python carries: the help topics of its language reference."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics))


def make_windows(tokenizer: Any, text: str, windows: int, window_len: int) -> np.ndarray:
    """[windows, window_len] token ids: consecutive pieces of the text, each begun with the
    tokens the tokenizer puts before any text (a BOS), as llama-perplexity begins its."""
    if windows < 1 or window_len < 4:
        raise ValueError("--windows must be at least 1 and --window-len at least 4")
    ids = tokenizer.encode(text, add_special_tokens=False)
    with_special = tokenizer.encode("a")
    plain = tokenizer.encode("a", add_special_tokens=False)
    prefix = with_special[:with_special.index(plain[0])] if plain[0] in with_special else []
    body = window_len - len(prefix)
    if len(ids) < windows * body:
        raise ValueError(f"--text: {len(ids)} tokens, too few for {windows} windows of "
                         f"{window_len} tokens")
    return np.array([prefix + ids[i * body:(i + 1) * body] for i in range(windows)],
                    dtype=np.int64)


def score(llm: LLM, token_ids: np.ndarray, score_from: int, top_k: int) -> Scores:
    """Score every window as a prompt; the log-probabilities of positions from score_from
    on (the distribution over the token at that position, given those before it)."""
    vocab = llm.llm_engine.config.model.vocab_size
    k = min(top_k, vocab)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=k)
    outputs = llm.generate([{"prompt_token_ids": row.tolist()} for row in token_ids], params,
                           use_tqdm=False)
    windows, length = token_ids.shape
    target = np.empty((windows, length - score_from), dtype=np.float64)
    top_ids = np.empty((windows, length - score_from, k), dtype=np.int64)
    top_lps = np.empty((windows, length - score_from, k), dtype=np.float64)
    for w, output in enumerate(outputs):
        rows = output.prompt_logprobs
        assert rows is not None and len(rows) == length
        for j, position in enumerate(range(score_from, length)):
            # {id: Logprob}: the text's token (with its rank), and the top k by rank
            entry = rows[position]
            target[w, j] = entry[int(token_ids[w, position])].logprob
            ranked = sorted(entry.items(), key=lambda item: item[1].rank)[:k]
            top_ids[w, j] = [i for i, _ in ranked]
            top_lps[w, j] = [lp.logprob for _, lp in ranked]
    return Scores(target, top_ids, top_lps)


def compare(reference: Reference, candidate: Scores) -> dict[str, float]:
    """The figures of the candidate against the reference (see the module's docstring)."""
    ref_lp, ref_ids = reference.top_logprobs, reference.top_ids
    # the candidate's log-probability of each of the reference's top tokens; a token
    # outside the candidate's own top k gets its k-th (an upper bound of the true value)
    cand_lp = np.empty_like(ref_lp)
    for w in range(ref_ids.shape[0]):
        for j in range(ref_ids.shape[1]):
            known = dict(zip(candidate.top_ids[w, j].tolist(),
                             candidate.top_logprobs[w, j].tolist(), strict=True))
            floor = candidate.top_logprobs[w, j, -1]
            cand_lp[w, j] = [known.get(i, floor) for i in ref_ids[w, j].tolist()]
    p = np.exp(ref_lp)
    q = np.exp(cand_lp)
    p_rest = np.clip(1.0 - p.sum(-1), 0.0, 1.0)
    q_rest = np.clip(1.0 - q.sum(-1), 1e-30, 1.0)
    kl = (p * (ref_lp - cand_lp)).sum(-1)
    kl += np.where(p_rest > 0, p_rest * (np.log(np.maximum(p_rest, 1e-30)) - np.log(q_rest)),
                   0.0)
    kl = np.maximum(kl, 0.0).ravel()
    ppl_ref = math.exp(-float(reference.target_logprobs.mean()))
    ppl = math.exp(-float(candidate.target_logprobs.mean()))
    return {
        "positions": int(kl.size),
        "perplexity": ppl,
        "reference_perplexity": ppl_ref,
        "perplexity_drift": ppl / ppl_ref - 1.0,
        "kl_mean": float(kl.mean()),
        "kl_median": float(np.median(kl)),
        "kl_p99": float(np.percentile(kl, 99)),
        "kl_max": float(kl.max()),
        "top1_agreement": float((candidate.top_ids[..., 0] == ref_ids[..., 0]).mean()),
    }


def _name(config: Any) -> str:
    source = config.model.source
    return source.gguf_path or source.directory


def run_quality(args: argparse.Namespace) -> dict[str, Any]:
    engine_args = EngineArgs.from_cli_args(args)
    reference: Reference | None = None
    top_k = args.top_k
    if args.reference not in _REFERENCE_DTYPES:
        reference = Reference.load(args.reference)
        top_k = reference.top_ids.shape[-1]  # the candidate's as many as the reference's
    if top_k < 1:
        raise ValueError("--top-k must be at least 1")
    if engine_args.max_num_seqs is None:
        # every window runs at once: the default KV cache then holds them, not 4 GiB
        engine_args.max_num_seqs = args.windows if reference is None \
            else len(reference.token_ids)
    if engine_args.max_logprobs != -1:  # room for the top k of every position
        engine_args.max_logprobs = max(engine_args.max_logprobs, top_k)
    candidate_llm = LLM.from_engine_args(engine_args)
    tokenizer = candidate_llm.get_tokenizer()
    vocab = candidate_llm.llm_engine.config.model.vocab_size
    if reference is None:
        text = Path(args.text).read_text(encoding="utf-8") if args.text else default_text()
        token_ids = make_windows(tokenizer, text, args.windows, args.window_len)
        score_from = args.window_len // 2
    else:
        if reference.vocab_size != vocab:
            raise ValueError(f"--reference: made with a vocabulary of {reference.vocab_size} "
                             f"tokens, this model has {vocab}")
        token_ids, score_from = reference.token_ids, reference.score_from
    candidate = score(candidate_llm, token_ids, score_from, top_k)
    config = candidate_llm.llm_engine.config
    described = f"{_name(config)} in {str(config.model.dtype).removeprefix('torch.')}" + (
        f", KV cache {config.model.kv_cache_dtype}" if config.model.kv_cache_quantized else "")
    # the run's weights go before the reference's come
    candidate_llm.llm_engine.shutdown()
    del candidate_llm
    gc.collect()
    if reference is None:
        # the same model, flags and all, in float32 (or bfloat16), K and V kept in it
        ref_llm = LLM.from_engine_args(dataclasses.replace(
            engine_args, dtype=args.reference, kv_cache_dtype="auto",
            calculate_kv_scales=False))
        ref = score(ref_llm, token_ids, score_from, top_k)
        ref_config = ref_llm.llm_engine.config
        ref_llm.llm_engine.shutdown()
        del ref_llm
        reference = Reference(token_ids, score_from, ref.target_logprobs, ref.top_ids,
                              ref.top_logprobs, vocab,
                              f"{_name(ref_config)} in {args.reference}")
    if args.save_reference:
        reference.save(args.save_reference)
    figures = report(reference, candidate, described)
    if args.json:
        print(json.dumps(figures, indent=2))
    else:
        print(format_figures(figures))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(figures, f, indent=2)
    return figures


def report(reference: Reference, candidate: Scores, described: str) -> dict[str, Any]:
    """compare()'s figures, with what was compared."""
    figures: dict[str, Any] = compare(reference, candidate)
    token_ids = reference.token_ids
    figures.update(candidate=described, reference=reference.description,
                   windows=int(token_ids.shape[0]), window_len=int(token_ids.shape[1]),
                   top_k=int(reference.top_ids.shape[-1]),
                   text_sha256=hashlib.sha256(token_ids.tobytes()).hexdigest()[:16])
    return figures


def format_figures(figures: dict[str, Any]) -> str:
    return "\n".join([
        f"candidate: {figures['candidate']}",
        f"reference: {figures['reference']}",
        f"scored: {figures['positions']} positions ({figures['windows']} windows of "
        f"{figures['window_len']} tokens, the second half of each)",
        f"perplexity: {figures['perplexity']:.4f} (reference {figures['reference_perplexity']:.4f}"
        f", drift {100 * figures['perplexity_drift']:+.3f}%)",
        f"KL divergence: mean {figures['kl_mean']:.6f}, median {figures['kl_median']:.6f}, "
        f"99% {figures['kl_p99']:.6f}, max {figures['kl_max']:.6f} "
        f"(over the reference's top {figures['top_k']} tokens and the rest)",
        f"top-1 agreement: {100 * figures['top1_agreement']:.2f}%",
    ])
