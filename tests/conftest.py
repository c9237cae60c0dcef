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
