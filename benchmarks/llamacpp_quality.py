"""llama.cpp on the windows of a reference saved by ``cpullm bench quality --save-reference``.

Two steps, each in its own environment (llama-cpp-python never shares cpullm's):

    # 1. in llama-cpp-python's venv (numpy and llama_cpp only): score the same token ids
    python benchmarks/llamacpp_quality.py score MODEL.gguf REF.npz SCORES.npz [--threads N]
    # 2. in cpullm's: the same figures as `cpullm bench quality` prints
    python benchmarks/llamacpp_quality.py compare REF.npz SCORES.npz [--json]

llama.cpp evaluates each window in one batch, as ``llama-perplexity`` does, and its
log-probabilities at the scored positions are kept as cpullm's are (the text's next token
and the top k, k being the reference's).
"""

from __future__ import annotations

import argparse
import json

import numpy as np


def score(model: str, reference: str, out: str, threads: int) -> None:
    from llama_cpp import Llama

    with np.load(reference, allow_pickle=False) as data:
        token_ids, score_from = data["token_ids"], int(data["score_from"])
        k = data["top_ids"].shape[-1]
    windows, length = token_ids.shape
    llm = Llama(model_path=model, n_ctx=length, n_batch=length, n_ubatch=length,
                n_threads=threads, logits_all=True, verbose=False)
    target = np.empty((windows, length - score_from))
    top_ids = np.empty((windows, length - score_from, k), dtype=np.int64)
    top_lps = np.empty((windows, length - score_from, k))
    for w, row in enumerate(token_ids):
        llm.reset()
        llm.eval(row.tolist())
        # logits at position t predict token t + 1
        logits = np.asarray(llm.scores[score_from - 1:length - 1], dtype=np.float64)
        logprobs = logits - logits.max(-1, keepdims=True)
        logprobs -= np.log(np.exp(logprobs).sum(-1, keepdims=True))
        target[w] = logprobs[np.arange(len(logprobs)), row[score_from:]]
        order = np.argsort(-logprobs, axis=-1, kind="stable")[:, :k]
        top_ids[w] = order
        top_lps[w] = np.take_along_axis(logprobs, order, -1)
    np.savez(out, target_logprobs=target, top_ids=top_ids, top_logprobs=top_lps,
             described=f"{model} on llama.cpp")


def compare(reference: str, scores: str, as_json: bool) -> None:
    from cpullm.benchmarks.quality import Reference, Scores, format_figures, report

    with np.load(scores, allow_pickle=False) as data:
        candidate = Scores(data["target_logprobs"], data["top_ids"], data["top_logprobs"])
        described = str(data["described"])
    figures = report(Reference.load(reference), candidate, described)
    print(json.dumps(figures, indent=2) if as_json else format_figures(figures))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="step", required=True)
    s = sub.add_parser("score")
    s.add_argument("model")
    s.add_argument("reference")
    s.add_argument("out")
    s.add_argument("--threads", type=int, default=2)
    c = sub.add_parser("compare")
    c.add_argument("reference")
    c.add_argument("scores")
    c.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.step == "score":
        score(args.model, args.reference, args.out, args.threads)
    else:
        compare(args.reference, args.scores, args.json)


if __name__ == "__main__":
    main()
