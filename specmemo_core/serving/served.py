"""The model a server serves: its name, its tokenizer and chat template, its scheduler;
and how an OpenAI request becomes the scheduler's ``Job`` (prompt tokens, generation
config, checked against the KV budget before anything is queued).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from specmemo_core.errors import RequestError, UnknownModelError
from specmemo_core.runtime.chat import encode_conversation, end_of_turn_ids
from specmemo_core.runtime.decoding import GenerationConfig
from specmemo_core.runtime.token_bound import longest_token_chars
from specmemo_core.serving.openai_format import ChatRequest, CompletionRequest, Sampling
from specmemo_core.serving.scheduler import Job, Scheduler, ServeLimits
from specmemo_core.text import encodable

ALIASES = ("default",)  # model names any request may use besides the served model's own


@dataclass(frozen=True)
class Defaults:
    """What a request that leaves a field out gets."""

    max_tokens: int = 256
    temperature: float = 0.0
    system_prompt: str | None = None  # for chat requests that bring no system message


@dataclass
class ServedModel:
    """One loaded model behind the API, its requests decoded by ``scheduler``."""

    name: str
    tokenizer: Any
    scheduler: Scheduler
    stop_token_ids: frozenset[int]
    tree: str | None = None  # the speculation tree in force (None: plain decoding)
    defaults: Defaults = field(default_factory=Defaults)
    # one encoding at a time: a tokenizer reads text that holds its markers as plain text by
    # flipping a flag on the one shared tokenizer (``split_special_tokens``), so two request
    # threads encoding at once could each read the other's flag: the template's own markers
    # split into plain text, another prompt, another reply (seen with 8 concurrent clients)
    _encoding: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._longest = longest_token_chars(self.tokenizer)

    def encode_messages(self, messages: list[dict[str, str]], known_ids: dict[int, list[int]] | None = None) -> list[int]:
        """``runtime.chat.encode_conversation``, one request thread at a time."""
        with self._encoding:
            return encode_conversation(self.tokenizer, messages, known_ids)

    def encode_text(self, text: str) -> list[int]:
        with self._encoding:
            return self.tokenizer(text).input_ids

    @property
    def context_tokens(self) -> int:
        return self.scheduler.limits.context_tokens

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.name and name not in ALIASES:
            raise UnknownModelError(f"the model {name!r} is not served here: this server serves {self.name!r} "
                                    "(GET /v1/models lists it)", code="model_not_found", param="model")

    def chat_job(self, request: ChatRequest) -> Job:
        """The chat template applied to the messages (their text kept plain: markers in a
        message are not special tokens), tokenized. Slow for long prompts: not on the event loop."""
        self.check_model(request.model)
        self._check_length(sum(len(m["content"]) for m in request.messages))
        messages = [{"role": m["role"], "content": encodable(m["content"])} for m in request.messages]
        if self.defaults.system_prompt and all(m["role"] != "system" for m in messages):
            messages.insert(0, {"role": "system", "content": self.defaults.system_prompt})
        return self._job(self.encode_messages(messages), request.sampling)

    def completion_job(self, request: CompletionRequest) -> Job:
        """The prompt as it is (no chat template); token ids are taken as given."""
        self.check_model(request.model)
        if isinstance(request.prompt, tuple):
            vocab = len(self.tokenizer)
            if any(not 0 <= t < vocab for t in request.prompt):
                raise RequestError(f"prompt token ids must be from 0 to {vocab - 1}", code="invalid_value",
                                   param="prompt")
            return self._job(list(request.prompt), request.sampling)
        self._check_length(len(request.prompt))
        return self._job(self.encode_text(encodable(request.prompt)), request.sampling)

    def _check_length(self, chars: int) -> None:
        """A text far beyond the context (a 1 MB message) is refused before it is tokenized."""
        fewest = -(-chars // self._longest)
        if fewest >= self.context_tokens:
            raise RequestError(f"the prompt needs at least {fewest} tokens, but this server's context holds "
                               f"{self.context_tokens} tokens per request; shorten it",
                               code="context_length_exceeded", param="messages")

    def _job(self, prompt_ids: list[int], sampling: Sampling) -> Job:
        if not prompt_ids:
            raise RequestError("the prompt is empty", code="invalid_value", param="prompt")
        room = self.context_tokens - len(prompt_ids)
        max_tokens = sampling.max_tokens or max(min(self.defaults.max_tokens, room), 1)
        self.scheduler.check_fits(len(prompt_ids), max_tokens)
        temperature = self.defaults.temperature if sampling.temperature is None else sampling.temperature
        config = GenerationConfig(max_new_tokens=max_tokens, temperature=temperature,
                                  top_p=max(sampling.top_p, 1e-6), stop_token_ids=self.stop_token_ids,
                                  stop_strings=sampling.stop, seed=sampling.seed)
        return Job(tuple(prompt_ids), config)


def serve_engine(engine: Any, *, capacity: int, slots: int = 1, defaults: Defaults = Defaults(),
                 max_waiting: int = 32, speculate: bool = True, graphs: bool | None = None) -> ServedModel:
    """A ``runtime.engine.Engine`` (on our own forward: ``Engine.on_torch``) served through a
    ``runtime.batch.BatchDecoder`` of its own:
    ``slots`` sequences decoded together on the engine's tree, each with a KV cache of
    ``capacity`` tokens (allocated here once), CUDA graphs on CUDA; and a scheduler (not
    started) that queues requests into its free slots."""
    engine = engine.on_torch()  # batched: on our own forward, whatever ran the window's chat (runtime/ggml_step.py)
    decoder = engine.new_batch_decoder(capacity, slots=slots, speculate=speculate, graphs=graphs)
    scheduler = Scheduler(decoder, engine.tokenizer, ServeLimits(context_tokens=capacity, max_waiting=max_waiting))
    tree_name = decoder.tree.name if decoder.tree is not None else None
    return ServedModel(engine.identity.name, engine.tokenizer, scheduler,
                       end_of_turn_ids(engine.tokenizer, engine.config), tree_name, defaults)
