"""``cpullm recipe``: a model plus a hardware class in, ``config.yml`` and ``env.sh`` out.

A recipe is data (``data/<hardware>/<family>.yaml`` over ``data/<hardware>/default.yaml``,
the rule for families that have no file): dtype, how replicas and ranks use the NUMA nodes,
what share of memory the weights and the KV cache may take, batch budgets, variants. The
plan is a pure function of the recipe, what the model is (read from its files, or guessed
from its name when it is not on this machine) and the topology, so it is tested on fixture
machines:

1. ranks: the weights must fit ``weights-share`` of a node's memory on one rank. If they
   do, ``parallel: data`` runs a replica per node (throughput), ``parallel: tensor`` one
   model over all nodes (latency); if not, the fewest nodes whose memory holds them
   (tensor parallel, or pipeline parallel where the heads do not split).
2. threads: vLLM CPU's auto binding over those ranks (one thread per physical core, each
   rank on its own node, ``reserved-cpus`` left to the front-end), written out as the
   explicit per-rank lists of ``VLLM_CPU_OMP_THREADS_BIND``.
3. KV cache per rank (``VLLM_CPU_KVCACHE_SPACE``): ``kv-cache-share`` of what the rank's
   node has left after its weights and 2 GiB of runtime, no more than the sequences of
   ``max-num-seqs`` at full length could fill; none for an encoder.
"""

from __future__ import annotations

import functools
import math
import os
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from cpullm.platform.binding import plan_binding
from cpullm.platform.topology import format_cpu_list
from cpullm.recipes.hardware import DATA, GiB, Hardware, resolve_hardware

_RUNTIME_BYTES = 2 * GiB  # per rank: activations, buffers, the interpreter
# config.json model_type -> recipe family; families with no file take default.yaml
_FAMILIES = {"qwen2_moe": "moe", "qwen3_moe": "moe", "mixtral": "moe", "gpt_oss": "moe",
             "bert": "encoder", "roberta": "encoder", "xlm-roberta": "encoder"}
# what a model's name says of its family, for models not on this machine
_NAME_FAMILIES = ((r"mixtral|moe|-a\d+(\.\d+)?b\b|gpt-oss", "moe"),
                  (r"minilm|bge-|\be5-|gte-|bert|rerank|cross-encoder|mpnet", "encoder"))
_RECIPE_KEYS = {"description", "dtype", "parallel", "weights-share", "kv-cache-share",
                "reserved-cpus", "serve", "env", "variants"}


@dataclass(frozen=True)
class ModelFacts:
    """What a recipe needs to know of a model; None where it cannot be known."""

    name: str
    family: str
    task: str  # generate, embed or score
    weight_bytes: int | None = None  # in bfloat16, or as kept quantized
    kv_bytes_per_token: int | None = None  # bfloat16 K and V over all layers
    max_model_len: int | None = None
    num_heads: int | None = None
    num_kv_heads: int | None = None
    quantization: str | None = None
    local: bool = False


@dataclass
class Recipe:
    """The plan: the flags of config.yml and the variables of env.sh, with the reasons."""

    model: str
    hardware: Hardware
    family: str
    variant: str | None
    config: dict[str, Any]
    env: dict[str, str]
    notes: list[str] = field(default_factory=list)

    def config_yaml(self) -> str:
        head = self._header() + ["# source env.sh, then: cpullm serve --config config.yml"]
        return "\n".join(head) + "\n" + yaml.safe_dump(self.config, sort_keys=False)

    def env_sh(self) -> str:
        lines = self._header() + [f"export {k}={shlex.quote(v)}" for k, v in self.env.items()]
        return "\n".join(lines) + "\n"

    def _header(self) -> list[str]:
        variant = f", variant {self.variant}" if self.variant else ""
        return ([f"# cpullm recipe: {self.model} on {self.hardware.name}{variant}",
                 f"# hardware: {self.hardware.description}",
                 f"# recipe: {self.family}.yaml of {self.hardware.name}"]
                + [f"# {note}" for note in self.notes])

    def write(self, output_dir: str | os.PathLike[str]) -> list[Path]:
        out = Path(output_dir)
        out.mkdir(parents=True, exist_ok=True)
        paths = [out / "config.yml", out / "env.sh"]
        paths[0].write_text(self.config_yaml())
        paths[1].write_text(self.env_sh())
        return paths


def model_facts(model: str | None) -> ModelFacts:
    """Read a local folder or GGUF file (the default model when None); a name that is not
    on this machine (a hub id) gives what the name says: family and parameter count."""
    from cpullm.transformers_utils import DEFAULT_MODEL_NAME, resolve_model

    name = model or DEFAULT_MODEL_NAME
    try:
        source = resolve_model(model)
    except ValueError:
        if model is not None and os.path.exists(os.path.expanduser(model)):
            raise  # on disk but not a model: say why
        return _facts_from_name(name)
    return _facts_from_files(name, source)


def _facts_from_name(name: str) -> ModelFacts:
    lowered = name.lower()
    family = next((f for pattern, f in _NAME_FAMILIES if re.search(pattern, lowered)),
                  "default")
    size = re.search(r"(?<![\d.])(\d+(?:\.\d+)?)\s*([mb])(?![a-z])", lowered)
    weights = None
    if size:  # the first count in the name is the total (Qwen3-30B-A3B: 30B)
        weights = int(float(size.group(1)) * (1e6 if size.group(2) == "m" else 1e9) * 2)
    task = ("score" if re.search(r"rerank|cross-encoder", lowered) else "embed") \
        if family == "encoder" else "generate"
    return ModelFacts(name, family, task, weight_bytes=weights)


def _facts_from_files(name: str, source: Any) -> ModelFacts:
    from cpullm.model_executor.loader.safetensors_loader import mxfp4_bytes, safetensors_numel
    from cpullm.model_executor.models import get_model_class
    from cpullm.transformers_utils import load_hf_config

    hf_config = load_hf_config(source)
    model_type = getattr(hf_config, "model_type", "")
    archs = getattr(hf_config, "architectures", None) or []
    quant = getattr(hf_config, "quantization_config", None)
    quantization = "gguf" if source.gguf_file else (
        (quant if isinstance(quant, dict) else quant.to_dict()).get("quant_method")
        if quant is not None else None)
    if source.gguf_path is not None:
        weights = os.path.getsize(source.gguf_path)
    else:
        files = sorted(str(p) for p in Path(source.directory).glob("*.safetensors"))
        kept = quantization is not None
        weights = (sum(os.path.getsize(f) for f in files) if kept
                   else safetensors_numel(files) * 2) if files else None
        if files and quantization == "mxfp4":  # kept as 8-bit codes (quantization/mxfp4.py)
            weights += mxfp4_bytes(files)
    task = "generate"
    try:
        model_class = get_model_class(archs[0]) if archs else None
    except ValueError:
        model_class = None
    if model_class is not None and getattr(model_class, "is_encoder", False):
        task = "score" if hasattr(model_class, "classify") else "embed"
    heads = getattr(hf_config, "num_attention_heads", None)
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or (
        hf_config.hidden_size // heads if heads else None)
    layers = getattr(hf_config, "num_hidden_layers", None)
    kv = 2 * layers * kv_heads * head_dim * 2 if layers and kv_heads and head_dim else None
    return ModelFacts(name, _FAMILIES.get(model_type, "encoder" if task != "generate"
                                          else "default"), task, weights,
                      None if task != "generate" else kv,
                      getattr(hf_config, "max_position_embeddings", None), heads, kv_heads,
                      quantization, local=True)


@functools.cache
def _recipe_file(path: Path) -> dict[str, Any]:
    with open(path) as f:
        data = yaml.safe_load(f) or {}
    unknown = sorted(set(data) - _RECIPE_KEYS)
    if unknown:
        raise ValueError(f"recipe {path.parent.name}/{path.name}: unknown keys {unknown}")
    return data


def load_recipe(hardware: str, family: str) -> tuple[str, dict[str, Any]]:
    """The family's recipe over the hardware's default.yaml; (the family used, the recipe)."""
    folder = DATA / hardware
    base = _recipe_file(folder / "default.yaml")
    path = folder / f"{family}.yaml"
    if family == "default" or not path.is_file():
        return "default", base
    own = _recipe_file(path)
    merged = _merge(base, own)
    if "variants" in own:  # a family's variants replace the default's
        merged["variants"] = own["variants"] or {}
    return family, merged


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in over.items():
        merged[key] = _merge(base[key], value) if isinstance(value, dict) and isinstance(
            base.get(key), dict) else value
    return merged


def make_recipe(model: str | None, hardware: str = "auto", variant: str | None = None,
                root: str = "/", facts: ModelFacts | None = None) -> Recipe:
    """Plan ``model`` on ``hardware`` (a class name, or auto: this machine, read below
    ``root``)."""
    hw = resolve_hardware(hardware, root)
    facts = facts or model_facts(model)
    family, recipe = load_recipe(hw.name, facts.family)
    variants = recipe.get("variants") or {}
    chosen = variant or (facts.quantization if facts.quantization in variants else None)
    if chosen is not None:
        if chosen not in variants:
            raise ValueError(f"variant: the {family} recipe of {hw.name} has no variant "
                             f"{chosen!r}; it has: {', '.join(variants) or 'none'}")
        recipe = _merge({k: v for k, v in recipe.items() if k != "variants"}, variants[chosen])
    notes: list[str] = []
    config: dict[str, Any] = {} if model is None else {"model": model}  # None: the default
    if facts.task != "generate":
        config["task"] = facts.task
    config["dtype"] = _dtype(recipe.get("dtype", "bfloat16"), hw, notes)
    tp, pp, dp = _ranks(facts, recipe, hw, notes)
    config.update({"tensor-parallel-size": tp, "pipeline-parallel-size": pp,
                   "data-parallel-size": dp})
    serve = dict(recipe.get("serve") or {})
    if facts.max_model_len and serve.get("max-model-len", 0) > facts.max_model_len:
        serve["max-model-len"] = facts.max_model_len
    if facts.task != "generate" and facts.max_model_len:  # an encoder's input fits one step
        serve["max-num-batched-tokens"] = max(serve.get("max-num-batched-tokens", 0),
                                              facts.max_model_len)
    config.update(serve)
    env = {"VLLM_CPU_OMP_THREADS_BIND": "", "VLLM_CPU_NUM_OF_RESERVED_CPU": ""}
    ranks = tp * pp * dp
    reserved = int(recipe.get("reserved-cpus", 1))
    if reserved and _cores_per_rank(hw, ranks) < 4:
        reserved = 0  # the engine's own rule: a reserved core would cost more than it saves
    plan = plan_binding(hw.topology, "auto", ranks, reserved)
    env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(format_cpu_list(list(c))
                                                for c in plan.rank_cpus)
    env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(reserved)
    notes.append(f"threads: {ranks} rank(s), {len(plan.rank_cpus[0])} cores each; CPUs "
                 f"{format_cpu_list(list(plan.reserved_cpus)) or 'none'} left to the "
                 "front-end")
    if facts.task == "generate":
        env["VLLM_CPU_KVCACHE_SPACE"] = str(_kv_space(facts, recipe, hw, tp * pp, ranks,
                                                      config, notes))
    env.update({k: str(v) for k, v in (recipe.get("env") or {}).items()})
    return Recipe(facts.name, hw, family, chosen, config, env, notes)


def _cores_per_rank(hw: Hardware, ranks: int) -> int:
    cores = len(hw.topology.one_cpu_per_core(sorted(hw.topology.allowed)))
    return cores // max(1, ranks)


def _dtype(dtype: str, hw: Hardware, notes: list[str]) -> str:
    if dtype == "float16" and not hw.topology.info.supports_fast_fp16:
        notes.append("dtype: float16 needs AVX512-FP16 or AMX-FP16; bfloat16 instead")
        return "bfloat16"
    return dtype


def _ranks(facts: ModelFacts, recipe: dict[str, Any], hw: Hardware,
           notes: list[str]) -> tuple[int, int, int]:
    """(tensor, pipeline, data) parallel sizes over the NUMA nodes."""
    nodes, node_bytes = hw.usable_nodes, hw.node_bytes
    fits_in = float(recipe.get("weights-share", 0.6)) * node_bytes
    weights = facts.weight_bytes
    if weights is None:
        notes.append("weights: size unknown (not on this machine, no count in its name); "
                     "planned as if they fit one node")
        weights = 0
    else:
        notes.append(f"weights: {weights / GiB:.1f} GiB; a node has {node_bytes / GiB:.0f} GiB")
    if facts.task != "generate":  # encoders run on one rank: replicas only
        return 1, 1, len(nodes)
    if weights <= fits_in:
        if recipe.get("parallel", "data") == "tensor" and len(nodes) > 1:
            return _split(facts, len(nodes), notes), 1, 1
        return 1, 1, len(nodes)
    need = next((n for n in range(2, len(nodes) + 1) if weights / n <= fits_in), None)
    if need is None:
        raise ValueError(f"model: {weights / GiB:.1f} GiB of weights do not fit the "
                         f"{len(nodes)} NUMA node(s) of {hw.name} ({node_bytes / GiB:.0f} GiB "
                         "each, at most a share of "
                         f"{recipe.get('weights-share', 0.6)} for weights); use a quantized "
                         "checkpoint or more nodes")
    return (_split(facts, need, notes), 1, 1) if _heads_split(facts, need) else (1, need, 1)


def _heads_split(facts: ModelFacts, ranks: int) -> bool:
    heads, kv = facts.num_heads, facts.num_kv_heads
    return heads is None or (heads % ranks == 0 and (kv % ranks == 0 or ranks % kv == 0))


def _split(facts: ModelFacts, ranks: int, notes: list[str]) -> int:
    if not _heads_split(facts, ranks):
        notes.append(f"parallel: the heads do not split over {ranks} ranks; one rank")
        return 1
    return ranks


def _kv_space(facts: ModelFacts, recipe: dict[str, Any], hw: Hardware, model_ranks: int,
              ranks: int, config: dict[str, Any], notes: list[str]) -> int:
    """GiB of KV cache per rank."""
    node_bytes = hw.node_bytes
    ranks_per_node = max(1, math.ceil(ranks / len(hw.usable_nodes)))
    weights = (facts.weight_bytes or 0) / model_ranks
    left = node_bytes / ranks_per_node - weights - _RUNTIME_BYTES
    space = int(float(recipe.get("kv-cache-share", 0.5)) * left / GiB)
    if facts.kv_bytes_per_token:
        length = config.get("max-model-len") or facts.max_model_len or 4096
        seqs = config.get("max-num-seqs", 256)
        full = math.ceil(facts.kv_bytes_per_token / model_ranks * length * seqs / GiB)
        if full < space:
            notes.append(f"KV cache: {full} GiB holds {seqs} sequences of {length} tokens")
            space = full
    if space < 1:
        raise ValueError(f"model: no memory is left for a KV cache on {hw.name} "
                         f"({node_bytes / GiB:.0f} GiB a node, {weights / GiB:.1f} GiB of "
                         "weights a rank)")
    return space
