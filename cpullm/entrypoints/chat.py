"""``cpullm chat``: a terminal chat that streams the model's answer as it is made."""

from __future__ import annotations

import logging
import os
import sys

from cpullm.engine.llm_engine import LLMEngine
from cpullm.engine_args import EngineArgs
from cpullm.logger import set_log_level
from cpullm.sampling_params import RequestOutputKind, SamplingParams


def stream_reply(engine: LLMEngine, messages: list[dict[str, str]],
                 params: SamplingParams) -> str:
    """Generate one assistant turn, printing text as it arrives; returns the whole text."""
    prompt = engine.apply_chat_template(messages)
    token_ids = engine.tokenizer.encode(prompt, add_special_tokens=False)
    params = params.clone()
    params.output_kind = RequestOutputKind.DELTA
    request_id = engine.add_request(None, {"prompt_token_ids": token_ids}, params)
    pieces = []
    try:
        while engine.has_unfinished_requests():
            for output in engine.step():
                for completion in output.outputs:
                    pieces.append(completion.text)
                    sys.stdout.write(completion.text)
                    sys.stdout.flush()
    finally:
        engine.abort_request(request_id)
    sys.stdout.write("\n")
    return "".join(pieces)


def run_chat(engine_args: EngineArgs, params: SamplingParams, message: str | None,
             system: str | None, verbose: bool = False) -> int:
    """The conversation's lines are the conversation's: the engine logs warnings and errors
    only (unless ``verbose`` or VLLM_LOGGING_LEVEL asks for more), and everything that
    loads or pins threads does so before the first prompt."""
    if not verbose and "VLLM_LOGGING_LEVEL" not in os.environ:
        set_log_level(logging.WARNING)
    engine = LLMEngine.from_engine_args(engine_args)
    engine.bind_threads()  # (pinning the compute threads now, not in the first answer)
    messages: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    if message is not None:
        messages.append({"role": "user", "content": message})
        stream_reply(engine, messages, params)
        return 0
    interactive = sys.stdin.isatty()
    if interactive:
        print("Chatting with the model; an empty line or Ctrl-D ends the chat.")
    while True:
        if interactive:
            sys.stdout.write("> ")
            sys.stdout.flush()
        line = sys.stdin.readline()
        if not line.strip():
            return 0
        messages.append({"role": "user", "content": line.strip()})
        reply = stream_reply(engine, messages, params)
        messages.append({"role": "assistant", "content": reply})
