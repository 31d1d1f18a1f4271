"""The served model in Ollama's terms: name, size, family, context length, capabilities.

Built from llama-server's ``/props`` and ``/v1/models`` plus the GGUF header
when the model file is readable from here; both are handed in (``describe_facts``).
"""
from __future__ import annotations

import hashlib
import re
from datetime import datetime, timezone
from typing import Any

from kvproxy.translate import ollama as tr

# Used only when the GGUF header cannot be read (llama-server on another host).
KNOWN_ARCHITECTURES = ("qwen3moe", "qwen3", "qwen2", "gemma3", "gemma2", "gemma", "llama",
                       "mistral", "phi3", "phi", "deepseek2", "granite", "olmo", "falcon",
                       "starcoder2", "command-r", "gptoss", "gpt-oss")
THINKING_MARKERS = re.compile(r"enable_thinking|reasoning_content|<think>|\[THINK\]|\bthinking\b")


def guess_architecture(name: str) -> str:
    """Architecture from the model name, for when the GGUF header is out of reach."""
    lowered = name.lower()
    return next((arch for arch in KNOWN_ARCHITECTURES if arch in lowered), "unknown")


def quantization(ftype: Any, name: str) -> str:
    """llama.cpp's ftype name ("Q4_K - Medium", "(guessed) F16") in Ollama's spelling (Q4_K_M)."""
    text = str(ftype or "").replace("(guessed) ", "").replace("all ", "").strip()
    sizes = {"small": "S", "medium": "M", "large": "L"}
    match = re.match(r"^(\S+) - (\w+)", text)
    if match:
        suffix = sizes.get(match.group(2).lower())
        text = f"{match.group(1)}_{suffix}" if suffix else match.group(1)
    if text:
        return text
    found = re.search(r"(I?Q\d\w*|BF16|F16|F32)", name, re.IGNORECASE)
    return found.group(1).upper() if found else ""


def parameter_size(n_params: Any) -> str:
    if not isinstance(n_params, (int, float)) or n_params <= 0:
        return ""
    return f"{n_params / 1e9:.1f}B" if n_params >= 1e9 else f"{n_params / 1e6:.2f}M"


def capabilities(props: dict) -> list[str]:
    """What the model can really do, from llama-server's template caps and modalities."""
    caps = ["completion"]
    template_caps = props.get("chat_template_caps") or {}
    template = (props.get("chat_template_tool_use") or "") + (props.get("chat_template") or "")
    if template_caps.get("supports_tools") or template_caps.get("supports_tool_calls"):
        caps.append("tools")
    if (props.get("modalities") or {}).get("vision"):
        caps.append("vision")
    if template_caps.get("supports_reasoning_effort") or THINKING_MARKERS.search(template):
        caps.append("thinking")
    return caps


def context_length(props: dict, meta: dict) -> int:
    """The context llama-server really serves (capped by training): clients budget with it."""
    served = (props.get("default_generation_settings") or {}).get("n_ctx") or meta.get("n_ctx")
    values = [int(v) for v in (served, meta.get("n_ctx_train"))
              if isinstance(v, (int, float)) and v > 0]
    return min(values) if values else 0


def describe_facts(facts: dict, tag: str,
                   model_file: tuple[dict, int | None, float | None]) -> dict:
    """One model in Ollama's terms, from its ``facts`` (``relay.model_facts``), the tag it
    is served under and its ``model_file``: the GGUF header, size and modification time
    (``({}, None, None)`` when the file is out of reach)."""
    props, meta = facts["props"], facts["model"].get("meta") or {}
    path = props.get("model_path") or ""
    header, file_size, mtime = model_file
    arch = header.get("general.architecture") or guess_architecture(facts["name"] + " " + path)
    ctx = context_length(props, meta)
    size = file_size or int(meta.get("size") or 0)
    details = {"parent_model": "", "format": "gguf", "family": arch, "families": [arch],
               "parameter_size": parameter_size(meta.get("n_params")),
               "quantization_level": quantization(props.get("model_ftype") or meta.get("ftype"),
                                                  path or facts["name"])}
    info = {key: value for key, value in header.items()
            if key.startswith("general.") or key.startswith(arch + ".")}
    info.update({"general.architecture": arch, f"{arch}.context_length": ctx})
    if meta.get("n_params"):
        info["general.parameter_count"] = meta["n_params"]
    info.setdefault(f"{arch}.embedding_length", meta.get("n_embd"))
    info.setdefault(f"{arch}.vocab_size", meta.get("n_vocab"))
    # Not the file's sha256 (that means reading gigabytes): a stable id of what is served.
    digest = hashlib.sha256(f"{path}|{size}|{meta.get('n_params')}|{mtime}".encode()).hexdigest()
    return {"name": f"{facts['name']}:{tag}", "base": facts["name"], "size": size,
            "digest": digest, "modified_at": tr.created_at(datetime.fromtimestamp(
                mtime or facts["model"].get("created") or 0, timezone.utc)),
            "details": details, "model_info": {k: v for k, v in info.items() if v is not None},
            "capabilities": capabilities(props), "context_length": ctx, "path": path,
            "template": props.get("chat_template") or "",
            "license": header.get("general.license", ""),
            "upstream_id": facts["upstream_id"], "sleeping": bool(props.get("is_sleeping")),
            "loaded": (facts["model"].get("status") or {}).get("value") in (None, "loaded")}
