"""Nothing lost at a crash (real llama-server, kvproxy under gunicorn, SIGKILL).

Once a turn has settled, kvproxy has saved it in the background; killing llama-server,
kvproxy or both then loses none of it: the next turn is restored from the file with
every token of the last turn's prompt reused, and every file matches its sidecar.
``make bench-kill`` runs 20 such rounds and prints the figures.
"""
from __future__ import annotations

import pytest

from bench.kill import run_rounds

pytestmark = pytest.mark.real


@pytest.mark.timeout(600)
def test_a_settled_turn_survives_sigkill_of_llama_server_kvproxy_or_both(tmp_path):
    results, problems = run_rounds(tmp_path, rounds=3, cycle=True)
    assert [r.victim for r in results] == ["llama-server", "kvproxy", "both"]
    assert all(r.kept for r in results), results
    assert [r.cache for r in results] == ["restored", "hit", "restored"], results
    assert problems == []
