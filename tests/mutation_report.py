"""Kill rate per module and the surviving mutants of the last `make mutate` run.

Reads mutmut's result files under ``mutants/``; usage:
``python -m tests.mutation_report [--names] [module ...]`` (module names as in ``kvproxy/``,
e.g. ``switch dialects.common``; none: every module with results). ``--names`` prints only the
names of the mutants not killed yet (survivors and unchecked ones), to rerun just those:
``mutmut run $(python -m tests.mutation_report --names switch)``.
"""
from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

from mutmut.mutation.diff_apply import get_diff_for_mutant
from mutmut.stats import status_by_exit_code

RESULTS = Path("mutants") / "kvproxy"


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


def main(modules: list[str]) -> int:
    if not RESULTS.is_dir():
        print("no mutation results: run `make mutate` first")
        return 1
    everything = results(modules, unchecked=True)
    found = results(modules)
    total = Counter()
    print(f"{'module':<28} {'mutants':>7} {'killed':>7} {'survived':>8} {'no tests':>8} "
          f"{'kill rate':>9} {'not run':>7}")
    for module, statuses in found.items():
        counts = Counter(everything[module].values())
        total.update(counts)
        print(row(module, counts))
    if len(found) > 1:
        print(row("all of the above", total))
    survivors = [(module, name) for module, statuses in found.items()
                 for name, status in sorted(statuses.items()) if status != "killed"
                 and status != "timeout"]
    print(f"\n{len(survivors)} mutants not killed (equivalent ones are listed in "
          "tests/MUTANTS.md):")
    for module, name in survivors:
        print(f"\n# {name}: {found[module][name]}")
        try:
            print("\n".join(line for line in get_diff_for_mutant(name).splitlines()
                            if line[:1] in "+-" and line[:3] not in ("+++", "---")))
        except Exception as exc:  # a result file from an older copy of the code
            print(f"  (no diff: {exc})")
    return 0


def row(module: str, counts: Counter) -> str:
    """Kill rate over the mutants run; ``not run``: left out by the time bound."""
    killed = counts["killed"] + counts["timeout"]
    not_run = counts["not checked"]
    checked = sum(counts.values()) - not_run
    rate = f"{100 * killed / checked:.1f}%" if checked else "-"
    return (f"{module:<28} {checked:>7} {killed:>7} {counts['survived']:>8} "
            f"{counts['no tests']:>8} {rate:>9} {not_run:>7}")


def names(modules: list[str]) -> int:
    for statuses in results(modules, unchecked=True).values():
        for name, status in sorted(statuses.items()):
            if status not in ("killed", "timeout"):
                print(name)
    return 0


if __name__ == "__main__":
    args = sys.argv[1:]
    sys.exit(names(args[1:]) if args[:1] == ["--names"] else main(args))
