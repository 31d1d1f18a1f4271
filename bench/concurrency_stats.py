"""Pure figures of the concurrency scenario: percentiles, the minimum prompt tokens, cross-talk.

Every function takes the finished turns (plain dicts, as stored in the results JSON,
plus token lists while the run is in memory) and returns numbers or findings; nothing
here talks to a server, so the rules can be tested on made-up turns.

A turn dict has: ``conversation``, ``round`` (from 0), ``sent_s`` and ``finished_s``
(seconds from the common start), ``ttft_s``, ``prompt_n`` (computed), ``cache_n``
(reused), ``predicted_n``, ``status``, ``error``, ``session_header``, ``cache_header``,
and after token accounting ``tokens`` (the prompt as llama-server tokenizes it) and
``history`` (the prompt followed by the reply's tokens).
"""
from __future__ import annotations

import os
from collections import Counter


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile, ``q`` in 0..100; None without values."""
    ordered = sorted(values)
    if not ordered:
        return None
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def common_prefix(a: list[int], b: list[int]) -> int:
    return len(os.path.commonprefix([a, b]))


def minimum_new_tokens(turns: list[dict]) -> list[int]:
    """Per turn, what a perfect prefix cache that never loses anything would compute.

    By the time a turn's first token came, a perfect cache held every prompt whose own
    first token had come by then and every reply finished by then, whichever
    conversation they belong to. The turn reuses the longest prefix it shares with
    one of them; the rest must be computed, and llama-server always evaluates at least
    one token.
    """
    out = []
    for turn in turns:
        by = _ready(turn)
        sources = []
        for other in turns:
            if other is turn:
                continue
            if _ready(other) <= by:
                sources.append(other["tokens"])
            if other.get("history") and other["finished_s"] <= by:
                sources.append(other["history"])
        shared = max((common_prefix(turn["tokens"], s) for s in sources), default=0)
        out.append(max(1, len(turn["tokens"]) - shared))
    return out


def _ready(turn: dict) -> float:
    """When the turn's prompt was computed: its first token, else its end."""
    if turn.get("ttft_s") is None:
        return turn["finished_s"]
    return turn["sent_s"] + turn["ttft_s"]


def reuse_limit(turn: dict, turns: list[dict]) -> int:
    """The most tokens ``turn`` can honestly reuse.

    The cache of an earlier turn holds its prompt and the tokens it generated; a turn
    may reuse the longest prefix it shares with that (its own conversation's earlier
    turns, or any turn of another conversation: identical tokens give an identical
    cache, so a shared opening is no cross-talk), or with its own system prompt alone
    (``own_base``: kvproxy starts a session from a snapshot of it). Generated tokens
    are counted by number, as the reply's text may tokenize differently.
    """
    best = common_prefix(turn["tokens"], turn["own_base"]) if turn.get("own_base") else 0
    for other in turns:
        if other is turn or not other.get("tokens"):
            continue
        if other["conversation"] == turn["conversation"] and other["round"] >= turn["round"]:
            continue  # later turns of the same conversation contain this prompt
        shared = common_prefix(turn["tokens"], other["tokens"])
        if other.get("history"):
            shared = max(shared, common_prefix(turn["tokens"], other["history"]))
        if shared >= len(other["tokens"]):
            shared = max(shared, len(other["tokens"]) + int(other.get("predicted_n") or 0))
        best = max(best, shared)
    return best


def crosstalk(turns: list[dict], proxied: bool) -> list[dict]:
    """Turns that ran in a cache that is not their conversation's own.

    - ``reuse``: llama-server reused more tokens than the prompt shares with anything
      computed in the run; those cached tokens belong to a different text.
    - ``length``: computed plus reused differs from the prompt's own length, so the
      server evaluated some other prompt.
    - ``session`` (through kvproxy): the X-KVProxy-Session header changed within a
      conversation, is missing, or names a session another conversation also ran in.
    """
    findings = []
    ok = [t for t in turns if t.get("status") == 200 and not t.get("error")]
    for turn in ok:
        if turn.get("tokens") is None:
            continue
        limit = reuse_limit(turn, turns)
        if turn["cache_n"] > limit:
            findings.append(_finding(turn, "reuse", f"reused {turn['cache_n']} tokens, but the "
                                     f"prompt shares at most {limit} with any computed sequence"))
        total = turn["prompt_n"] + turn["cache_n"]
        if total and total != len(turn["tokens"]):
            findings.append(_finding(turn, "length", f"computed {turn['prompt_n']} + reused "
                                     f"{turn['cache_n']} = {total}, the prompt has "
                                     f"{len(turn['tokens'])} tokens"))
    if proxied:
        findings += session_problems(ok)
    return findings


def session_problems(turns: list[dict]) -> list[dict]:
    """The X-KVProxy-Session header must be one per conversation and never shared."""
    findings = []
    first: dict[str, str | None] = {}
    owners: dict[str, set[str]] = {}
    for turn in sorted(turns, key=lambda t: (t["conversation"], t["round"])):
        session = turn.get("session_header")
        if not session:
            findings.append(_finding(turn, "session", "no X-KVProxy-Session header"))
            continue
        owners.setdefault(session, set()).add(turn["conversation"])
        expected = first.setdefault(turn["conversation"], session)
        if session != expected:
            findings.append(_finding(turn, "session", f"ran in session {session}, the "
                                     f"conversation's first turn in {expected}"))
    for session, conversations in owners.items():
        if len(conversations) > 1:
            for turn in turns:
                if turn.get("session_header") == session:
                    findings.append(_finding(turn, "session", f"session {session} is shared by "
                                             f"{', '.join(sorted(conversations))}"))
    return findings


def _finding(turn: dict, kind: str, detail: str) -> dict:
    return {"conversation": turn["conversation"], "round": turn["round"], "kind": kind,
            "detail": detail}


def in_flight_seconds(turns: list[dict]) -> float:
    """Seconds with at least one turn sent and not yet finished (the union of the turns'
    spans): the wall time less the moments every user was thinking. Two modes that do the
    same work in the same in-flight time differ in wall time only by that idle time."""
    total, end = 0.0, float("-inf")
    for start, finish in sorted((t["sent_s"], t["finished_s"]) for t in turns):
        if finish <= end:
            continue
        total += finish - max(start, end)
        end = finish
    return total


def summarize(turns: list[dict], wall_seconds: float, minimum: int, extra_computed: int = 0,
              findings: list[dict] | None = None) -> dict:
    """One mode's figures: time to first token after the first turn (and of the slowest
    first turn: how long the last new conversation waited), wall time,
    generation rate, prompt tokens against the minimum, cross-talk, errors."""
    later = [t["ttft_s"] for t in turns if t["round"] >= 1 and t.get("ttft_s") is not None]
    first = [t["ttft_s"] for t in turns if t["round"] == 0 and t.get("ttft_s") is not None]
    computed = sum(t["prompt_n"] for t in turns) + extra_computed
    generated = sum(t["predicted_n"] for t in turns)
    findings = findings or []
    return {
        "turns": len(turns),
        "errors": sum(1 for t in turns if t.get("status") != 200 or t.get("error")),
        "ttft_later_n": len(later),
        "ttft_later_p50_s": percentile(later, 50),
        "ttft_later_p95_s": percentile(later, 95),
        "ttft_later_max_s": max(later, default=None),
        "ttft_first_max_s": max(first, default=None),  # when the last new user had an answer
        "wall_seconds": wall_seconds,
        "in_flight_seconds": in_flight_seconds(turns),
        "generated_tokens": generated,
        "generated_per_s": generated / wall_seconds if wall_seconds > 0 else None,
        "computed_tokens": computed,
        "extra_computed_tokens": extra_computed,
        "reused_tokens": sum(t["cache_n"] for t in turns),
        "minimum_tokens": minimum,
        "computed_over_minimum": computed / minimum if minimum else None,
        "crosstalk_turns": len({(f["conversation"], f["round"]) for f in findings}),
        "crosstalk_conversations": sorted({f["conversation"] for f in findings}),
        "crosstalk_kinds": dict(Counter(f["kind"] for f in findings)),
        "cache_headers": dict(Counter(t.get("cache_header") or "-" for t in turns)),
    }


TTFT_SHARE_TARGET = 1 / 3
WALL_SHARE_TARGET = 0.75
TOKENS_TARGET = 1.1
OVERHEAD_TARGET = 1.10


def targets(groups: list[dict], slots: int, overhead: dict | None = None,
            slot_path: dict | None = None) -> list[dict]:
    """PASS/FAIL/N/A for each target of the concurrency scenario.

    ``groups`` are ``{"users": n, "summaries": {mode: summarize(...)}}``. The speed
    targets compare (c) with (b) where there are as many users as slots; the token
    and cross-talk targets hold for every group.
    """
    out = []

    def add(ident: str, text: str, measured: str, passed: bool | None) -> None:
        out.append({"id": ident, "target": text, "measured": measured,
                    "status": "N/A" if passed is None else ("PASS" if passed else "FAIL")})

    even = next((g for g in groups if g["users"] == slots), None)
    b = (even or {}).get("summaries", {}).get("b")
    c = (even or {}).get("summaries", {}).get("c")
    label = f"{slots} users on {slots} slots"
    if b and c and b.get("ttft_later_p95_s") and c.get("ttft_later_p95_s") is not None:
        share = c["ttft_later_p95_s"] / b["ttft_later_p95_s"]
        add("C1", f"{label}: (c) p95 time to first token (turns after the first) <= 1/3 of (b)'s",
            f"{c['ttft_later_p95_s']:.2f} s vs {b['ttft_later_p95_s']:.2f} s = {share:.2f}",
            share <= TTFT_SHARE_TARGET)
    else:
        add("C1", f"{label}: (c) p95 time to first token <= 1/3 of (b)'s", "not measured", None)
    if b and c and b.get("wall_seconds"):
        share = c["wall_seconds"] / b["wall_seconds"]
        add("C2", f"{label}: (c) wall time <= {WALL_SHARE_TARGET} of (b)'s",
            f"{c['wall_seconds']:.1f} s vs {b['wall_seconds']:.1f} s = {share:.2f}",
            share <= WALL_SHARE_TARGET)
    else:
        add("C2", f"{label}: (c) wall time <= {WALL_SHARE_TARGET} of (b)'s", "not measured", None)
    for group in groups:
        c = group["summaries"].get("c")
        users = group["users"]
        if c and c.get("computed_over_minimum") is not None:
            add(f"C3/{users}", f"{users} users: (c) computes <= {TOKENS_TARGET}x the minimum prompt "
                "tokens", f"{c['computed_tokens']} / {c['minimum_tokens']} = "
                f"{c['computed_over_minimum']:.3f}x", c["computed_over_minimum"] <= TOKENS_TARGET)
        else:
            add(f"C3/{users}", f"{users} users: (c) computes <= {TOKENS_TARGET}x the minimum",
                "not measured", None)
        if c:
            add(f"C4/{users}", f"{users} users: no conversation continues another's in (c)",
                crosstalk_text(c), c["crosstalk_turns"] == 0 and c["errors"] == 0)
        else:
            add(f"C4/{users}", f"{users} users: no cross-talk in (c)", "not measured", None)
    ob, oc = (overhead or {}).get("b"), (overhead or {}).get("c")
    if slot_path:
        # kvproxy driving one slot and all of them, each on a llama-server of the same
        # layout, alternated (bench/slot_overhead.py): the request path alone.
        one, many = slot_path["one_slot_median_ms"], slot_path["all_slots_median_ms"]
        add("C5", f"no-swap request path: kvproxy driving {slots} slots answers within 10% of "
            "its median when driving 1 (as today), same llama-server layout, same run",
            f"{many:.2f} ms vs {one:.2f} ms = {many / one:.3f}x", many <= one * OVERHEAD_TARGET)
    elif ob and oc:
        base = ob["added_median_ms"]
        passed = oc["added_median_ms"] <= max(base, 0) * OVERHEAD_TARGET
        add("C5", "no-swap request path: (c)'s median added latency within 10% of (b)'s (one "
            "slot, as today) in the same run", f"{oc['added_median_ms']:.2f} ms vs "
            f"{base:.2f} ms" + (f" = {oc['added_median_ms'] / base:.2f}x" if base > 0 else ""),
            passed)
    else:
        add("C5", "no-swap overhead of (c) within 10% of (b)'s", "not measured", None)
    return out


def crosstalk_text(summary: dict) -> str:
    if summary["crosstalk_turns"] == 0:
        text = "none"
    else:
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(summary["crosstalk_kinds"].items()))
        text = (f"{summary['crosstalk_turns']} turns in "
                f"{', '.join(summary['crosstalk_conversations'])} ({kinds})")
    if summary.get("errors"):
        text += f"; {summary['errors']} failed turns"
    return text
