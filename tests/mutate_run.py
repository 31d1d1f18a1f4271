"""Run mutmut with setup.cfg's settings, optionally narrowed to chosen test files.

mutmut runs, for each mutant, every selected test that covers the mutated function. The switch is
covered by most of the suite, so on a small machine a full run of it takes hours; naming the
tests that target a module (``MUTATE_TESTS="tests/unit/test_switch.py ..."``) and stopping hung
mutants sooner (``MUTATE_TIMEOUT_MULTIPLIER=2``) make it practical.
mutmut reads its settings only from ``setup.cfg``; this wrapper overrides the test selection
there instead of editing the file. Usage: ``python -m tests.mutate_run run [mutant names]``.
"""
from __future__ import annotations

import os
import shlex

import mutmut.configuration as configuration
from mutmut.__main__ import cli

SELECTION = "pytest_add_cli_args_test_selection"


def narrowed(read_setup_cfg, tests: list[str], timeout_multiplier: float | None = None):
    """A config reader that answers ``tests`` for the test selection (and the timeout
    multiplier when given), setup.cfg otherwise."""
    def read(key, default):
        if key == SELECTION and tests:
            return tests
        if key == "timeout_multiplier" and timeout_multiplier:
            return timeout_multiplier
        return read_setup_cfg(key, default)
    return read


def main() -> None:
    tests = shlex.split(os.environ.get("MUTATE_TESTS", ""))
    # A mutant that makes a test wait for a lock bound is stopped after this many times the
    # duration of its tests (mutmut's default, 15, lets each such mutant run for minutes).
    multiplier = float(os.environ.get("MUTATE_TIMEOUT_MULTIPLIER") or 0) or None
    original = configuration._config_reader
    configuration._config_reader = lambda: narrowed(original(), tests, multiplier)
    configuration.reset_config()  # importing mutmut's command line has read setup.cfg already
    cli()


if __name__ == "__main__":
    main()
