"""cpullm: LLM inference and serving on CPUs."""

from cpullm.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from cpullm.entrypoints.llm import LLM
from cpullm.outputs import CompletionOutput, Logprob, RequestOutput
from cpullm.sampling_params import RequestOutputKind, SamplingParams

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob",
           "RequestOutputKind", "BeamSearchParams", "BeamSearchOutput", "BeamSearchSequence",
           "__version__"]
