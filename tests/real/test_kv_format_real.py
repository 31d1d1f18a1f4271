"""The KV format in the fingerprint: a llama-server restarted with other cache types is
never offered a file of the old format, and the base snapshot is made again once.

llama-server refuses a file written with other cache types or another flash-attention
setting (400 "invalid slot save file") and leaves the slot empty; ``/props`` reports
neither. kvproxy reads the format from its restore probe's file and from every file it
saves (``kvproxy/upstream/slot_file.py``).
"""
from __future__ import annotations

import openai
import pytest
import requests

from kvproxy.storage.store import SessionStore
from tests.conftest import Stack, long_text

pytestmark = pytest.mark.real

QUANTIZED = ["-fa", "on", "-ctk", "q8_0", "-ctv", "q8_0"]
SYSTEM = long_text(400, seed=7)          # about 550 tokens: a base snapshot is made
OTHER = long_text(400, seed=8)


def ask(stack, system, session, question="Name one rule."):
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0, timeout=120)
    raw = client.chat.completions.with_raw_response.create(
        model="m", max_tokens=4, temperature=0, extra_headers={"X-Session-Id": session},
        messages=[{"role": "system", "content": system}, {"role": "user", "content": question}])
    return raw.headers["X-KVProxy-Cache"], raw.parse().usage


def failed_restores(stack) -> float:
    for line in requests.get(stack.url + "/metrics", timeout=30).text.splitlines():
        if line.startswith('kvproxy_restore_misses_total{reason="failed"}'):
            return float(line.split()[-1])
    return 0.0


def formats(slot_dir) -> dict[str, str | None]:
    return {s["stem"]: (s.get("made_by") or {}).get("kv_format")
            for s in SessionStore(slot_dir).sidecars()}


def test_a_restart_with_other_cache_types_refuses_old_files_before_llama_server_sees_them(tmp_path):
    stack = Stack(tmp_path, llama_args={"extra_args": QUANTIZED}).start()
    try:
        assert ask(stack, SYSTEM, "a")[0] == "miss"      # makes the base, then a's turn
        ask(stack, OTHER, "b")                          # a is saved
        assert ask(stack, SYSTEM, "a")[0] == "restored"
        before = formats(stack.slot_dir)
        assert before and all(f and f.startswith("k=q8_0 v=q8_0") for f in before.values()), before
    finally:
        stack.stop()
    stack.llama.extra_args = []                        # f16 cache: every old file is foreign
    stack.start()
    try:
        assert "restore probe passed" in stack.proxy_log().split("k=q8_0")[-1]
        assert ask(stack, SYSTEM, "a")[0] == "miss", "a's q8_0 file is not offered"
        assert ask(stack, SYSTEM, "c")[0] == "base", "a's turn made the base again for f16"
        assert ask(stack, SYSTEM, "d")[0] == "base"
        assert failed_restores(stack) == 0, "no old file was offered to llama-server"
        log = stack.proxy_log().split("restore probe passed")[-1]
        assert "not restoring client_a" in log and "'kv_format': 'k=q8_0" in log
        after = formats(stack.slot_dir)
        remade = [stem for stem, fmt in after.items() if fmt and fmt.startswith("k=f16 v=f16")]
        assert sum(stem.startswith("base.") for stem in remade) == 1, after
        print(f"\nformats before {sorted(set(before.values()))}, after {sorted(set(map(str, after.values())))}")
    finally:
        stack.stop()
