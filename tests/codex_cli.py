"""Run the real OpenAI Codex CLI (``codex exec``) against a Responses endpoint on loopback.

Codex is not needed by the tests (its recorded requests are committed); to record them,
install it beside Claude Code:

    npm install --prefix var/npm --no-audit --no-fund @openai/codex

Every run gets its own CODEX_HOME (config.toml with one model provider whose
``base_url`` is the given URL and ``wire_api = "responses"``) and working folder, a dummy
API key, a read-only sandbox and a bounded wait.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
CODEX_BIN = REPO_ROOT / "var" / "npm" / "node_modules" / ".bin" / "codex"
MODEL = "smollm2"


def codex_binary() -> str | None:
    """The CLI in var/npm, or one on PATH (CODEX_BIN overrides both)."""
    configured = os.environ.get("CODEX_BIN")
    if configured:
        return configured
    if CODEX_BIN.exists():
        return str(CODEX_BIN)
    return shutil.which("codex")


def write_config(home: Path, base_url: str) -> None:
    home.mkdir(parents=True, exist_ok=True)
    (home / "config.toml").write_text(
        f'model = "{MODEL}"\n'
        'model_provider = "kvproxy"\n'
        'check_for_update_on_startup = false\n'
        '[analytics]\nenabled = false\n'
        '[model_providers.kvproxy]\n'
        'name = "kvproxy"\n'
        f'base_url = "{base_url}/v1"\n'
        'wire_api = "responses"\n'
        'env_key = "OPENAI_API_KEY"\n'
        'request_max_retries = 0\n'
        'stream_max_retries = 0\n')


def run_codex(binary: str, base_url: str, prompt: str, home: Path, workdir: Path, *,
              resume: str | None = None, timeout: float = 900) -> list[dict]:
    """One ``codex exec --json`` turn (``exec resume <id>`` for a later one); its events."""
    write_config(home, base_url)
    workdir.mkdir(parents=True, exist_ok=True)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home.parent),
           "CODEX_HOME": str(home), "OPENAI_API_KEY": "dummy",
           "NO_PROXY": "127.0.0.1,localhost"}
    command = [binary, "exec"]
    if resume:
        command += ["resume", resume]
    command += ["--json", "--skip-git-repo-check", prompt]
    if not resume:
        command[2:2] = ["-s", "read-only", "-C", str(workdir)]
    done = subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)
    events = []
    for line in done.stdout.splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            continue
    if done.returncode != 0 or not events:
        raise RuntimeError(f"codex exited {done.returncode}: {done.stdout[-2000:]}"
                           f"{done.stderr[-2000:]}")
    return events


def thread_id(events: list[dict]) -> str:
    """The id ``codex exec resume`` takes, from the ``thread.started`` event."""
    for event in events:
        if event.get("type") == "thread.started":
            return event["thread_id"]
    raise RuntimeError(f"no thread.started event in {events[:3]}")
