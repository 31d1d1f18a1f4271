"""A copy of the bundled model that names fill-in-the-middle tokens, so llama-server serves /infill.

SmolLM2's GGUF names no FIM tokens, and llama-server answers /infill with 501 without them.
The copy (made with the ``gguf`` package's own metadata tool) names three of its special
tokens as prefix, suffix and middle. Its completions mean nothing, but prompts, slots and
the prompt cache behave as with a real FIM model, which is what kvproxy's tests look at.
The copy keeps the bundled file's name, so the served model name does not change.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from kvproxy.launch.processes import BUNDLED_MODEL, bundled_model

FIM_TOKENS = {"fim_pre": 3, "fim_suf": 4, "fim_mid": 5}


def make_fim_model(folder: Path) -> str:
    target = Path(folder) / BUNDLED_MODEL
    command = [sys.executable, "-m", "gguf.scripts.gguf_new_metadata", bundled_model(),
               str(target), "--force"]
    for name, token in FIM_TOKENS.items():
        command += ["--special-token-by-id", name, str(token)]
    subprocess.run(command, check=True, capture_output=True, timeout=300)
    return str(target)
