"""Kill rate per module and the surviving mutants of the last `make mutate` run.

Reads mutmut's result files under ``mutants/``; usage:
``python -m tests.mutation_report [--names | --all] [module ...]`` (module names as in
``kvproxy/``, e.g. ``switch dialects.common``; none: every module with results). ``--names``
prints only the names of the mutants not killed yet (survivors and unchecked ones), to rerun
just those: ``mutmut run $(python -m tests.mutation_report --names switch)``.

Survivors that only change a log line (its wording or the values it shows) are counted apart
and listed only with ``--all``: log text is for people, and no test should pin its wording.
"""
from __future__ import annotations

import ast
import json
import sys
from functools import cache
from collections import Counter
from pathlib import Path

from mutmut.mutation.diff_apply import get_diff_for_mutant
from mutmut.stats import status_by_exit_code

RESULTS = Path("mutants") / "kvproxy"
LOG_METHODS = {"debug", "info", "warning", "error", "exception", "critical"}


def module_of(meta: Path) -> str:
    return ".".join(meta.relative_to(RESULTS).with_suffix("").with_suffix("").parts)


def results(modules: list[str], unchecked: bool = False) -> dict[str, dict[str, str]]:
    """``{module: {mutant: status}}`` for the chosen modules, checked mutants only
    unless ``unchecked``."""
    found = {}
    for meta in sorted(RESULTS.rglob("*.py.meta")):
        module = module_of(meta)
        if modules and module not in modules:
            continue
        codes = json.loads(meta.read_text())["exit_code_by_key"]
        statuses = {name: status_by_exit_code[code] for name, code in codes.items()}
        checked = {n: s for n, s in statuses.items() if unchecked or s != "not checked"}
        if checked:
            found[module] = checked
    return found


def source_of(module: str) -> Path:
    return Path("kvproxy", *module.split(".")).with_suffix(".py")


@cache
def source_lines(module: str) -> tuple[str, ...]:
    return tuple(source_of(module).read_text().splitlines())


@cache
def log_call_lines(module: str) -> frozenset[int]:
    """Line numbers inside logging calls (``log.info(...)``) of the module's source."""
    lines = set()
    for node in ast.walk(ast.parse("\n".join(source_lines(module)))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in LOG_METHODS and isinstance(node.func.value, ast.Name) \
                and node.func.value.id in ("log", "logger", "logging"):
            lines.update(range(node.lineno, node.end_lineno + 1))
    return frozenset(lines)


def changed_lines(diff: str) -> list[str]:
    return [line for line in diff.splitlines() if line[:1] in "+-" and line[:3] not in ("+++", "---")]


def only_log_text(module: str, diff: str) -> bool:
    """Whether every line the mutant changes lies inside a logging call (wherever the same
    text appears in the module; mutmut's diffs show methods dedented)."""
    removed = [line[1:].strip() for line in changed_lines(diff) if line.startswith("-")]
    if not removed:
        return False
    inside = log_call_lines(module)
    for text in removed:
        numbers = [n for n, line in enumerate(source_lines(module), 1) if line.strip() == text]
        if not numbers or any(n not in inside for n in numbers):
            return False
    return True


def diff_of(name: str) -> str | None:
    try:
        return get_diff_for_mutant(name)
    except Exception:  # noqa: BLE001 - a result file from an older copy of the code
        return None


def main(modules: list[str], list_all: bool = False) -> int:
    if not RESULTS.is_dir():
        print("no mutation results: run `make mutate` first")
        return 1
    everything = results(modules, unchecked=True)
    found = results(modules)
    total = Counter()
    survivors, log_only = [], set()
    for module, statuses in found.items():
        for name, status in sorted(statuses.items()):
            if status in ("killed", "timeout"):
                continue
            diff = diff_of(name)
            if status == "survived" and diff and only_log_text(module, diff):
                log_only.add(name)
            survivors.append((module, name, diff))
    print(f"{'module':<28} {'mutants':>7} {'killed':>7} {'survived':>8} {'log text':>8} "
          f"{'no tests':>8} {'kill rate':>9} {'not run':>7}")
    for module, statuses in found.items():
        counts = Counter(everything[module].values())
        counts["log text"] = sum(1 for name in statuses if name in log_only)
        total.update(counts)
        print(row(module, counts))
    if len(found) > 1:
        print(row("all of the above", total))
    listed = [s for s in survivors if list_all or s[1] not in log_only]
    print(f"\n{len(survivors)} mutants not killed, {len(log_only)} of them only in a log line"
          f"{'' if list_all else ' (not listed; --all lists them)'}; equivalent ones are listed "
          "in tests/MUTANTS.md:")
    for module, name, diff in listed:
        print(f"\n# {name}: {found[module][name]}")
        print("\n".join(changed_lines(diff)) if diff else "  (no diff: an older copy of the code)")
    return 0


def row(module: str, counts: Counter) -> str:
    """Kill rate over the mutants run; ``log text``: survivors that only change a log line
    (among ``survived``); ``not run``: left out by the time bound."""
    killed = counts["killed"] + counts["timeout"]
    not_run = counts["not checked"]
    checked = sum(v for k, v in counts.items() if k != "log text") - not_run
    rate = f"{100 * killed / checked:.1f}%" if checked else "-"
    return (f"{module:<28} {checked:>7} {killed:>7} {counts['survived']:>8} "
            f"{counts['log text']:>8} {counts['no tests']:>8} {rate:>9} {not_run:>7}")


def names(modules: list[str]) -> int:
    for statuses in results(modules, unchecked=True).values():
        for name, status in sorted(statuses.items()):
            if status not in ("killed", "timeout"):
                print(name)
    return 0


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["--names"]:
        sys.exit(names(args[1:]))
    sys.exit(main([a for a in args if a != "--all"], list_all="--all" in args))
