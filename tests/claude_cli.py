"""Run the real Claude Code CLI (installed by ``make claude-cli`` into var/npm) on loopback.

Every run gets its own HOME and working folder, a dummy API key and the switches that
keep the CLI off the internet (telemetry, auto-update, error reports, other traffic), and
a bounded wait.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
CLAUDE_BIN = REPO_ROOT / "var" / "npm" / "node_modules" / ".bin" / "claude"
QUIET_ENV = {"DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1",
             "DISABLE_ERROR_REPORTING": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
             "DISABLE_BUG_COMMAND": "1", "DISABLE_COST_WARNINGS": "1"}
# A small prompt: no built-in tools and no project files, so the request fits the
# bundled model's context. The request keeps Claude Code's own shape (system blocks,
# the environment system message, thinking, context_management, output_config, betas).
SMALL_PROMPT_ARGS = ("--tools", "", "--bare")
# Not CLAUDE_CODE_MAX_OUTPUT_TOKENS: an answer cut at the limit makes Claude Code ask
# again to continue (measured: four requests, then an error). Prompts ask for one word.


def claude_binary() -> str | None:
    """The CLI installed for the tests, or one on PATH (CLAUDE_BIN overrides both)."""
    configured = os.environ.get("CLAUDE_BIN")
    if configured:
        return configured
    if CLAUDE_BIN.exists():
        return str(CLAUDE_BIN)
    return shutil.which("claude")


def run_claude(binary: str, base_url: str, prompt: str, home: Path, workdir: Path, *,
               resume: str | None = None, extra_args: tuple[str, ...] = (),
               extra_env: dict[str, str] | None = None, timeout: float = 300) -> dict:
    """One ``claude -p PROMPT --output-format json`` turn; its JSON result."""
    home.mkdir(parents=True, exist_ok=True)
    workdir.mkdir(parents=True, exist_ok=True)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home),
           "ANTHROPIC_BASE_URL": base_url, "ANTHROPIC_API_KEY": "dummy",
           "NO_PROXY": "127.0.0.1,localhost", **QUIET_ENV, **(extra_env or {})}
    command = [binary, "-p", prompt, "--output-format", "json", *extra_args]
    if resume:
        command += ["--resume", resume]
    done = subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)
    try:
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError) as exc:
        raise RuntimeError(f"claude exited {done.returncode}: {done.stdout[-2000:]}"
                           f"{done.stderr[-2000:]}") from exc
