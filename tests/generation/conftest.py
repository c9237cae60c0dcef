"""Fixtures shared by the speculative loop's tests."""

import pytest

from hf_specdec.generation import speculative


@pytest.fixture
def cpu_drafts_ahead(monkeypatch):
    """On the CPU the loop drafts after each round's commit, and caps k near the rows' max length where it does not run
    ahead, by default. Tests that compare rounds drafted ahead (before the read-back) with rounds drafted after the
    commit, round by round, take this: the CPU drafts ahead as a GPU does, every round at the call's k."""
    monkeypatch.setattr(speculative, "CPU_DRAFTS_AFTER_COMMIT", False)
    monkeypatch.setattr(speculative, "CAPS_K", False)
