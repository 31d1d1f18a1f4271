"""A small soak (``make soak`` runs the long one): 32 clients over 8 sessions, all three
APIs, two kvproxy processes on one slot folder and one llama-server."""
from __future__ import annotations

import pytest

from bench import soak

pytestmark = pytest.mark.real


@pytest.mark.timeout(900)
def test_small_soak_holds(tmp_path, capsys):
    config = soak.Config(clients=32, sessions=8, seconds=40)
    with capsys.disabled():  # the figures show in the test output
        report = soak.run(config, tmp_path)
    figures = report["summary"]
    assert report["problems"] == []
    assert figures["answered"] >= 20
    assert set(figures["by_api"]) == {"openai", "anthropic", "ollama"}
    assert figures["disconnected"] > 0 and figures["streamed"] > 0
