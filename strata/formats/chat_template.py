"""Rendering a model's Jinja chat template the way transformers does.

A prompt the model was not trained on (an extra newline, a missing BOS) quietly degrades output,
so the environment mirrors `transformers.utils.chat_template_utils`: a sandbox (templates come from
model files, i.e. untrusted), `trim_blocks` + `lstrip_blocks`, `loopcontrols`, a `tojson` that does not
HTML-escape, `raise_exception` and `strftime_now`, and a `{% generation %}` tag that just renders its body.

Models without a template: `render_chat` raises `StrataError` unless `fallback="chatml"` is given,
which renders `CHATML_TEMPLATE` (`<|im_start|>role\\ncontent<|im_end|>\\n` per message). ChatML only
helps models trained on it; for others it is a plain-text convention the model may or may not follow.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import numpy as np
from jinja2.sandbox import ImmutableSandboxedEnvironment

from strata.errors import StrataError

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

FALLBACKS = {"chatml": CHATML_TEMPLATE}


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant spans for training masks; we only render it."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


class _Namespace(jinja2.utils.Namespace):
    """`namespace()` that refuses underscore names, so templates cannot reach Python internals through it."""

    def __init__(*args, **kwargs):  # same signature trick as jinja2's Namespace
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat template set namespace attribute {name!r}")


class _TemplateDict:
    """`dict(...)` for templates without exposing the `dict` type itself."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


@lru_cache(maxsize=32)
def compile_template(source: str) -> jinja2.Template:
    """Compiled once per distinct template text; rendering is then cheap per request."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    env.globals["dict"] = _TemplateDict()
    return env.from_string(source)


def _plain(value: Any) -> Any:
    """Rebuild inputs from JSON-like types so the sandbox never sees arbitrary objects' methods."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, np.generic):  # np.bool_(False) must not become a truthy placeholder
        return _plain(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):  # pydantic, e.g. OpenAI SDK messages
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _normalize_messages(messages) -> list[dict]:
    """Drop None-valued keys (OpenAI clients send `content=None`; templates print "None") and alias reasoning."""
    out = []
    for message in _plain(list(messages)):
        if not isinstance(message, dict):
            raise StrataError(f"chat message {message!r} is not an object", "send messages as {role, content} objects")
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in ("reasoning_content", "thinking", "reasoning") if k in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def render_chat(
    template: str | None,
    messages,
    *,
    add_generation_prompt: bool = True,
    tools: list[dict] | None = None,
    documents: list[dict] | None = None,
    special_tokens: Mapping[str, str] | None = None,
    fallback: str | None = None,
    **kwargs,
) -> str:
    """The prompt text for `messages` (not tokenized; the template writes BOS itself when the model wants it).

    `special_tokens` (bos_token, eos_token, ...) are visible to the template; `kwargs` override them.
    """
    if template is None:
        if fallback is None:
            raise StrataError(
                "this model has no chat template",
                "use raw completion, pass a Jinja template, or choose the 'chatml' fallback",
            )
        if fallback not in FALLBACKS:
            raise StrataError(f"unknown chat template fallback {fallback!r}", f"use one of {sorted(FALLBACKS)}")
        template = FALLBACKS[fallback]
    variables = {**(special_tokens or {}), **_plain(kwargs)}
    try:
        return compile_template(template).render(
            messages=_normalize_messages(messages),
            tools=_plain(tools),
            documents=_plain(documents),
            add_generation_prompt=add_generation_prompt,
            **variables,
        )
    except jinja2.exceptions.TemplateError as e:
        raise StrataError(f"the chat template rejected this conversation: {e}", None) from e
