"""Requests in, text out: a queue served by one decoding thread.

Every torch call of the server happens on the scheduler's one thread, so the web
server's event loop never waits on a forward, and the model and its KV cache are never
used by two threads at once. A request (a ``Job``) is checked against the KV budget when
it is submitted, waits in the queue until the decoder has a free slot (a waiting request
starts as soon as one frees), then advances one decoder step at a time. Its text is cut
here, at the text level: stop strings (``TextStream``) and ``max_new_tokens``. What the
request gets back — ``Delta`` pieces of text, then one ``Finished`` or ``Failed`` — is
handed to the ``deliver`` callback it was submitted with, on the scheduler's thread.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Union

import torch

from specmemo_core.errors import OutOfMemoryError, RequestError, ServerBusyError, SpecMemoError
from specmemo_core.runtime.chat import FLUSH, TextStream
from specmemo_core.runtime.decoding import GenerationConfig, ReplyStats, Step
from specmemo_core.serving.slots import SlotDecoder

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServeLimits:
    """``context_tokens``: prompt plus reply of one sequence (its KV cache slot);
    ``max_waiting``: requests that may wait for a slot before new ones get 429."""

    context_tokens: int
    max_waiting: int = 32

    def __post_init__(self) -> None:
        if self.context_tokens < 2 or self.max_waiting < 0:
            raise SpecMemoError(f"bad server limits: {self}")


@dataclass(frozen=True)
class Job:
    """One request as the scheduler sees it: prompt tokens and how to generate."""

    prompt_ids: tuple[int, ...]
    config: GenerationConfig  # max_new_tokens, sampling, stop tokens and stop strings


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class Delta:
    """One step of the reply: its tokens (``step``; none in the last, held-back tail) and the
    text that became final with them (may be empty: a character or a stop string incomplete)."""

    text: str
    step: Step


@dataclass(frozen=True)
class Finished:
    """The reply ended: ``reason`` is OpenAI's finish_reason, "stop" or "length"."""

    reason: str
    usage: Usage
    stats: ReplyStats
    queued_s: float  # waiting for a slot, before the first forward


@dataclass(frozen=True)
class Failed:
    error: SpecMemoError


Event = Union[Delta, Finished, Failed]
Deliver = Callable[[Event], None]


@dataclass(eq=False)
class Ticket:
    """A submitted job: its events go to ``deliver``; ``cancel`` ends it (a client that left)."""

    seq_id: int
    job: Job
    deliver: Deliver
    stream: TextStream
    submitted: float = field(default_factory=time.perf_counter)
    started: float = 0.0
    stats: ReplyStats = field(default_factory=ReplyStats)
    wake: Callable[[], None] = field(default=lambda: None, repr=False)  # the scheduler's: look again
    cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        """Safe from any thread: the sequence is removed before the next step."""
        self.cancelled.set()
        self.wake()


class Scheduler:
    """Owns the one decoding thread and the queue in front of a ``SlotDecoder``."""

    def __init__(self, decoder: SlotDecoder, tokenizer: Any, limits: ServeLimits) -> None:
        self.decoder = decoder
        self.tokenizer = tokenizer
        self.limits = limits
        self._ids = itertools.count(1)
        self._cond = threading.Condition()
        self._waiting: deque[Ticket] = deque()
        self._active: dict[int, Ticket] = {}  # touched by the decoding thread only
        self._stopping = False
        self._free = 0  # the decoder's free slots, as of its thread's last change
        self._thread: threading.Thread | None = None

    # -- any thread --------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._free = self.decoder.free_slots
            self._thread = threading.Thread(target=self._run, name="specmemo-serve-decoder", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """End the thread after its current step; requests still open get ``Failed``."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    def submit(self, job: Job, deliver: Deliver) -> Ticket:
        """Queue ``job``; raises ``RequestError`` (400) when it cannot fit one sequence's KV
        budget, ``ServerBusyError`` (429) when the queue is full."""
        self.check_fits(len(job.prompt_ids), job.config.max_new_tokens)
        ticket = Ticket(next(self._ids), job, deliver, TextStream(self.tokenizer, job.config.stop_strings),
                        wake=self._notify)
        with self._cond:
            if self._stopping:
                raise SpecMemoError("the server is stopping")
            waiting = sum(not t.cancelled.is_set() for t in self._waiting)
            if waiting >= self.limits.max_waiting + self._free:
                raise ServerBusyError(
                    f"the server is busy: every decoding slot is in use and {waiting} requests are "
                    "waiting; try again shortly", code="server_busy")
            self._waiting.append(ticket)
            self._cond.notify_all()
        return ticket

    def check_fits(self, prompt_tokens: int, max_new_tokens: int) -> None:
        room = self.limits.context_tokens
        if prompt_tokens + max_new_tokens > room:
            raise RequestError(
                f"this server's context holds {room} tokens per request; the prompt has {prompt_tokens} tokens "
                f"and max_tokens asks for {max_new_tokens}. Shorten the messages or ask for fewer tokens "
                f"(at most {max(room - prompt_tokens, 0)} with this prompt).",
                code="context_length_exceeded", param="messages")

    @property
    def free_slots(self) -> int:
        """Decoding slots free as the scheduler counts them (what ``submit`` admits against)."""
        with self._cond:
            return self._free

    @property
    def waiting(self) -> int:
        with self._cond:
            return len(self._waiting)

    def _notify(self) -> None:
        with self._cond:
            self._cond.notify_all()

    # -- the decoding thread ---------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and not self._waiting and not self._active:
                    self._cond.wait()
                if self._stopping:
                    break
            self._drop_cancelled()
            self._admit()
            if self._active:
                self._step()
        self._fail_all(SpecMemoError("the server stopped before this reply was finished"))

    def _drop_cancelled(self) -> None:
        with self._cond:
            kept = [t for t in self._waiting if not t.cancelled.is_set()]
            self._waiting = deque(kept)
        for ticket in [t for t in self._active.values() if t.cancelled.is_set()]:
            self._end(ticket)

    def _admit(self) -> None:
        """Waiting requests take the free slots, first come first served."""
        while self.decoder.free_slots > 0:
            with self._cond:
                if not self._waiting:
                    break
                ticket = self._waiting.popleft()
                self._free -= 1  # its slot is taken now, not once its prompt is read (``add`` prefills)
            ticket.started = time.perf_counter()
            config = ticket.job.config
            try:
                self.decoder.add(ticket.seq_id, ticket.job.prompt_ids, max_new_tokens=config.max_new_tokens,
                                 config=config)
            except Exception as exc:  # noqa: BLE001 - a sequence the decoder refuses fails alone
                self._send(ticket, Failed(exc if isinstance(exc, SpecMemoError) else
                                          SpecMemoError(f"the decoder refused the request ({exc})")))
                continue
            self._active[ticket.seq_id] = ticket
        self._count_free()

    def _count_free(self) -> None:
        with self._cond:
            self._free = self.decoder.free_slots

    def _step(self) -> None:
        t0 = time.perf_counter()
        try:
            emitted = self.decoder.step()
        except (torch.OutOfMemoryError, MemoryError) as exc:
            self._fail_active(OutOfMemoryError(f"the device ran out of memory during the reply ({exc}); "
                                            "ask for fewer tokens or restart the server with a smaller --context"))
            return
        except SpecMemoError as exc:
            self._fail_active(exc)
            return
        except Exception as exc:  # noqa: BLE001 - a bug in a step fails its requests, not the server
            log.exception("a decoding step failed")
            self._fail_active(SpecMemoError(f"the decoder failed ({type(exc).__name__}: {exc}); please report it"))
            return
        dt = time.perf_counter() - t0
        for seq_id, ticket in list(self._active.items()):
            tokens = emitted.get(seq_id)
            if tokens is not None or seq_id in self.decoder.finished:  # a sequence may end with no step of its own
                self._advance(ticket, tokens or [], dt)

    def _advance(self, ticket: Ticket, tokens: list[int], dt: float) -> None:
        """Count and cut one step's tokens; end the sequence at a stop string, at the
        token budget, or where the decoder ended it."""
        budget = ticket.job.config.max_new_tokens
        tokens = tokens[: max(budget - ticket.stats.tokens, 0)]
        text = ticket.stream.push(tuple(tokens))
        first = ticket.stats.steps == 0 and ticket.stats.prefill_s == 0.0
        step = Step(tuple(tokens), len(tokens), dt, 0, prefill=first)
        ticket.stats.add(step, text, max(time.perf_counter() - ticket.started, 1e-9))
        self._send(ticket, Delta(text, step))
        if ticket.stream.stopped:
            self._finish(ticket, "stop")
        elif ticket.stats.tokens >= budget or ticket.seq_id in self.decoder.finished:
            tail = ticket.stream.push((), final=True)
            if tail:
                ticket.stats.text += tail
                self._send(ticket, Delta(tail, FLUSH))
            self._finish(ticket, "length" if ticket.stats.tokens >= budget else "stop")

    def _finish(self, ticket: Ticket, reason: str) -> None:
        self._end(ticket)
        usage = Usage(len(ticket.job.prompt_ids), ticket.stats.tokens)
        self._send(ticket, Finished(reason, usage, ticket.stats, ticket.started - ticket.submitted))

    def _end(self, ticket: Ticket) -> None:
        """Free the slot of an active sequence (a waiting one holds none)."""
        if self._active.pop(ticket.seq_id, None) is not None:
            self.decoder.remove(ticket.seq_id)
            self._count_free()

    def _fail_active(self, error: SpecMemoError) -> None:
        """A step failed: its sequences fail; the waiting requests are served after them."""
        for ticket in list(self._active.values()):
            self._end(ticket)
            self._send(ticket, Failed(error))

    def _fail_all(self, error: SpecMemoError) -> None:
        self._fail_active(error)
        with self._cond:
            waiting, self._waiting = list(self._waiting), deque()
        for ticket in waiting:
            self._send(ticket, Failed(error))

    def _send(self, ticket: Ticket, event: Event) -> None:
        """A receiver that fails (its event loop closed) cancels its own request, never the thread."""
        try:
            ticket.deliver(event)
        except Exception:  # noqa: BLE001 - the receiver's problem; the other requests go on
            ticket.cancelled.set()
