"""OpenAI's JSON, in and out: request bodies read into checked dataclasses, replies and
stream chunks written as the ``openai`` client expects them. No I/O, no model here.

Fields SpecMemo does not implement (tools, logprobs, n > 1) are refused with a message
rather than silently ignored; other unknown fields are ignored, as OpenAI-compatible
servers do. Every reply carries one extra field, ``"specmemo"``: its decoding speed, the
mean tokens per step, and the speculation tree.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from specmemo_core.errors import RequestError
from specmemo_core.serving.scheduler import Finished, Usage

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
MAX_STOP_STRINGS = 16


@dataclass(frozen=True)
class Sampling:
    """The sampling fields both endpoints share. ``max_tokens``, ``temperature`` None: the
    server's defaults (``specmemo serve --max-new-tokens``, ``--temperature``)."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int = 0
    stream: bool = False
    include_usage: bool = False


@dataclass(frozen=True)
class ChatRequest:
    model: str | None
    messages: tuple[dict[str, str], ...]
    sampling: Sampling


@dataclass(frozen=True)
class CompletionRequest:
    model: str | None
    prompt: str | tuple[int, ...]  # text, or token ids
    sampling: Sampling


def _bad(message: str, param: str | None = None, code: str | None = "invalid_value") -> RequestError:
    return RequestError(message, code=code, param=param)


def _number(body: dict, name: str, default: float | None, low: float, high: float) -> float | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise _bad(f"{name} must be a number from {low:g} to {high:g}, got {value!r}", name)
    return float(value)


def _max_tokens(body: dict) -> int | None:
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _bad(f"{name} must be a whole number of at least 1, got {value!r}", name)
    return value


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops) or len(stops) > MAX_STOP_STRINGS:
        raise _bad(f"stop must be a string or a list of at most {MAX_STOP_STRINGS} strings", "stop")
    return tuple(s for s in stops if s)


def _refuse_unsupported(body: dict) -> None:
    if body.get("n") not in (None, 1):
        raise _bad("this server makes one choice per request: leave n out or set it to 1", "n", "unsupported_value")
    if body.get("tools") or body.get("functions"):
        raise _bad("this server does not call tools or functions", "tools", "unsupported_parameter")
    if body.get("logprobs") not in (None, False, 0):
        raise _bad("this server does not return log probabilities", "logprobs", "unsupported_parameter")
    if body.get("best_of") not in (None, 1):
        raise _bad("this server makes one choice per request: leave best_of out or set it to 1", "best_of",
                   "unsupported_value")
    if body.get("echo") or body.get("suffix"):
        raise _bad("this server neither echoes the prompt nor fills in a suffix", "echo", "unsupported_parameter")


def read_sampling(body: dict) -> Sampling:
    """The sampling fields of a chat or completion request, checked."""
    _refuse_unsupported(body)
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise _bad(f"seed must be a whole number, got {seed!r}", "seed")
    stream = body.get("stream") or False
    options = body.get("stream_options") or {}
    if not isinstance(stream, bool) or not isinstance(options, dict):
        raise _bad("stream must be true or false, and stream_options an object", "stream")
    return Sampling(max_tokens=_max_tokens(body), temperature=_number(body, "temperature", None, 0.0, 2.0),
                    top_p=_number(body, "top_p", 1.0, 0.0, 1.0), stop=_stop(body.get("stop")),
                    seed=(seed or 0) % 2**63, stream=stream, include_usage=bool(options.get("include_usage")))


def _model(body: dict) -> str | None:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad(f"model must be a string, got {model!r}", "model")
    return model


def _content(content: Any, index: int) -> str:
    """A message's text: a string, or a list of text parts (OpenAI's content parts)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        if any(p.get("type") != "text" or not isinstance(p.get("text"), str) for p in content):
            raise _bad(f"messages[{index}]: this server reads text only (no images, audio or files)",
                       f"messages[{index}].content", "unsupported_value")
        return "".join(p["text"] for p in content)
    raise _bad(f"messages[{index}].content must be a string or a list of text parts", f"messages[{index}].content")


def read_chat(body: Any) -> ChatRequest:
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object", None, "invalid_json")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages must be a non-empty list of {role, content} objects", "messages")
    read = []
    for i, m in enumerate(messages):
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ROLES:
            raise _bad(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {role!r}", f"messages[{i}].role")
        read.append({"role": ROLES[role], "content": _content(m.get("content"), i)})
    return ChatRequest(_model(body), tuple(read), read_sampling(body))


def read_completion(body: Any) -> CompletionRequest:
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object", None, "invalid_json")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # one prompt in a list
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        prompt = tuple(prompt)
    elif not isinstance(prompt, str) or not prompt:
        raise _bad("prompt must be a non-empty string (or one list of token ids)", "prompt")
    return CompletionRequest(_model(body), prompt, read_sampling(body))


# -- out -------------------------------------------------------------------------------

@dataclass(frozen=True)
class ReplyHeader:
    """What every chunk and reply of one request repeats."""

    id: str
    model: str
    created: int
    chat: bool  # chat.completion(.chunk), else text_completion

    @classmethod
    def new(cls, model: str, chat: bool) -> "ReplyHeader":
        prefix = "chatcmpl-" if chat else "cmpl-"
        return cls(prefix + uuid.uuid4().hex[:24], model, int(time.time()), chat)

    def envelope(self, kind: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}


def usage_json(usage: Usage) -> dict:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens}


def specmemo_json(finished: Finished, tree: str | None) -> dict:
    """The extra field: how the reply was decoded."""
    stats = finished.stats
    return {"tokens_per_s": round(stats.tokens_per_s, 3), "mean_accepted": round(stats.mean_accepted, 3),
            "tree": tree, "prefill_s": round(stats.prefill_s, 4), "queued_s": round(finished.queued_s, 4)}


def reply_json(header: ReplyHeader, text: str, finished: Finished, tree: str | None) -> dict:
    """The whole reply of a request that did not stream."""
    if header.chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finished.reason}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finished.reason}
    out = header.envelope("chat.completion" if header.chat else "text_completion", [choice])
    out.update(usage=usage_json(finished.usage), specmemo=specmemo_json(finished, tree))
    return out


def chunk_json(header: ReplyHeader, text: str | None, *, reason: str | None = None, role: bool = False) -> dict:
    """One stream chunk: a piece of text (``role``: the first chunk names the assistant), or
    the end (``reason``)."""
    if header.chat:
        delta: dict[str, str] = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
    return header.envelope("chat.completion.chunk" if header.chat else "text_completion", [choice])


def usage_chunk_json(header: ReplyHeader, finished: Finished, tree: str | None) -> dict:
    """The last chunk of a stream asked for with ``stream_options.include_usage``: no choices."""
    out = header.envelope("chat.completion.chunk" if header.chat else "text_completion", [])
    out.update(usage=usage_json(finished.usage), specmemo=specmemo_json(finished, tree))
    return out


def error_json(error: Exception) -> dict:
    """``{"error": {"message", "type", "param", "code"}}``, as OpenAI's errors read."""
    if isinstance(error, RequestError):
        return {"error": {"message": str(error), "type": error.kind, "param": error.param, "code": error.code}}
    return {"error": {"message": str(error), "type": "server_error", "param": None, "code": None}}
