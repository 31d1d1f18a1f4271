"""The idle-residents benchmark's figures: medians per condition and paired ratios per round."""
from __future__ import annotations

import pytest

from bench import idle_residents


def row(number: int, condition: str, prefill: float, decode: float, answer: float) -> dict:
    resident = condition == "resident"
    return {"round": number, "condition": condition, "idle_tokens": 7500 if resident else 0,
            "placed": {"restore_ms": [10.0, 12.0, 14.0]} if resident else {},
            "loadavg_1m": 1.0, "prompt_per_second": prefill, "predicted_per_second": decode,
            "answer_s": answer}


ROUNDS = [row(0, "resident", 200, 40, 6.0), row(0, "erased", 250, 50, 5.0),
          row(1, "erased", 100, 25, 10.0), row(1, "resident", 90, 20, 11.0),
          row(2, "resident", 180, 30, 7.0)]   # a round cut short: no pair


def test_ratios_pair_the_two_answers_of_each_round():
    s = idle_residents.summary(ROUNDS)
    assert s["rounds"] == 2
    assert s["ratio"]["prompt_per_second"] == pytest.approx((0.8 + 0.9) / 2, abs=1e-3)
    assert s["ratio"]["predicted_per_second"] == pytest.approx((0.8 + 0.8) / 2, abs=1e-3)
    assert s["answer_s_saved"] == pytest.approx(1.0)


def test_medians_per_condition_and_of_every_restore():
    s = idle_residents.summary(ROUNDS)
    assert s["resident"]["prompt_per_second"] == 180
    assert s["erased"]["predicted_per_second"] == pytest.approx(37.5)
    assert s["resident"]["idle_tokens"] == 7500 and s["erased"]["idle_tokens"] == 0
    assert s["restore_ms"] == 12.0
