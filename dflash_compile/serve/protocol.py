"""The OpenAI wire format: request bodies checked field by field, errors, and the response and chunk objects.

Every field a request may carry is listed here. A field the server does not know, or an OpenAI field it does not
implement set to anything but its neutral value (``logprobs``, ``echo``, penalties, tools, ...), is a 400 naming
it, as OpenAI's own API refuses unrecognised arguments: nothing is ignored silently.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass
from typing import Any

MAX_STOP_STRINGS = 16


class APIError(Exception):
    """An HTTP error with OpenAI's error body ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(param: str | None, message: str, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


@dataclass(frozen=True)
class SamplingParams:
    """What one request asks of the model. ``max_tokens`` None: up to the capacity (chat's default)."""

    max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]

    def generate_kwargs(self, max_new_tokens: int) -> dict:
        """``submit``'s generation arguments: temperature 0 is greedy (``target.generate``'s tokens)."""
        if self.temperature == 0:
            return dict(max_new_tokens=max_new_tokens, do_sample=False)
        return dict(max_new_tokens=max_new_tokens, do_sample=True, temperature=self.temperature, top_p=self.top_p,
                    top_k=self.top_k, seed=self.seed)


@dataclass(frozen=True)
class ParsedRequest:
    """A checked request: ``prompt`` is text or token ids (completions) or None (chat: ``messages``);
    ``max_tokens_field`` names the field that set ``params.max_tokens`` (for errors)."""

    chat: bool
    model: str | None
    prompt: str | list[int] | None
    messages: list[dict] | None
    params: SamplingParams
    stream: bool
    include_usage: bool
    max_tokens_field: str = "max_tokens"


# Fields every generation request takes, and OpenAI fields that are accepted only at their neutral value.
_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "stream_options", "n",
           "user", "presence_penalty", "frequency_penalty", "logit_bias"}
_COMPLETION = _COMMON | {"prompt", "best_of", "echo", "logprobs", "suffix"}
_CHAT = _COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools", "tool_choice",
                   "parallel_tool_calls", "response_format", "functions", "function_call"}
_NEUTRAL = {  # field -> the values that mean "not used"
    "presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0), "logit_bias": ({},), "best_of": (1,),
    "echo": (False,), "suffix": ("",), "top_logprobs": (0,), "tools": ([],), "functions": ([],),
    "tool_choice": ("none",), "parallel_tool_calls": (False, True), "function_call": ("none",),
    "logprobs": (False, 0), "response_format": ({"type": "text"},),
}


def parse_body(raw: bytes) -> dict:
    """The request body as a JSON object, or a 400."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise invalid(None, f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise invalid(None, f"the request body must be a JSON object, got {_kind(body)}")
    return body


def parse_request(body: dict, chat: bool) -> ParsedRequest:
    """Check every field of a ``/v1/completions`` or ``/v1/chat/completions`` body (400 on the first bad one)."""
    known = _CHAT if chat else _COMPLETION
    unknown = sorted(set(body) - known)
    if unknown:
        raise invalid(unknown[0], f"unrecognized request argument(s): {', '.join(unknown)}")
    for name, neutral in _NEUTRAL.items():  # fields of the other route were refused as unknown above
        if body.get(name) is not None and body[name] not in neutral:
            raise invalid(name, f"{name}={json.dumps(body[name])} is not supported by this server")
    model = _optional(body, "model", str, "a string")
    if _integer(body, "n", 1) != 1:
        raise invalid("n", f"n must be 1 (one choice per request), got {body['n']}")
    if chat:
        messages, prompt = _messages(body), None
        max_tokens = _integer(body, "max_completion_tokens", None)
        if max_tokens is None:
            max_tokens = _integer(body, "max_tokens", None)
        tokens_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    else:
        messages, prompt = None, _prompt(body)
        max_tokens, tokens_name = _integer(body, "max_tokens", 16), "max_tokens"
    if max_tokens is not None and max_tokens < 1:
        raise invalid(tokens_name, f"{tokens_name} must be at least 1, got {max_tokens}")
    temperature = _number(body, "temperature", 1.0)
    if temperature < 0:
        raise invalid("temperature", f"temperature must be >= 0 (0: greedy), got {temperature}")
    top_p = _number(body, "top_p", 1.0)
    if not 0 < top_p <= 1:
        raise invalid("top_p", f"top_p must be in (0, 1], got {top_p}")
    top_k = _integer(body, "top_k", 0)
    if top_k < -1:
        raise invalid("top_k", f"top_k must be -1 or 0 (off) or a positive integer, got {top_k}")
    seed = _integer(body, "seed", None)
    stream = _optional(body, "stream", bool, "a boolean") or False
    options = _optional(body, "stream_options", dict, "an object") or {}
    if options and not stream:
        raise invalid("stream_options", "stream_options is only allowed with stream=true")
    if set(options) - {"include_usage"} or not isinstance(options.get("include_usage", False), bool):
        raise invalid("stream_options", f"stream_options supports only include_usage (a boolean), got "
                                        f"{json.dumps(options)}")
    params = SamplingParams(max_tokens, temperature, top_p, max(top_k, 0), seed, _stop(body))
    return ParsedRequest(chat, model, prompt, messages, params, stream, options.get("include_usage", False),
                         tokens_name)


def _kind(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number")


def _optional(body: dict, name: str, kind: type, wanted: str):
    value = body.get(name)
    if value is not None and not isinstance(value, kind):
        raise invalid(name, f"{name} must be {wanted}, got {_kind(value)}")
    return value


def _integer(body: dict, name: str, default: int | None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(name, f"{name} must be an integer, got {_kind(value)} {json.dumps(value)}")
    return value


def _number(body: dict, name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise invalid(name, f"{name} must be a finite number, got {_kind(value)} {json.dumps(value)}")
    return float(value)


def _prompt(body: dict) -> str | list[int]:
    """One prompt: a string or a list of token ids (a list holding exactly one of either is accepted too)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise invalid("prompt", f"one prompt per request, got {len(prompt)}: send each as its own request")
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not prompt:
            raise invalid("prompt", "the prompt is empty")
        return prompt
    if not isinstance(prompt, str):
        raise invalid("prompt", f"prompt must be a string or a list of token ids, got {_kind(prompt)}")
    if not prompt:
        raise invalid("prompt", "the prompt is empty")
    return prompt


def _messages(body: dict) -> list[dict]:
    """Chat messages with text content (a string, or a list of ``{"type": "text", "text": ...}`` parts joined)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", f"messages must be a non-empty array, got {_kind(messages)}")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not m["role"]:
            raise invalid(where, f"{where} must be an object with a string role")
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise invalid(f"{where}.content", f"{where}.content: only text parts are supported "
                                                      f'({{"type": "text", "text": "..."}})')
                parts.append(part["text"])
            content = "".join(parts)
        if not isinstance(content, str):
            raise invalid(f"{where}.content", f"{where}.content must be a string or text parts, got {_kind(content)}")
        extra = {k: v for k, v in m.items() if k not in ("role", "content")}
        if set(extra) - {"name"}:
            raise invalid(where, f"{where}: fields {sorted(set(extra) - {'name'})} are not supported")
        out.append({**extra, "role": m["role"], "content": content})
    return out


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise invalid("stop", f"stop must be a non-empty string or an array of them, got {json.dumps(stop)}")
    if len(stops) > MAX_STOP_STRINGS:
        raise invalid("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
    return tuple(dict.fromkeys(stops))


# ---------------------------------------------------------------------------------------------- responses
class Reply:
    """The response objects of one request: the whole completion, or its stream of chunks."""

    def __init__(self, chat: bool, model: str):
        self.chat, self.model = chat, model
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self._first = True

    def _head(self, chunk: bool) -> dict:
        kind = ("chat.completion" if self.chat else "text_completion") + (".chunk" if chunk and self.chat else "")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def completion(self, text: str, finish_reason: str, usage: dict) -> dict:
        choice = {"index": 0, "finish_reason": finish_reason, "logprobs": None}
        choice.update({"message": {"role": "assistant", "content": text}} if self.chat else {"text": text})
        return {**self._head(False), "choices": [choice], "usage": usage}

    def chunk(self, text: str, finish_reason: str | None = None) -> dict:
        choice = {"index": 0, "finish_reason": finish_reason, "logprobs": None}
        if self.chat:
            delta = {"role": "assistant", "content": text} if self._first else ({"content": text} if text else {})
            choice["delta"] = delta
        else:
            choice["text"] = text
        self._first = False
        return {**self._head(True), "choices": [choice]}

    def usage_chunk(self, usage: dict) -> dict:
        return {**self._head(True), "choices": [], "usage": usage}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def sse(data: dict | str) -> bytes:
    """One server-sent event: ``data: <json>\\n\\n`` (``[DONE]`` as is)."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()
