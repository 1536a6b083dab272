"""A conversation decoded by a served model's scheduler: what the app's chat uses while it
serves on localhost, so its replies and the served requests share one decoder, one KV
cache and one decoding thread (taking turns in the scheduler's queue).

``ScheduledSession.send`` is ``runtime.chat.ChatSession.send``'s contract: the user's
message is added, one ``TextPiece`` per step is yielded (its text may be empty), the reply
— whole, or as far as it got when ``cancel`` was set — is appended to ``messages`` when
the generator ends, and its tokens kept, so the next turn's prompt holds them as the model
wrote them (re-encoding its text can split it otherwise).
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field, replace
from typing import Iterator

from specmemo_core.errors import ContextFullError, RequestError
from specmemo_core.runtime.chat import TextPiece, Transcript
from specmemo_core.runtime.decoding import GenerationConfig
from specmemo_core.serving.scheduler import Delta, Failed, Job
from specmemo_core.serving.served import ServedModel

CANCEL_POLL_S = 0.05  # how often a reply waiting on the scheduler looks at its cancel flag


@dataclass
class ScheduledSession(Transcript):
    served: ServedModel
    system_prompt: str | None = None
    messages: list[dict[str, str]] = field(default_factory=list)
    reply_ids: dict[int, list[int]] = field(default_factory=dict)  # message index → generated ids

    def send(self, user_text: str, config: GenerationConfig | None = None,
             cancel: threading.Event | None = None) -> Iterator[TextPiece]:
        config = config or GenerationConfig()
        self._add_user(user_text)
        events: queue.Queue = queue.Queue()
        try:
            prompt = self.served.encode_messages(self.messages, self.reply_ids)
            stops = config.stop_token_ids | self.served.stop_token_ids
            ticket = self.served.scheduler.submit(Job(tuple(prompt), replace(config, stop_token_ids=stops)),
                                                  events.put)
        except RequestError as exc:
            self.messages.pop()  # refused before anything ran: the conversation stays as it was
            if exc.code == "context_length_exceeded":
                raise ContextFullError(f"This message does not fit the conversation's context: {exc}") from exc
            raise
        except BaseException:
            self.messages.pop()
            raise
        return self._stream(ticket, events, cancel)

    def _stream(self, ticket, events: queue.Queue, cancel: threading.Event | None) -> Iterator[TextPiece]:
        reply, ids = "", []
        try:
            while cancel is None or not cancel.is_set():
                try:
                    event = events.get(timeout=CANCEL_POLL_S)
                except queue.Empty:
                    continue
                if isinstance(event, Delta):
                    reply += event.text
                    ids.extend(event.step.token_ids)
                    yield TextPiece(event.text, event.step)
                elif isinstance(event, Failed):
                    raise event.error
                else:
                    return
        finally:
            ticket.cancel()  # a no-op once finished; else the sequence is freed before the next step
            self._add_reply(self.served.tokenizer, reply, ids)
