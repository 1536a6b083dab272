"""The server's parts without HTTP: the scheduler over a scripted SlotDecoder and over the
batched decoder (one slot and three) on a tiny model, and OpenAI request parsing."""

from __future__ import annotations

import queue
import threading
import time

import pytest
import torch

from specmemo_core.errors import RequestError, ServerBusyError, SpecMemoError
from specmemo_core.runtime.decoding import Decoder, GenerationConfig
from specmemo_core.runtime.heads import random_heads
from specmemo_core.runtime.tree import load_tree
from specmemo_core.serving import openai_format as fmt
from specmemo_core.serving.scheduler import Delta, Failed, Finished, Job, Scheduler, ServeLimits
from specmemo_core.runtime.batch import BatchDecoder
from tests.tiny import tiny_model, tiny_tokenizer

TOK = tiny_tokenizer()
TEXT = "The quick brown fox jumps over the lazy dog."


class ScriptedSlots:
    """A SlotDecoder with ``slots`` slots: every sequence emits ``script`` ``per_step`` tokens a step."""

    def __init__(self, script: list[int], *, slots: int = 1, per_step: int = 2, fail_at: int | None = None) -> None:
        self.script, self.slots, self.per_step, self.fail_at = script, slots, per_step, fail_at
        self.sent: dict[int, int] = {}
        self.removed: list[int] = []
        self.steps = 0
        self.gate = threading.Event()
        self.gate.set()

    @property
    def free_slots(self) -> int:
        return self.slots - len(self.sent)

    def add(self, seq_id, prompt_ids, *, max_new_tokens, config) -> None:
        assert self.free_slots > 0
        self.sent[seq_id] = 0

    def step(self) -> dict[int, list[int]]:
        self.gate.wait(5)
        self.steps += 1
        if self.fail_at is not None and self.steps == self.fail_at:
            raise SpecMemoError("scripted failure")
        out = {}
        for seq, n in self.sent.items():
            out[seq] = self.script[n:n + self.per_step]
            self.sent[seq] = n + len(out[seq])
        return out

    def remove(self, seq_id) -> None:
        self.removed.append(seq_id)
        self.sent.pop(seq_id, None)

    @property
    def finished(self) -> set:
        return {seq for seq, n in self.sent.items() if n >= len(self.script)}


def run_job(scheduler: Scheduler, job: Job, timeout: float = 20.0) -> tuple[str, Finished | Failed]:
    events: queue.Queue = queue.Queue()
    scheduler.submit(job, events.put)
    text = ""
    while True:
        event = events.get(timeout=timeout)
        if isinstance(event, Delta):
            text += event.text
        else:
            return text, event


def job(max_new: int = 100, stops: tuple[str, ...] = (), prompt: tuple[int, ...] = (1, 2, 3)) -> Job:
    return Job(prompt, GenerationConfig(max_new_tokens=max_new, stop_strings=stops))


@pytest.fixture
def scripted():
    slots = ScriptedSlots(TOK(TEXT).input_ids)
    scheduler = Scheduler(slots, TOK, ServeLimits(context_tokens=256, max_waiting=2))
    scheduler.start()
    yield scheduler, slots
    scheduler.stop()


def test_the_whole_script_becomes_the_reply(scripted) -> None:
    scheduler, slots = scripted
    text, end = run_job(scheduler, job())
    assert text == TEXT and isinstance(end, Finished) and end.reason == "stop"
    assert end.usage.completion_tokens == len(slots.script) and end.usage.prompt_tokens == 3
    assert slots.removed == [1] and slots.free_slots == 1


def test_a_stop_string_cuts_the_text_and_ends_the_sequence(scripted) -> None:
    scheduler, slots = scripted
    text, end = run_job(scheduler, job(stops=("brown", "lazy")))
    assert text == "The quick " and end.reason == "stop"
    assert slots.sent == {} and slots.removed == [1]  # removed at the stop, not at the script's end


def test_max_tokens_is_kept_at_the_scheduler_even_when_a_step_gives_more(scripted) -> None:
    scheduler, slots = scripted
    slots.per_step = 5
    text, end = run_job(scheduler, job(max_new=3))
    assert end.reason == "length" and end.usage.completion_tokens == 3
    assert text == TOK.decode(slots.script[:3])


def test_a_prompt_and_reply_beyond_the_kv_budget_is_refused_with_400(scripted) -> None:
    scheduler, _ = scripted
    with pytest.raises(RequestError, match="context holds 256 tokens") as info:
        scheduler.submit(job(max_new=254), lambda e: None)
    assert info.value.status == 400 and info.value.code == "context_length_exceeded"


def test_a_full_queue_is_refused_with_429_and_a_cancelled_request_frees_its_slot(scripted) -> None:
    scheduler, slots = scripted
    slots.gate.clear()  # the decoder stalls: the first request holds the slot
    first = scheduler.submit(job(), lambda e: None)
    while first.seq_id not in slots.sent:  # admitted: the thread now waits in its step
        time.sleep(0.01)
    waiting = [scheduler.submit(job(), lambda e: None) for _ in range(2)]  # the queue holds 2
    with pytest.raises(ServerBusyError) as info:
        scheduler.submit(job(), lambda e: None)
    assert info.value.status == 429
    for ticket in [first, *waiting]:
        ticket.cancel()
    slots.gate.set()
    text, end = run_job(scheduler, job())  # served as soon as the slot is free
    assert text == TEXT and isinstance(end, Finished)
    assert first.seq_id in slots.removed


def test_a_failing_step_fails_its_requests_and_the_next_one_is_served() -> None:
    slots = ScriptedSlots(TOK(TEXT).input_ids, fail_at=2)
    scheduler = Scheduler(slots, TOK, ServeLimits(context_tokens=256))
    scheduler.start()
    try:
        _, end = run_job(scheduler, job())
        assert isinstance(end, Failed) and "scripted failure" in str(end.error)
        text, end = run_job(scheduler, job())
        assert text == TEXT and isinstance(end, Finished)
    finally:
        scheduler.stop()


def batch_slots(slots: int):
    def make(model, heads, tree, capacity: int):
        return BatchDecoder(model, slots=slots, capacity=capacity + tree.num_nodes, heads=heads, tree=tree)
    return make


# The scheduler over the batched decoder with one slot (requests one after another) and three.
SLOT_DECODERS = {"one-slot": batch_slots(1), "three-slots": batch_slots(3)}


@pytest.fixture(scope="module")
def greedy_case():
    """A tiny model with random heads, prompts sharing openings, and each prompt's plain greedy reply."""
    torch.manual_seed(0)
    model = tiny_model()
    plain = Decoder(model, model.new_cache(400), None, None)
    prompts = [tuple(TOK(t).input_ids) for t in ("Hello, how are", "Hello, how are you today?", "Memory",
                                                 "The quick brown fox")]
    config = GenerationConfig(max_new_tokens=24)
    expected = [[t for s in plain.generate(list(p), config) for t in s.token_ids] for p in prompts]
    return model, random_heads(5, 64, 300, seed=7), load_tree("medusa-64"), prompts, config, expected


@pytest.mark.parametrize("kind", SLOT_DECODERS)
def test_requests_one_after_another_get_greedy_output(kind: str, greedy_case) -> None:
    """Spec == greedy through the scheduler, and a later request re-using the cache's prefix
    (or not) gets exactly what it gets alone."""
    model, heads, tree, prompts, config, expected = greedy_case
    scheduler = Scheduler(SLOT_DECODERS[kind](model, heads, tree, 400), TOK, ServeLimits(context_tokens=400))
    scheduler.start()
    try:
        for prompt, ids in zip(prompts + prompts[:1], expected + expected[:1]):
            text, end = run_job(scheduler, Job(prompt, config))
            assert text == TOK.decode(ids, skip_special_tokens=True) and end.usage.completion_tokens == len(ids)
            assert end.stats.mean_accepted >= 1.0
    finally:
        scheduler.stop()


@pytest.mark.parametrize("kind", SLOT_DECODERS)
def test_requests_submitted_together_get_what_they_get_alone(kind: str, greedy_case) -> None:
    model, heads, tree, prompts, config, expected = greedy_case
    scheduler = Scheduler(SLOT_DECODERS[kind](model, heads, tree, 400), TOK, ServeLimits(context_tokens=400))
    inboxes = [queue.Queue() for _ in prompts]
    for prompt, inbox in zip(prompts, inboxes):  # all queued before the thread starts
        scheduler.submit(Job(prompt, config), inbox.put)
    scheduler.start()
    try:
        for inbox, ids in zip(inboxes, expected):
            events = []
            while not events or isinstance(events[-1], Delta):
                events.append(inbox.get(timeout=30))
            assert "".join(e.text for e in events[:-1]) == TOK.decode(ids, skip_special_tokens=True)
            assert isinstance(events[-1], Finished) and events[-1].usage.completion_tokens == len(ids)
    finally:
        scheduler.stop()


@pytest.mark.parametrize("body, param", [
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": 3}, "temperature"),
    ({"messages": [{"role": "user", "content": "hi"}], "stop": [1, 2]}, "stop"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 2}, "n"),
])
def test_bad_chat_requests_name_the_field(body: dict, param: str) -> None:
    with pytest.raises(RequestError) as info:
        fmt.read_chat(body)
    assert info.value.param == param and info.value.status == 400


def test_chat_requests_read_as_openai_sends_them() -> None:
    parsed = fmt.read_chat({"model": "m", "messages": [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]}],
        "max_tokens": 5, "stop": "\n", "seed": 3, "stream": True, "stream_options": {"include_usage": True}})
    assert parsed.messages == ({"role": "system", "content": "be brief"}, {"role": "user", "content": "Hello"})
    assert parsed.sampling == fmt.Sampling(max_tokens=5, stop=("\n",), seed=3, stream=True, include_usage=True)
    assert fmt.read_completion({"prompt": ["once"]}).prompt == "once"
    assert fmt.read_completion({"prompt": [5, 6]}).prompt == (5, 6)


def test_a_scheduled_session_answers_as_a_chat_session_does_turn_after_turn() -> None:
    """The app's chat while it serves: same replies and messages as ChatSession over the same
    model, a message too long for the context refused with the conversation unchanged, and a
    cancelled reply kept as far as it got."""
    from specmemo_core.errors import ContextFullError
    from specmemo_core.runtime.chat import ChatSession
    from specmemo_core.serving.served import ServedModel
    from specmemo_core.serving.session import ScheduledSession

    model = tiny_model(seed=5)
    config = GenerationConfig(max_new_tokens=12)
    chat = ChatSession(Decoder(model, model.new_cache(300), None, None), TOK, frozenset({1}), "be brief")
    scheduler = Scheduler(BatchDecoder(model, slots=2, capacity=300), TOK,
                          ServeLimits(context_tokens=300))
    scheduler.start()
    try:
        session = ScheduledSession(ServedModel("tiny", TOK, scheduler, frozenset({1})), "be brief")
        for text in ("Hello, how are you?", "The quick brown fox"):
            expected = "".join(p.text for p in chat.send(text, config))
            pieces = list(session.send(text, config))
            assert "".join(p.text for p in pieces) == expected
        assert session.messages == chat.messages
        with pytest.raises(ContextFullError):
            session.send("lazy dog " * 200, config)
        assert session.messages == chat.messages
        cancel = threading.Event()
        reply = session.send("Memory budgets", GenerationConfig(max_new_tokens=150), cancel)
        next(reply)
        cancel.set()
        list(reply)
        assert session.messages[-1]["role"] == "assistant" and len(session.messages) == len(chat.messages) + 2
        deadline = time.monotonic() + 10
        while scheduler.decoder.free_slots == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert scheduler.decoder.free_slots == 1  # the cancelled reply's sequence was removed
    finally:
        scheduler.stop()
