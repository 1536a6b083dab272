"""Endurance: 1,000 turns through the app's worker and the real core, the context overflowing hundreds of times."""

from __future__ import annotations

import gc
import time
from pathlib import Path

import psutil

from app.runtime import EngineBackend
from app.worker import ChatWorker, Job
from specmemo_core.storage.chatstore import ChatStore
from specmemo_core.runtime.decoding import GenerationConfig
from specmemo_core.runtime.engine import Engine
from specmemo_core.storage.sources import ModelIdentity
from tests.tiny import tiny_config, tiny_model, tiny_tokenizer

TURNS = 1000
CAPACITY = 256  # KV tokens: a few turns fit; once full, every new turn pushes the oldest out of the context
RSS_SLACK = 24 * 2**20  # bytes the process may still grow between turn 100 and turn 1000


def _user_text(turn: int) -> str:
    words = ["speculative", "decoding", "memory", "budget", "tree", "heads", "verify", "cache", "fox", "dog"]
    return f"turn {turn}: " + " ".join(words[(turn * 7 + i) % len(words)] for i in range(2 + turn % 9))


def test_a_thousand_turns(qapp, tmp_path: Path) -> None:
    """1,000 turns, context overflowing hundreds of times: no crash, RSS stops growing, every turn saved."""
    tok = tiny_tokenizer()
    engine = Engine(tiny_model(), tok, tiny_config(), ModelIdentity("tiny", "0" * 16), None, None)
    worker = ChatWorker()
    worker.configure(EngineBackend(engine), CAPACITY, False)
    finished, failed, trimmed = [], [], []
    worker.finished.connect(finished.append)
    worker.failed.connect(lambda *a: failed.append(a))
    worker.context_trimmed.connect(trimmed.append)
    store = ChatStore(tmp_path / "history.sqlite3")
    conv = store.create("endurance")
    history: list[dict[str, str]] = []
    config = GenerationConfig(max_new_tokens=8)
    process = psutil.Process()
    rss: dict[int, int] = {}
    started = time.perf_counter()
    for turn in range(1, TURNS + 1):
        text = _user_text(turn)
        worker.generate(Job(conv.id, list(history), text, config))  # direct call: runs here, signals direct
        assert not failed, failed
        assert len(finished) == turn
        reply = finished[-1].text
        store.add_message(conv.id, "user", text)
        store.add_message(conv.id, "assistant", reply, stats=finished[-1].as_dict())
        history += [{"role": "user", "content": text}, {"role": "assistant", "content": reply}]
        if turn in (100, TURNS):
            gc.collect()
            rss[turn] = process.memory_info().rss
    seconds = time.perf_counter() - started
    overflows = sum(1 for a, b in zip([0] + trimmed, trimmed) if b > a)  # turns that pushed old turns out
    print(f"\n{TURNS} turns in {seconds:.1f} s; the context overflowed {overflows} times; "
          f"RSS {rss[100] / 2**20:.1f} MiB at turn 100, {rss[TURNS] / 2**20:.1f} MiB at turn {TURNS}")
    assert overflows > 100 and trimmed[-1] > TURNS // 2  # the budget overflowed many times; most turns left it
    assert rss[TURNS] - rss[100] < RSS_SLACK
    saved = store.messages(conv.id)
    assert len(saved) == 2 * TURNS
    assert [(m.role, m.content) for m in saved] == [(m["role"], m["content"]) for m in history]
    store.close()
