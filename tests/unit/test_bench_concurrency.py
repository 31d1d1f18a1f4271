"""The concurrency benchmark's pure parts: percentiles, the minimum prompt tokens, cross-talk
detection, targets, the llama-server options of each mode and llama-batched-bench parsing."""
from __future__ import annotations

import json

import pytest

from bench import batched, concurrency
from bench import concurrency_stats as stats
from bench.run import parse_args


def turn(conv, rnd, sent, finished, tokens, reply=(), prompt_n=None, cache_n=0, session=None,
         predicted_n=None, status=200, ttft=0.1):
    tokens = list(tokens)
    return {"conversation": conv, "round": rnd, "sent_s": sent, "finished_s": finished,
            "tokens": tokens, "history": tokens + list(reply), "ttft_s": ttft,
            "prompt_n": len(tokens) - cache_n if prompt_n is None else prompt_n,
            "cache_n": cache_n, "predicted_n": len(reply) if predicted_n is None else predicted_n,
            "status": status, "error": None, "session_header": session, "cache_header": None}


# A shared template opening (1, 2), then each conversation's own text.
A1 = [1, 2, 10, 11, 12, 13]
A2 = A1 + [20, 21, 30, 31]          # A1, its reply (20, 21), the next question (30, 31)
B1 = [1, 2, 50, 51, 52]


def test_percentile_interpolates_and_handles_edges():
    assert stats.percentile([], 50) is None
    assert stats.percentile([3.0], 95) == 3.0
    assert stats.percentile([1, 2, 3, 4], 50) == pytest.approx(2.5)
    assert stats.percentile(list(range(1, 21)), 95) == pytest.approx(19.05)
    assert stats.percentile([5, 1, 3], 100) == 5


def test_minimum_counts_each_conversations_new_tokens_once():
    turns = [turn("A", 0, 0.0, 1.0, A1, reply=[20, 21], ttft=0.5),
             turn("B", 0, 0.0, 2.0, B1, reply=[60], ttft=0.9),
             turn("A", 1, 1.5, 3.0, A2)]
    # B1's prompt was computed after A1's: it reuses the shared opening (1, 2).
    # A2 reuses A1 plus its reply: only the question is new.
    assert stats.minimum_new_tokens(turns) == [6, 3, 2]


def test_minimum_reuses_only_what_was_computed_before_the_turns_first_token():
    a1 = turn("A", 0, 0.0, 5.0, A1, reply=[20, 21], ttft=3.0)
    a2 = turn("A", 1, 1.0, 6.0, A2, ttft=1.0)
    # A2's first token (at 2.0) came before A1's prompt was computed (3.0): nothing to reuse.
    assert stats.minimum_new_tokens([a1, a2])[1] == len(A2)
    a2["ttft_s"] = 2.5   # at 3.5 A1's prompt was there, its reply not yet
    assert stats.minimum_new_tokens([a1, a2])[1] == len(A2) - len(A1)


def test_minimum_is_at_least_one_token():
    turns = [turn("A", 0, 0.0, 1.0, A1, reply=[20]), turn("A", 1, 2.0, 3.0, A1)]
    assert stats.minimum_new_tokens(turns) == [6, 1]


def test_honest_reuse_is_not_crosstalk():
    turns = [turn("A", 0, 0.0, 1.0, A1, reply=[20, 21], session="s-a"),
             turn("B", 0, 0.0, 1.0, B1, cache_n=2, reply=[60], session="s-b"),  # shared opening
             turn("A", 1, 2.0, 3.0, A2, cache_n=len(A1) + 2, session="s-a")]
    assert stats.crosstalk(turns, proxied=True) == []


def test_reuse_of_generated_tokens_counts_by_number():
    # The reply's text re-tokenized as 99 differs from the generated token; llama-server
    # may still have reused the generated one.
    a1 = turn("A", 0, 0.0, 1.0, A1, reply=[99], predicted_n=2)
    a2 = turn("A", 1, 2.0, 3.0, A2, cache_n=len(A1) + 2)
    assert stats.reuse_limit(a2, [a1, a2]) == len(A1) + 2
    assert stats.crosstalk([a1, a2], proxied=False) == []


def test_reuse_beyond_anything_computed_is_crosstalk():
    turns = [turn("A", 0, 0.0, 1.0, A1, reply=[20, 21]),
             turn("B", 0, 1.0, 2.0, B1, cache_n=4)]   # B shares only (1, 2) with anything
    found = stats.crosstalk(turns, proxied=False)
    assert [(f["conversation"], f["kind"]) for f in found] == [("B", "reuse")]
    assert "at most 2" in found[0]["detail"]


def test_a_later_turn_of_the_same_conversation_does_not_excuse_reuse():
    a1 = turn("A", 0, 0.0, 1.0, A1, cache_n=5)
    a2 = turn("A", 1, 2.0, 3.0, A2, cache_n=len(A1))
    assert [f["round"] for f in stats.crosstalk([a1, a2], proxied=False)] == [0]


def test_own_system_snapshot_is_honest_reuse():
    a1 = turn("A", 0, 0.0, 1.0, A1, cache_n=4)
    assert stats.crosstalk([a1], proxied=False)[0]["kind"] == "reuse"
    a1["own_base"] = A1[:4] + [7]
    assert stats.crosstalk([a1], proxied=False) == []


def test_prompt_length_mismatch_is_crosstalk():
    t = turn("A", 0, 0.0, 1.0, A1, prompt_n=9)
    assert [f["kind"] for f in stats.crosstalk([t], proxied=False)] == ["length"]


def test_failed_turns_are_not_judged_for_reuse():
    t = turn("A", 0, 0.0, 1.0, A1, cache_n=5, status=503)
    assert stats.crosstalk([t], proxied=False) == []


def test_session_header_changes_shares_and_absence_are_found():
    turns = [turn("A", 0, 0, 1, A1, session="s-a"), turn("A", 1, 2, 3, A2, cache_n=6, session="s-x"),
             turn("B", 0, 0, 1, B1, session="s-x"), turn("C", 0, 0, 1, [1, 2, 70], session=None)]
    found = stats.crosstalk(turns, proxied=True)
    kinds = {(f["conversation"], f["round"]) for f in found if f["kind"] == "session"}
    assert kinds == {("A", 1), ("B", 0), ("C", 0)}
    assert stats.crosstalk(turns, proxied=False) == []   # straight llama-server sends none


def summary(ttft95, wall, computed=100, minimum=100, crosstalk=0, errors=0):
    return {"ttft_later_p95_s": ttft95, "wall_seconds": wall, "computed_tokens": computed,
            "minimum_tokens": minimum, "computed_over_minimum": computed / minimum,
            "crosstalk_turns": crosstalk, "crosstalk_conversations": ["U1"] if crosstalk else [],
            "crosstalk_kinds": {"reuse": crosstalk} if crosstalk else {}, "errors": errors}


def test_summarize_uses_turns_after_the_first_and_adds_snapshot_tokens():
    turns = [turn("A", 0, 0, 1, A1, reply=[1, 2], ttft=9.0),
             turn("A", 1, 2, 3, A2, cache_n=8, reply=[5], ttft=0.5),
             turn("B", 1, 2, 4, B1, reply=[5, 6, 7], ttft=1.5)]
    s = stats.summarize(turns, 10.0, minimum=12, extra_computed=3)
    assert s["ttft_later_n"] == 2 and s["ttft_later_p50_s"] == pytest.approx(1.0)
    assert s["ttft_first_max_s"] == pytest.approx(9.0), "the slowest first turn, not a later one"
    assert s["computed_tokens"] == 6 + 2 + 5 + 3
    assert s["generated_per_s"] == pytest.approx(0.6)
    assert s["computed_over_minimum"] == pytest.approx(16 / 12)


def test_in_flight_time_is_the_union_of_the_turns_spans():
    turns = [turn("A", 0, 0.0, 4.0, A1), turn("B", 0, 1.0, 3.0, B1),   # B inside A
             turn("A", 1, 3.5, 6.0, A2),                              # overlaps A's end
             turn("B", 1, 8.0, 9.5, B1)]                              # after 2 s of thinking
    assert stats.in_flight_seconds(turns) == pytest.approx(6.0 + 1.5)
    assert stats.summarize(turns, 9.5, minimum=1)["in_flight_seconds"] == pytest.approx(7.5)
    assert stats.in_flight_seconds([]) == 0.0


def test_targets_pass_and_fail_on_the_measured_figures():
    groups = [{"users": 4, "summaries": {"b": summary(3.0, 100), "c": summary(0.9, 70)}},
              {"users": 8, "summaries": {"b": summary(6.0, 200),
                                         "c": summary(1.0, 100, computed=120, crosstalk=1)}}]
    overhead = {"b": {"added_median_ms": 4.0}, "c": {"added_median_ms": 4.5}}
    result = {t["id"]: t["status"] for t in stats.targets(groups, 4, overhead)}
    assert result == {"C1": "PASS", "C2": "PASS", "C3/4": "PASS", "C4/4": "PASS",
                      "C3/8": "FAIL", "C4/8": "FAIL", "C5": "FAIL"}
    groups[0]["summaries"]["c"] = summary(1.1, 80)
    result = {t["id"]: t["status"] for t in stats.targets(groups, 4, None)}
    assert (result["C1"], result["C2"], result["C5"]) == ("FAIL", "FAIL", "N/A")


def test_targets_without_an_even_group_are_not_measured():
    groups = [{"users": 2, "summaries": {"b": summary(1, 1), "c": summary(1, 1)}}]
    result = {t["id"]: t["status"] for t in stats.targets(groups, 4)}
    assert result["C1"] == result["C2"] == "N/A"


def test_mode_options_pin_behind_kvproxy_and_keep_llama_defaults_straight():
    straight = concurrency.llama_options(True, 4, 4096)
    assert straight["ctx_size"] == 16384 and "slots" not in straight
    assert straight["extra_args"] == ["-np", "4", "--slot-prompt-similarity", "0.1"]
    assert straight["cache_ram_mib"] == 8192
    # behind kvproxy: the RAM cache make run picks (off with several slots, on with one)
    assert concurrency.llama_options(False, 4, 4096) == \
        {"ctx_size": 16384, "slots": 4, "cache_ram_mib": 0}
    assert concurrency.llama_options(False, 1, 4096) == \
        {"ctx_size": 4096, "slots": 1, "cache_ram_mib": 16384}
    assert concurrency.llama_options(False, 4, 4096, proxy_cache_ram=0) == \
        {"ctx_size": 16384, "slots": 4, "cache_ram_mib": 0}
    assert concurrency.llama_options(True, 4, 4096, proxy_cache_ram=0)["cache_ram_mib"] == 8192


def test_shown_command_keeps_the_last_of_a_repeated_flag_and_hides_paths():
    args = ["-m", "/x/model.gguf", "--host", "127.0.0.1", "--port", "5", "-np", "1", "-c", "16384",
            "--slot-save-path", "/tmp/s", "--metrics", "--cache-ram", "8192", "-np", "4"]
    assert concurrency.shown_command(args) == \
        "llama-server -c 16384 --metrics --cache-ram 8192 -np 4"


def test_system_sizes_spread_evenly():
    assert concurrency.system_sizes(4, 1500, 3000) == [1500, 2000, 2500, 3000]
    assert concurrency.system_sizes(1, 1500, 3000) == [3000]


def test_arguments_refuse_conversations_that_do_not_fit_a_slot(capsys):
    assert parse_args(["--scenario", "concurrency"]).conc["slot_ctx"] == 4096
    with pytest.raises(SystemExit):
        parse_args(["--scenario", "concurrency", "--slot-ctx", "2048"])
    assert "raise --slot-ctx" in capsys.readouterr().err


def test_batched_bench_lines_are_parsed_with_the_speedup():
    lines = ["llama_model_loader: something",
             json.dumps({"pl": 1, "pp": 512, "tg": 64, "speed_pp": 340.0, "speed_tg": 74.0}),
             json.dumps({"pl": 4, "pp": 512, "tg": 64, "speed_pp": 377.0, "speed_tg": 122.1}),
             "{not json"]
    rows = batched.parse("\n".join(lines))
    assert [r["pl"] for r in rows] == [1, 4]
    assert rows[1]["tg_speedup"] == pytest.approx(122.1 / 74.0)
    assert "| 4 | 377 | 122.1 | 1.65x |" in batched.table({"rows": rows})
    assert "not shipped" in batched.table({"error": "not shipped", "rows": []})


def test_report_renders_tables_plot_and_page_section(tmp_path):
    from bench import concurrency_report

    turns = [turn("U1", 0, 0.0, 2.0, A1, reply=[20, 21], ttft=1.0, session="s1"),
             turn("U1", 1, 2.5, 3.0, A2, cache_n=8, ttft=0.2, session="s1")]
    for t, minimum in zip(turns, stats.minimum_new_tokens(turns)):
        t["min_new_tokens"] = minimum
    s = stats.summarize(turns, 3.0, sum(t["min_new_tokens"] for t in turns))
    s["cpu"] = {"llama_server": 4.04, "kvproxy": 0.5, "machine_busy": 5.5,
                "machine_busy_share": 0.917}
    group = {"users": 1, "modes": {"c": {"label": "(c) kvproxy, 1 slots", "proxied": True}},
             "summaries": {"c": s}, "results": {"c": {"turns": turns}},
             "failed": {"a": "RuntimeError('llama-server did not start')"}}
    conc = {"command": "python -m bench.run --scenario concurrency", "started_at": "now",
            "duration_seconds": 9.0, "machine": {"cores": 2, "cpu": "cpu", "ram_gib": 1},
            "settings": {"users": [1], "slots": 1, "slot_ctx": 1024, "system_tokens": [10, 20],
                         "turns": 2, "max_tokens": 8, "think": [0.1, 0.2]},
            "groups": [group], "mode_labels": {"c": "(c) kvproxy, 1 slots"},
            "mode_commands": {"c": "llama-server -np 1"},
            "batched": {"command": "llama-batched-bench", "rows": batched.parse(json.dumps(
                {"pl": 1, "pp": 8, "tg": 4, "speed_pp": 10.0, "speed_tg": 5.0}))}}
    conc["targets"] = stats.targets(conc["groups"], 1)
    text = concurrency_report.text_report(conc)
    assert "| computed / minimum | 1.00x |" in text
    assert "Failed modes: a: RuntimeError" in text
    assert "| CPU seconds: llama-server, kvproxy | 4.0 / 0.5 |" in text
    assert "| machine busy, core-seconds (share of all cores) | 5.5 (92%) |" in text
    assert "| 1 | 10 | 5.0 | 1.00x |" in text
    section = concurrency_report.page_section(conc, "../bench/results/x.png")
    assert section.startswith(concurrency_report.START) and section.endswith(concurrency_report.END)
    concurrency_report.plot(conc, tmp_path / "x.png")
    assert (tmp_path / "x.png").stat().st_size > 1000


def test_c5_judges_the_request_path_on_the_same_layout_when_measured():
    groups = [{"users": 4, "summaries": {}}]
    slower_layout = {"b": {"added_median_ms": 4.0}, "c": {"added_median_ms": 5.0}}
    same = {"slots": 4, "requests_each": 200, "one_slot_median_ms": 19.2,
            "all_slots_median_ms": 19.9}
    c5 = {t["id"]: t for t in stats.targets(groups, 4, slower_layout, same)}["C5"]
    assert c5["status"] == "PASS" and "19.90 ms vs 19.20 ms" in c5["measured"]
    same["all_slots_median_ms"] = 21.5
    assert {t["id"]: t["status"] for t in stats.targets(groups, 4, slower_layout, same)}["C5"] \
        == "FAIL"
    # without it (older results), the (b)/(c) comparison decides as before
    assert {t["id"]: t["status"] for t in stats.targets(groups, 4, slower_layout)}["C5"] == "FAIL"


def test_slot_overhead_summary_reads_both_series():
    from bench import slot_overhead
    figures = slot_overhead.summary({1: [10.0, 12.0, 11.0], 4: [13.0, 12.0, 14.0]}, 4)
    assert figures["one_slot_median_ms"] == 11.0 and figures["all_slots_median_ms"] == 13.0
    assert figures["requests_each"] == 3 and figures["all_slots_p90_ms"] == 13.8  # interpolated, as bench.micro


def test_cpu_readings_count_a_busy_process_and_the_machine():
    import subprocess
    import sys

    from bench import procs

    assert procs.cpu_seconds(2 ** 22 + 7) is None, "a process that is gone"
    # The child spins 0.8 s of its own CPU time when told to, says so, then sleeps: the
    # figures do not depend on how busy the machine is.
    spin = subprocess.Popen([sys.executable, "-c", "import sys, time\nsys.stdin.readline()\n"
                             "end = time.process_time() + 0.8\n"
                             "while time.process_time() < end: pass\n"
                             "print('done', flush=True)\ntime.sleep(60)"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        before = {"llama_server": procs.cpu_seconds(spin.pid), "kvproxy": None,
                  "machine": procs.machine_cpu()}
        spin.stdin.write("go\n")
        spin.stdin.flush()
        assert _read_line(spin.stdout, timeout=60) == "done"
        used = procs.cpu_used(before, {"llama_server": procs.cpu_seconds(spin.pid),
                                       "kvproxy": None, "machine": procs.machine_cpu()})
    finally:
        spin.kill()
        spin.wait(timeout=10)
    assert 0.78 <= used["llama_server"] <= 1.0, "its spin, and not its sleep"
    assert "kvproxy" not in used, "no proxy in this mode"
    assert used["machine_busy"] >= used["llama_server"] - 0.05
    assert 0 < used["machine_busy_share"] <= 1


def _read_line(stream, timeout: float) -> str:
    """One line from a child's output, waiting at most ``timeout`` seconds."""
    import threading

    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.append(stream.readline().strip()), daemon=True)
    reader.start()
    reader.join(timeout)
    return lines[0] if lines else ""
