"""The engine's client interface (engine/client.py): an ABC whose methods are all abstract (no body
that reads a subclass's fields), and LocalClient implements every one of them."""
from __future__ import annotations

import pytest

from engine.client import EngineClient, LocalClient

INTERFACE = {"submit", "last_prompt_ids", "stream", "abort", "status", "close"}


def test_engine_client_declares_the_narrow_interface_abstract():
    assert EngineClient.__abstractmethods__ == INTERFACE


def test_a_client_missing_one_method_cannot_be_made():
    class NoPromptIds(EngineClient):
        def submit(self, messages, params): return 0
        def stream(self, request_id, timeout=None): yield from ()
        def abort(self, request_id): pass
        def status(self): return {}
        def close(self): pass

    with pytest.raises(TypeError, match="last_prompt_ids"):
        NoPromptIds()


def test_local_client_implements_every_method():
    assert not LocalClient.__abstractmethods__
    for name in INTERFACE:
        assert getattr(LocalClient, name) is not getattr(EngineClient, name), name
