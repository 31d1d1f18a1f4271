"""HTTP helpers for the benchmark: a timed streaming chat call and llama-server's tokenizer."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import requests

CONNECT_TIMEOUT = 5.0


@dataclass
class StreamResult:
    status: int
    started: float                   # perf_counter at send
    first_byte: float | None = None  # seconds after send
    first_event: float | None = None
    first_token: float | None = None
    total: float = 0.0
    content: str = ""
    timings: dict = field(default_factory=dict)
    headers: dict = field(default_factory=dict)
    event_times: list[float] = field(default_factory=list)    # content events, s after send
    read_times: list[float] = field(default_factory=list)     # socket reads, s after send
    n_bytes: int = 0
    error: str | None = None


def stream_chat(http: requests.Session, url: str, body: dict, read_timeout: float = 300,
                total_timeout: float = 900, path: str = "/v1/chat/completions") -> StreamResult:
    """POST a streaming chat request and time what arrives, event by event."""
    started = time.perf_counter()
    response = http.post(url + path, json={**body, "stream": True}, stream=True,
                         timeout=(CONNECT_TIMEOUT, read_timeout))
    result = StreamResult(status=response.status_code, started=started,
                          headers={k: v for k, v in response.headers.items()
                                   if k.lower().startswith("x-kvproxy")})
    try:
        if response.status_code != 200:
            result.error = response.text[:500]
            return result
        buffer = b""
        parts: list[str] = []
        done = False
        for chunk in response.iter_content(chunk_size=None):
            now = time.perf_counter() - started
            if now > total_timeout:
                raise TimeoutError(f"stream took longer than {total_timeout:.0f} s")
            result.n_bytes += len(chunk)
            result.read_times.append(now)
            if result.first_byte is None:
                result.first_byte = now
            buffer += chunk
            while b"\n\n" in buffer:
                raw, buffer = buffer.split(b"\n\n", 1)
                for line in raw.split(b"\n"):
                    if not line.startswith(b"data:"):
                        continue
                    payload = line[5:].strip()
                    if result.first_event is None:
                        result.first_event = now
                    if payload == b"[DONE]":
                        done = True
                        continue
                    event = json.loads(payload)
                    if "error" in event and not event.get("choices"):
                        result.error = json.dumps(event["error"])[:500]
                        continue
                    for choice in event.get("choices") or []:
                        text = (choice.get("delta") or {}).get("content")
                        if text:
                            parts.append(text)
                            result.event_times.append(now)
                            if result.first_token is None:
                                result.first_token = now
                    if isinstance(event.get("timings"), dict):
                        result.timings = event["timings"]
            if done:
                break
        result.content = "".join(parts)
        result.total = time.perf_counter() - started
    finally:
        response.close()
    return result


def timed_json(http: requests.Session, url: str, body: dict, read_timeout: float = 120,
               path: str = "/v1/chat/completions") -> tuple[float, requests.Response]:
    started = time.perf_counter()
    response = http.post(url + path, json=body, timeout=(CONNECT_TIMEOUT, read_timeout))
    _ = response.content
    return time.perf_counter() - started, response


def session_turn(url: str, session: str, messages: list[dict], max_tokens: int,
                 read_timeout: float = 600) -> dict:
    """One non-streaming turn (temperature 0) of the conversation ``session`` through kvproxy:
    its seconds, reply, prompt and reused tokens, and kvproxy's X-KVProxy-* headers."""
    started = time.perf_counter()
    response = requests.post(url + "/v1/chat/completions", headers={"X-Session-Id": session},
                             json={"model": "m", "messages": messages, "temperature": 0,
                                   "max_tokens": max_tokens},
                             timeout=(CONNECT_TIMEOUT, read_timeout))
    seconds = time.perf_counter() - started
    if response.status_code != 200:
        raise RuntimeError(f"{session}: {response.status_code} {response.text[:300]}")
    body = response.json()
    usage = body.get("usage") or {}
    return {"seconds": seconds, "reply": body["choices"][0]["message"].get("content") or "",
            "prompt_tokens": usage.get("prompt_tokens") or 0,
            "reused_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0,
            "cache": response.headers.get("X-KVProxy-Cache"),
            "fetched": response.headers.get("X-KVProxy-Fetched")}


def tokenize(http: requests.Session, llama_url: str, text: str, special: bool = True) -> list[int]:
    response = http.post(llama_url + "/tokenize",
                         json={"content": text, "add_special": special, "parse_special": special},
                         timeout=(CONNECT_TIMEOUT, 60))
    response.raise_for_status()
    return response.json()["tokens"]


def templated_tokens(http: requests.Session, llama_url: str, messages: list[dict]) -> list[int]:
    """The token ids llama-server would prefill for ``messages`` (template, then tokenizer)."""
    response = http.post(llama_url + "/apply-template", json={"messages": messages},
                         timeout=(CONNECT_TIMEOUT, 60))
    response.raise_for_status()
    return tokenize(http, llama_url, response.json()["prompt"])


def slot_action(http: requests.Session, llama_url: str, action: str, filename: str | None = None,
                timeout: float = 120) -> tuple[float, dict]:
    """POST /slots/0?action=...; returns (wall seconds, answer)."""
    started = time.perf_counter()
    response = http.post(f"{llama_url}/slots/0?action={action}",
                         json={"filename": filename} if filename else {},
                         timeout=(CONNECT_TIMEOUT, timeout))
    elapsed = time.perf_counter() - started
    response.raise_for_status()
    return elapsed, response.json()
