"""The models benchmark's report: derived figures, the table, the page section and the files."""
from __future__ import annotations

import json

import pytest

from bench import models

SWA = {"case": "Gemma 3 270M, --swa-full", "model": "gemma.gguf", "prompt_tokens": 2700,
       "reused_tokens": 2690, "cache": "restored", "restored_s": 2.0, "cold_s": 30.0,
       "cold_prompt_tokens": 2700, "cold_computed_tokens": 2700, "first_turn_s": 31.0}
ROUTER = {"case": "router, SmolLM2-135M unloaded and loaded again", "model": "SmolLM2",
          "prompt_tokens": 2000, "reused_tokens": 1990, "cache": "restored", "restored_s": 3.0,
          "cold_s": 10.0, "cold_prompt_tokens": 2000, "cold_computed_tokens": 2000,
          "load_s": 1.5, "load_again_s": 1.6}
RUN = {"date": "2026-01-02", "machine": {"cores": 2, "cpu": "x86_64", "loadavg": [1.5, 1.2, 1.0]},
       "rows": [SWA, ROUTER], "words_swa": 2000, "words_router": 1500, "max_tokens": 4}


def test_figures_add_the_load_to_the_cold_turn_only_where_a_model_was_loaded():
    swa, router = models.figures(SWA), models.figures(ROUTER)
    assert swa["restored_without_load_s"] is None and swa["cold_with_load_s"] == 30.0
    assert swa["speedup"] == pytest.approx(15.0)
    assert router["restored_without_load_s"] == pytest.approx(1.5)
    assert router["cold_with_load_s"] == pytest.approx(11.5)
    assert router["speedup"] == pytest.approx(11.5 / 3.0)


def test_table_has_a_row_per_case_with_the_load_apart():
    text = models.table([SWA, ROUTER])
    lines = text.splitlines()
    assert len(lines) == 4 and lines[1].count("---") == 8
    assert all(line.count("|") == 9 for line in lines)
    assert "| Gemma 3 270M, --swa-full | 2700 | 2690 (restored) | 2.00 | - | 30.00 | - | 15.0x faster |" in text
    assert "| 3.00 | 1.50 | 10.00 | 11.50 | 3.8x faster |" in lines[3]


def test_page_section_names_the_machine_and_sits_between_the_markers():
    section = models.page_section(RUN)
    assert section.startswith(models.START) and section.endswith(models.END)
    assert "2 cores" in section and "noisy" in section and "2026-01-02" in section
    assert models.table(RUN["rows"]) in section


def test_results_are_written_and_the_page_section_replaced(tmp_path):
    page = tmp_path / "benchmark.md"
    page.write_text(f"# Benchmark\n\nbefore\n\n{models.START}\nstale figures\n{models.END}\n\nafter\n")
    models.write_results(RUN, folder=tmp_path / "results", page=page)
    assert json.loads((tmp_path / "results" / "models.json").read_text()) == RUN
    assert models.table(RUN["rows"]) in (tmp_path / "results" / "models.md").read_text()
    text = page.read_text()
    assert "stale figures" not in text and "before" in text and "after" in text
    assert text.count(models.START) == 1 and models.table(RUN["rows"]) in text


def test_saved_figures_render_again_without_starting_anything(tmp_path, capsys, monkeypatch):
    saved = tmp_path / "models.json"
    saved.write_text(json.dumps(RUN))
    monkeypatch.setattr(models, "RESULTS", tmp_path / "out")
    monkeypatch.setattr(models, "write_results",
                        lambda run, page=None: (tmp_path / "written").write_text(json.dumps(run)))
    assert models.main(["--from-json", str(saved), "--no-page"]) == 0
    assert "15.0x faster" in capsys.readouterr().out
    assert json.loads((tmp_path / "written").read_text()) == RUN
