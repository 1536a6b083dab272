"""Reliability suite: every case states its kind, for docs/reliability.md (scripts/reliability_report.py)."""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest  # noqa: E402

KINDS = {"test_bad_inputs": "bad input", "test_template": "bad input", "test_faults": "injected fault",
         "test_privacy": "privacy", "test_endurance": "endurance"}


@pytest.fixture(autouse=True)
def _one_thread_and_kind(request: pytest.FixtureRequest, record_property):
    """NOTE: one torch thread per test (restored after): the 2-core CI machine is shared."""
    import torch

    record_property("kind", KINDS.get(request.module.__name__.rsplit(".", 1)[-1], "other"))
    doc = (request.function.__doc__ or "").strip().splitlines()
    if doc:
        record_property("promise", doc[0])
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
