"""Run mutmut with setup.cfg's settings, optionally narrowed to chosen test files.

mutmut runs, for each mutant, every selected test that covers the mutated function. The switch is
covered by most of the suite, so on a small machine a full run of it takes hours; naming the
tests that target a module (``MUTATE_TESTS="tests/test_switch.py ..."``) makes it practical.
mutmut reads its settings only from ``setup.cfg``; this wrapper overrides the test selection
there instead of editing the file. Usage: ``python -m tests.mutate_run run [mutant names]``.
"""
from __future__ import annotations

import os
import shlex

import mutmut.configuration as configuration
from mutmut.__main__ import cli

SELECTION = "pytest_add_cli_args_test_selection"


def narrowed(read_setup_cfg, tests: list[str]):
    """A config reader that answers ``tests`` for the test selection, setup.cfg otherwise."""
    def read(key, default):
        if key == SELECTION and tests:
            return tests
        return read_setup_cfg(key, default)
    return read


def main() -> None:
    tests = shlex.split(os.environ.get("MUTATE_TESTS", ""))
    original = configuration._config_reader
    configuration._config_reader = lambda: narrowed(original(), tests)
    configuration.reset_config()  # importing mutmut's command line has read setup.cfg already
    cli()


if __name__ == "__main__":
    main()
