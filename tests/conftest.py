import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    """Tiny models run fastest on one thread; several threads on a shared 2-core machine thrash."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture
def cpu_drafts_ahead(monkeypatch):
    """On the CPU the speculative loop drafts after each round's commit, and caps k near the rows' max length where it
    does not run ahead, by default. Tests whose subject is rounds of the call's k drafted before the read-back (as on a
    GPU), e.g. comparing them with rounds run ahead round by round, take this."""
    from hf_specdec.generation import speculative

    monkeypatch.setattr(speculative, "CPU_DRAFTS_AFTER_COMMIT", False)
    monkeypatch.setattr(speculative, "CAPS_K", False)


@pytest.fixture(autouse=True)
def _speculative_calls_stay_speculative(monkeypatch):
    """"auto" may run a whole call as plain decoding where its timings say no k pays (on the GPU only: on a card
    the tiny models' rounds lose to plain decoding). Tests whose subject is the speculative loop must see it run,
    whatever earlier tests timed on the same model; the tests of that choice put the device back
    (tests/generation/test_plain_calls.py)."""
    from hf_specdec.generation import adaptive_k

    monkeypatch.setattr(adaptive_k, "PLAIN_CALL_DEVICES", ())
