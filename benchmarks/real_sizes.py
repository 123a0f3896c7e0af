"""The models CPU users run, at their real sizes, with random weights made here: Llama-3.2-3B
and Llama-3.1-8B shapes (GQA, a 128k vocabulary) as Hugging Face bfloat16 folders, and as
GGUF files in Q4_K_M, Q8_0 and Q4_0 converted and quantized by llama.cpp's own tools.

    python benchmarks/real_sizes.py make --llama-cpp SRC --quantizer PY [--cache DIR] [3b 8b]
    python benchmarks/real_sizes.py path 3b q4_k_m          # prints the file's path

SRC is a llama.cpp source tree (its convert_hf_to_gguf.py and gguf-py: the vendor/llama.cpp
folder of llama-cpp-python's source archive), PY a Python with llama-cpp-python installed
(its library quantizes). Everything goes to DIR (default ~/.cache/cpullm-real-sizes) once;
a model or file already there is kept. The tokenizer is the default model's (SmolLM2's,
49,152 tokens), the embedding's other rows never read. docs/benchmarks.md gives the
measurements that run on these files.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

SHAPES = {  # the published configs' shapes
    "3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
               num_attention_heads=24, num_key_value_heads=8, tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False),
}
# llama.cpp's file types (llama_ftype) by the names its quantize tool takes
FILE_TYPES = {"q4_k_m": 15, "q8_0": 7, "q4_0": 2}


def cache_dir(path: str | None) -> Path:
    return Path(path or os.path.expanduser("~/.cache/cpullm-real-sizes"))


def folder(cache: Path, size: str) -> Path:
    return cache / f"llama-{size}-bf16"


def gguf_path(cache: Path, size: str, kind: str) -> Path:
    return cache / f"llama-{size}-{kind}.gguf"


def make_folder(out: Path, size: str) -> None:
    """A bfloat16 folder of random weights (normal, std 0.02: activations of a trained
    model's scale) with the default model's tokenizer."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from cpullm.transformers_utils import resolve_model

    config = LlamaConfig(vocab_size=128256, max_position_embeddings=131072,
                         rope_theta=500000.0, rms_norm_eps=1e-5, hidden_act="silu",
                         rope_scaling={"rope_type": "llama3", "factor": 32.0,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 8192},
                         bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16",
                         **SHAPES[size])
    torch.manual_seed(0)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    model.tie_weights()  # (to_empty gives the tied LM head storage of its own)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02)
    tmp = out.with_name(out.name + ".part")
    model.save_pretrained(tmp, safe_serialization=True, max_shard_size="5GB")
    del model
    default = resolve_model(None)
    tokenizer = AutoTokenizer.from_pretrained(default.directory, gguf_file=default.gguf_file)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out)


def make_gguf(cache: Path, size: str, kinds: list[str], llama_cpp: Path, quantizer: str
              ) -> None:
    """The folder converted to a bfloat16 GGUF by llama.cpp's converter, then quantized to
    each kind by llama.cpp's quantizer (the bfloat16 file removed after)."""
    missing = [k for k in kinds if not gguf_path(cache, size, k).exists()]
    if not missing:
        return
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        bf16 = Path(tmp) / "bf16.gguf"
        env = dict(os.environ, PYTHONPATH=str(llama_cpp / "gguf-py"))
        subprocess.run([sys.executable, str(llama_cpp / "convert_hf_to_gguf.py"),
                        str(folder(cache, size)), "--outtype", "bf16", "--outfile", str(bf16)],
                       check=True, env=env)
        for kind in missing:
            out = gguf_path(cache, size, kind)
            part = out.with_name(out.name + ".part")
            code = ("import sys, llama_cpp\n"
                    "p = llama_cpp.llama_model_quantize_default_params()\n"
                    "p.ftype = int(sys.argv[3])\n"
                    "sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), "
                    "sys.argv[2].encode(), p))\n")
            subprocess.run([quantizer, "-c", code, str(bf16), str(part), str(FILE_TYPES[kind])],
                           check=True)
            part.rename(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    make = sub.add_parser("make", help="make the folders and files not made yet")
    make.add_argument("sizes", nargs="*", default=["3b", "8b"], choices=sorted(SHAPES))
    make.add_argument("--cache")
    make.add_argument("--llama-cpp", required=True, type=Path,
                      help="a llama.cpp source tree (convert_hf_to_gguf.py, gguf-py)")
    make.add_argument("--quantizer", required=True,
                      help="a Python with llama-cpp-python installed")
    make.add_argument("--kinds", nargs="+", default=list(FILE_TYPES), choices=list(FILE_TYPES))
    where = sub.add_parser("path", help="print a folder's (bf16) or a file's path")
    where.add_argument("size", choices=sorted(SHAPES))
    where.add_argument("kind", choices=["bf16", *FILE_TYPES])
    where.add_argument("--cache")
    args = parser.parse_args()

    cache = cache_dir(args.cache)
    if args.command == "path":
        print(folder(cache, args.size) if args.kind == "bf16"
              else gguf_path(cache, args.size, args.kind))
        return
    cache.mkdir(parents=True, exist_ok=True)
    for size in args.sizes:
        if not folder(cache, size).exists():
            make_folder(folder(cache, size), size)
        make_gguf(cache, size, args.kinds, args.llama_cpp, args.quantizer)


if __name__ == "__main__":
    main()
