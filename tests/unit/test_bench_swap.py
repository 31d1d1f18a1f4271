"""The swap-cost scenario's pure parts and the scaled-RAM arithmetic of the concurrency scenario."""
from __future__ import annotations

import json

import pytest

from bench import concurrency, concurrency_report, swap_cost
from bench.run import parse_args

LOG = """\
[INFO] kvproxy.switch: swap to session=abc source=derived cache=miss slot=empty restored_tokens=0 swap_ms=12.5 id_slot=0 placed=free
[INFO] kvproxy.switch: saved session abc from slot 0 in the background (3040 tokens, 40 ms)
[INFO] kvproxy.switch: swap to session=def source=derived cache=restored slot=ours restored_tokens=3050 swap_ms=21.0 id_slot=0 placed=evict
"""


def test_swap_lines_are_read_in_order():
    assert swap_cost.swap_lines(LOG) == [
        {"session": "abc", "cache": "miss", "swap_ms": 12.5},
        {"session": "def", "cache": "restored", "swap_ms": 21.0}]


def test_changed_sidecars_are_found_by_field(tmp_path):
    for stem, restores in (("a", 1), ("b", 2)):
        (tmp_path / f"{stem}.json").write_text(json.dumps(
            {"stem": stem, "kind": "session", "restores": restores, "restore_ms": 9.0,
             "save_ms": 30.0, "saved_at": "t1", "saved_bytes": 70_000_000}))
    (tmp_path / "base.json").write_text(json.dumps({"stem": "base", "kind": "base"}))
    before = swap_cost.sidecar_times(tmp_path)
    assert set(before) == {"a", "b"}
    after = {**before, "b": {**before["b"], "restores": 3, "restore_ms": 11.0}}
    assert swap_cost.changed(before, after, "restores") == [after["b"]]
    assert swap_cost.changed(before, after, "saved_at") == []


def test_summary_ratio_and_verdict():
    on = [{"swap_ms": 11.0, "restore_ms": 10.0, "save_on_path_ms": None},
          {"swap_ms": 12.0, "restore_ms": 10.0, "save_on_path_ms": None},
          {"swap_ms": 30.0, "restore_ms": 11.0, "save_on_path_ms": 18.0}]
    summary = swap_cost.summarize(on)
    assert summary == {"swaps": 3, "swap_ms": 12.0, "restore_ms": 10.0, "save_on_path_ms": 18.0,
                       "saves_on_path": 1}
    assert swap_cost.ratio(12.0, 10.0) == 1.2
    assert swap_cost.ratio(None, 10.0) is None and swap_cost.ratio(1.0, 0) is None
    summary = {**summary, "restore_call_ms": 10.5}
    record = {"runs": {"on": {"summary": summary, "file_mb": 69.0},
                       "off": {"summary": {**summary, "swap_ms": 60.0}, "file_mb": 69.0}},
              "ratio_on": 1.14, "ratio_off": 5.71, "ratio_on_inside": 1.2, "status": "PASS"}
    text = swap_cost.text_report(record)
    assert "**1.14x**" in text and "5.71x" in text and "PASS" in text
    assert "| 10.5 |" in text and "own restore time, without the round trip any call pays: 1.2x" \
        in text


def test_kv_bytes_per_token_from_a_gguf_header():
    smollm = {"general.architecture": "llama", "llama.block_count": 30,
              "llama.attention.head_count": 9, "llama.attention.head_count_kv": 3,
              "llama.embedding_length": 576}
    assert concurrency.kv_bytes_per_token(smollm) == 2 * 30 * 3 * 64 * 2 == 23040
    llama70 = {"general.architecture": "llama", "llama.block_count": 80,
               "llama.attention.head_count": 64, "llama.attention.head_count_kv": 8,
               "llama.embedding_length": 8192}
    assert concurrency.kv_bytes_per_token(llama70) == concurrency.SEVENTY_B_KV_BYTES_PER_TOKEN
    explicit = {"general.architecture": "gemma3", "gemma3.block_count": 18,
                "gemma3.attention.head_count": 4, "gemma3.attention.head_count_kv": 1,
                "gemma3.embedding_length": 640, "gemma3.attention.key_length": 256,
                "gemma3.attention.value_length": 256}
    assert concurrency.kv_bytes_per_token(explicit) == 18 * 1 * 512 * 2
    assert concurrency.kv_bytes_per_token({"general.architecture": "llama"}) is None


def test_scaled_cache_ram_holds_as_many_tokens_as_16_gib_of_a_70b_model():
    smollm = {"general.architecture": "llama", "llama.block_count": 30,
              "llama.attention.head_count": 9, "llama.attention.head_count_kv": 3,
              "llama.embedding_length": 576}
    scaled = concurrency.scaled_cache_ram(smollm, 16)
    assert scaled["tokens"] == 52428      # 16 GiB / 327,680 bytes
    assert scaled["mib"] == 1152          # 52,428.8 tokens x 23,040 bytes
    assert concurrency.scaled_cache_ram({}, 16) is None
    line = concurrency_report.scaled_line({"scaled_cache_ram": scaled})
    assert "--cache-ram 1152" in line and "52,428" in line
    assert concurrency_report.scaled_line({}) == ""


def test_cache_ram_cap_bounds_every_mode():
    assert concurrency.llama_options(True, 4, 1024, cache_ram_cap=1152)["cache_ram_mib"] == 1152
    assert concurrency.llama_options(False, 1, 1024, cache_ram_cap=1152)["cache_ram_mib"] == 1152
    # kvproxy with several slots keeps llama-server's RAM cache off
    assert concurrency.llama_options(False, 4, 1024, cache_ram_cap=1152)["cache_ram_mib"] == 0


def test_arguments_of_the_new_scenarios():
    args = parse_args(["--scenario", "swap", "--swap-tokens", "3000", "--swap-turns", "4"])
    assert (args.scenario, args.swap_tokens, args.swap_turns, args.swap_delay) == \
        ("swap", 3000, 4, 0.5)
    args = parse_args(["--scenario", "concurrency", "--cache-ram-like-70b", "16"])
    assert args.conc["cache_ram_like_gib"] == 16
    assert parse_args([]).conc["cache_ram_like_gib"] is None
    with pytest.raises(SystemExit):
        parse_args(["--scenario", "nope"])


def test_proxy_log_summary_counts_swaps_and_background_saves():
    from bench import proxy_log
    summary = proxy_log.summarize(LOG)
    assert summary["miss/free"] == {"count": 1, "total_s": 0.01, "median_ms": 12.5}
    assert summary["restored/evict"] == {"count": 1, "total_s": 0.02, "median_ms": 21.0}
    assert summary["saved behind"] == {"count": 1, "total_s": 0.04, "median_ms": 40.0}
    assert "| restored/evict | 1 | 0.02 | 21.0 |" in proxy_log.table(summary)
