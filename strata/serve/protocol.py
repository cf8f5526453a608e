"""OpenAI request parsing and response shapes, as plain functions (no HTTP, no tensors).

Requests are checked field by field so every mistake comes back as a 400 in OpenAI's error shape
with the offending `param` named. Fields we do not implement are refused when they would change
the answer (n > 1, logprobs, tools, ...) and ignored when they would not (user, metadata).
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field

from strata.errors import BadOption
from strata.runtime.sampling import SamplingParams


# A 128k-token prompt is about 0.5 MB as text and 1 MB as JSON token ids.
DEFAULT_MAX_BODY_BYTES = 4 << 20


class APIError(Exception):
    """An error the server answers with `{"error": {...}}` and `status`."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


@dataclass(slots=True)
class Generation:
    """A parsed request: what to submit to the scheduler, and how to answer."""

    prompt_ids: list[int]
    max_tokens: int | None  # None: up to the context
    params: SamplingParams
    stop: list[str]
    stream: bool
    include_usage: bool
    extra: dict = field(default_factory=dict)


# -- field readers ---------------------------------------------------------------------------------

def _number(body: dict, name: str, default, lo=None, hi=None, integer=False, lo_open=False):
    value = body.get(name)
    if value is None:
        return default
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise bad(f"'{name}' must be {'an integer' if integer else 'a number'}, not {value!r}", name)
    if not integer:
        try:
            value = float(value)  # an int past 1e308 does not fit
        except OverflowError:
            value = math.inf
        if not math.isfinite(value):  # Python's json reads NaN, Infinity and 1e999
            raise bad(f"'{name}' must be a finite number, not {body.get(name)!r}", name)
    if lo is not None and (value <= lo if lo_open else value < lo):
        raise bad(f"'{name}' must be {'>' if lo_open else '>='} {lo}, not {value!r}", name)
    if hi is not None and value > hi:
        raise bad(f"'{name}' must be <= {hi}, not {value!r}", name)
    return value


def _max_tokens(body: dict) -> int | None:
    for name in ("max_completion_tokens", "max_tokens"):
        value = _number(body, name, None, lo=1, integer=True)
        if value is not None:
            return value
    return None


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop] if stop else []
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return [s for s in stop if s]
    raise bad("'stop' must be a string or a list of strings", "stop")


def _sampling(body: dict) -> SamplingParams:
    try:
        return SamplingParams(
            temperature=float(_number(body, "temperature", 1.0, lo=0)),
            top_p=float(_number(body, "top_p", 1.0, lo=0, hi=1, lo_open=True)),
            top_k=int(_number(body, "top_k", 0, lo=0, integer=True)),  # extension, as vLLM
            min_p=float(_number(body, "min_p", 0.0, lo=0, hi=1)),  # extension
            repetition_penalty=float(_number(body, "repetition_penalty", 1.0, lo=0, lo_open=True)),
            seed=_number(body, "seed", None, integer=True),
        )
    except BadOption as e:  # its message begins with the field's name
        raise bad(str(e), str(e).split(" ", 1)[0]) from None


# Fields that would change the answer, with the values that mean "not used".
_UNSUPPORTED = {
    "logprobs": (None, False, 0), "top_logprobs": (None, 0), "echo": (None, False), "tools": (None, []),
    "functions": (None, []), "tool_choice": (None, "none"), "logit_bias": (None, {}), "suffix": (None, ""),
    "best_of": (None, 1),
}


def _refuse_unsupported(body: dict) -> None:
    n = _number(body, "n", 1, integer=True)
    if n != 1:
        raise bad("only n=1 is supported", "n")
    for name in ("frequency_penalty", "presence_penalty"):
        if _number(body, name, 0) != 0:
            raise bad(f"'{name}' is not supported (use repetition_penalty)", name)
    for name, unused in _UNSUPPORTED.items():
        value = body.get(name)
        if not any(value is u or (type(value) is type(u) and value == u) for u in unused):
            raise bad(f"'{name}' is not supported by this server", name)
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise bad("only response_format {'type': 'text'} is supported", "response_format")


def _stream(body: dict) -> tuple[bool, bool]:
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad("'stream' must be a boolean", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise bad("'stream_options' must be an object", "stream_options")
    return stream, bool(options.get("include_usage", False))


def _common(body: dict, prompt_ids: list[int]) -> Generation:
    _refuse_unsupported(body)
    stream, include_usage = _stream(body)
    return Generation(prompt_ids, _max_tokens(body), _sampling(body), _stop(body), stream, include_usage)


# -- the two generation endpoints ------------------------------------------------------------------

def chat_messages(body: dict) -> list[dict]:
    """The messages, with list-of-parts content flattened to text."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad(f"messages[{i}] must be an object with a 'role'", f"messages[{i}]")
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad(f"messages[{i}].content: only text parts are supported", f"messages[{i}].content")
                texts.append(part["text"])
            content = "".join(texts)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise bad(f"messages[{i}].content must be a string or a list of text parts", f"messages[{i}].content")
        out.append({**m, "content": content})
    return out


def parse_chat(body: dict, tokenizer) -> Generation:
    messages = chat_messages(body)
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except Exception as e:  # templates raise on roles or orders they do not accept
        raise bad(f"the chat template could not render these messages: {e}", "messages") from None
    return _common(body, tokenizer.encode(text, add_special_tokens=False))


def parse_completion(body: dict, tokenizer) -> Generation:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = list(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise bad("only one prompt per request is supported", "prompt")
    else:
        raise bad("'prompt' must be a string or a list of token ids", "prompt")
    return _common(body, ids)


def check_prompt(ids: list[int], ctx_size: int, vocab_size: int, param: str) -> None:
    if not ids:
        raise bad("the prompt is empty", param)
    bad_ids = [t for t in ids if not 0 <= t < vocab_size]
    if bad_ids:
        raise bad(f"token id {bad_ids[0]} is outside the vocabulary (size {vocab_size})", param)
    if len(ids) >= ctx_size:
        raise bad(f"This model's maximum context length is {ctx_size} tokens. However, your prompt has "
                  f"{len(ids)} tokens, which leaves no room for a completion. Please shorten it.",
                  param, "context_length_exceeded")


# -- responses ------------------------------------------------------------------------------------------

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def finish(reason: str | None) -> str | None:
    return reason if reason in ("stop", "length") else None


def chat_response(rid: str, model: str, text: str, reason: str, prompt_tokens: int, completion_tokens: int) -> dict:
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "system_fingerprint": None,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text, "refusal": None},
                         "logprobs": None, "finish_reason": finish(reason)}],
            "usage": usage(prompt_tokens, completion_tokens)}


def completion_response(rid: str, model: str, text: str, reason: str, prompt_tokens: int,
                        completion_tokens: int) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "system_fingerprint": None,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish(reason)}],
            "usage": usage(prompt_tokens, completion_tokens)}


def chat_chunk(rid: str, model: str, created: int, delta: dict, reason: str | None = None,
               with_usage: bool = False) -> dict:
    chunk = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
             "system_fingerprint": None,
             "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish(reason)}]}
    if with_usage:
        chunk["usage"] = None
    return chunk


def completion_chunk(rid: str, model: str, created: int, text: str, reason: str | None = None,
                     with_usage: bool = False) -> dict:
    chunk = {"id": rid, "object": "text_completion", "created": created, "model": model,
             "system_fingerprint": None,
             "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish(reason)}]}
    if with_usage:
        chunk["usage"] = None
    return chunk


def usage_chunk(rid: str, model: str, created: int, obj: str, prompt_tokens: int, completion_tokens: int) -> dict:
    return {"id": rid, "object": obj, "created": created, "model": model, "system_fingerprint": None,
            "choices": [], "usage": usage(prompt_tokens, completion_tokens)}
