"""The concurrency benchmark against the real llama-server, at a tiny size: straight
llama-server with two slots and kvproxy with one slot, two users at once; and
llama-batched-bench as shipped with llama-server."""
from __future__ import annotations

import pytest
import requests

from bench import batched, concurrency

pytestmark = pytest.mark.real

SETTINGS = {"turns": 2, "max_tokens": 4, "read_timeout": 300, "budget_s": 400}


def run_tiny(key: str, tmp_path) -> tuple[dict, concurrency.Mode]:
    mode = concurrency.make_mode(key, slots=2, slot_ctx=1024, workdir=tmp_path / key)
    try:
        mode.start()
        with requests.Session() as http:
            users = concurrency.build_users(http, mode.llama_url, 2, 120, 180, SETTINGS["turns"],
                                            (0.05, 0.1))
        result = concurrency.run_mode(mode, users, SETTINGS, print)
        slots = requests.get(mode.llama_url + "/slots", timeout=10).json()
    finally:
        mode.stop()
    return result, slots


@pytest.mark.timeout(600)
def test_straight_llama_server_runs_both_users_on_its_slots(tmp_path):
    result, slots = run_tiny("a", tmp_path)
    s = result["summary"]
    assert len(slots) == 2 and all(x["n_ctx"] == 1024 for x in slots)   # the last -np won
    assert s["errors"] == 0 and s["turns"] == 4 and s["ttft_later_n"] == 2
    assert s["crosstalk_turns"] == 0, result["findings"]
    assert s["minimum_tokens"] <= s["computed_tokens"]
    second = [t for t in result["turns"] if t["round"] == 1]
    assert all(t["cache_n"] > 100 for t in second)   # each continued its own first turn
    assert all(t["reuse_limit"] >= t["cache_n"] for t in result["turns"])


@pytest.mark.timeout(600)
def test_kvproxy_keeps_each_user_in_its_own_session(tmp_path):
    result, slots = run_tiny("b", tmp_path)
    s = result["summary"]
    assert len(slots) == 1
    assert s["errors"] == 0 and s["crosstalk_turns"] == 0, result["findings"]
    sessions = {}
    for t in result["turns"]:
        sessions.setdefault(t["conversation"], set()).add(t["session_header"])
    assert all(len(v) == 1 for v in sessions.values()) and len(set.union(*sessions.values())) == 2
    assert s["computed_tokens"] <= 1.1 * s["minimum_tokens"]
    assert set(s["cache_headers"]) <= {"miss", "hit", "restored", "base"}


@pytest.mark.timeout(600)
def test_batched_bench_is_shipped_and_measures(tmp_path):
    assert batched.binary() is not None
    result = batched.measure(32, 4, [1, 2], timeout=500, log=print)
    assert [r["pl"] for r in result["rows"]] == [1, 2], result.get("error")
    assert all(r["speed_tg"] > 0 and r["speed_pp"] > 0 for r in result["rows"])
