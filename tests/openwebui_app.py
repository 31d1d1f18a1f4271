"""Run a real OpenWebUI and chat through its own HTTP API, so it makes its own Ollama calls.

Used by ``record_clients.py openwebui`` to record what OpenWebUI sends to an Ollama
server: its model probes, the streamed chat, and the ``### Task:`` requests (title, tags,
follow-ups) it runs in the background under the same chat id. OpenWebUI is not a
dependency of kvproxy or of its tests (the recorded fixtures are committed); install it
into a venv of its own, outside the checkout:

    python3.11 -m venv /tmp/owui-venv
    /tmp/owui-venv/bin/pip install <a CPU build of torch>
    /tmp/owui-venv/bin/pip install open-webui==0.12.4

torch first: open-webui needs it through sentence-transformers, and left to itself pip
takes a CUDA build of several GB; with torch in place the rest took about 3 minutes.
Name its command with ``OPENWEBUI=/tmp/owui-venv/bin/open-webui`` (else ``open-webui``
on PATH is used).

A chat is driven as OpenWebUI's browser client does it: ``POST /api/chat/completions``
with a socket ``session_id``, the new user message, the assistant message id and the
``background_tasks`` it wants; OpenWebUI answers at once with a task id and runs the
chat and its tasks itself. The driver waits until the chat has no running task.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import requests

from kvproxy.launch.processes import free_port, start_process, stop_process

OPENWEBUI_VERSION = "0.12.4"
# A system prompt long enough (about 450 tokens) that reusing it shows in prompt_eval_count.
SYSTEM = ("You are the help desk of a small bicycle shop. Answer in one short sentence. "
          + " ".join(f"Rule {n}: {text}." for n, text in enumerate([
              "greet returning customers by the name on their order when they give it",
              "quote prices in euros and say that they include value added tax",
              "never promise a repair date before a mechanic has seen the bicycle",
              "a basic service costs 49 euros and takes two working days",
              "a full service costs 119 euros and takes four working days",
              "tyres are fitted while the customer waits if the shop is not busy",
              "electric bicycles are serviced only on Tuesdays and Thursdays",
              "batteries are never charged in the shop overnight",
              "the shop opens at nine and closes at six, and at two on Saturdays",
              "it is closed on Sundays and public holidays",
              "rental bicycles must be back before closing time on the day they are due",
              "a lost rental lock costs 25 euros",
              "children's bicycles can be exchanged for a larger size within two years",
              "gift vouchers are valid for three years and cannot be paid out in cash",
              "the workshop phone number is never given out; use the front desk instead",
              "warranty claims need the original receipt or the order number",
              "spare parts that are not in stock arrive within five working days",
              "customers may bring their own parts, but the shop gives no warranty on them",
              "bicycles left in the workshop for more than sixty days may be sold",
              "if a question is not about the shop, answer it briefly and politely",
              "do not discuss other shops' prices",
              "offer a test ride for any bicycle on the shop floor",
              "helmets cannot be returned once worn",
              "payment by card, cash or bank transfer is accepted",
          ], start=1)))


def openwebui_command() -> str | None:
    return os.environ.get("OPENWEBUI") or shutil.which("open-webui")


class OpenWebUI:
    """``open-webui serve`` on a free loopback port, its Ollama connection at ``ollama_url``,
    with user-info forwarding on (so every Ollama call carries X-OpenWebUI-Chat-Id)."""

    def __init__(self, command: str, ollama_url: str, data_dir: Path, log_path: Path):
        self.command = command
        self.ollama_url = ollama_url
        self.data_dir = data_dir
        self.log_path = log_path
        self.port = free_port()
        self.process: subprocess.Popen | None = None
        self.token = ""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def environment(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
        env.update({
            "DATA_DIR": str(self.data_dir), "OLLAMA_BASE_URL": self.ollama_url,
            "ENABLE_OLLAMA_API": "true", "ENABLE_OPENAI_API": "false",
            "ENABLE_FORWARD_USER_INFO_HEADERS": "true", "WEBUI_SECRET_KEY": "recording",
            # no network here: no version check, no hub download of an embedding model
            "OFFLINE_MODE": "true", "HF_HUB_OFFLINE": "1", "RAG_EMBEDDING_ENGINE": "ollama",
            "ANONYMIZED_TELEMETRY": "false", "DO_NOT_TRACK": "true", "SCARF_NO_ANALYTICS": "true",
        })
        return env

    def start(self, timeout: float = 300) -> "OpenWebUI":
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.process = start_process(
            [self.command, "serve", "--host", "127.0.0.1", "--port", str(self.port)],
            str(self.log_path), self.url + "/health", timeout, env=self.environment(),
            cwd=str(self.data_dir))
        return self

    def stop(self) -> None:
        stop_process(self.process, 30)

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    def sign_up_admin(self) -> dict:
        """The first account OpenWebUI creates is its admin."""
        reply = requests.post(self.url + "/api/v1/auths/signup", timeout=60, json={
            "name": "Ada", "email": "ada@example.org", "password": "recording-pass-1"})
        reply.raise_for_status()
        self.token = reply.json()["token"]
        return reply.json()

    def models(self) -> list[dict]:
        reply = requests.get(self.url + "/api/models", headers=self._headers(), timeout=120)
        reply.raise_for_status()
        return reply.json()["data"]

    def chat_turn(self, model: dict, text: str, chat_id: str | None = None,
                  parent_id: str | None = None, timeout: float = 1200) -> tuple[str, str, dict]:
        """One user turn as the browser client sends it; waits until the chat and its
        background tasks are done. Returns the chat id, the assistant message id and it."""
        user_id, answer_id = str(uuid.uuid4()), str(uuid.uuid4())
        first = chat_id is None
        tasks = {"title_generation": True, "tags_generation": True} if first else {}
        tasks["follow_up_generation"] = True
        body = {
            "stream": True, "model": model["id"],
            "messages": [{"role": "system", "content": SYSTEM}],  # the user's system prompt
            "params": {}, "variables": {}, "model_item": model,
            "features": {"voice": False, "image_generation": False, "code_interpreter": False,
                         "web_search": False},
            "session_id": "recording-socket", "id": answer_id, "parent_id": parent_id,
            "user_message": {"id": user_id, "parentId": parent_id, "childrenIds": [answer_id],
                             "role": "user", "content": text, "timestamp": int(time.time()),
                             "models": [model["id"]]},
            "background_tasks": tasks,
        }
        if chat_id:
            body["chat_id"] = chat_id
        reply = requests.post(self.url + "/api/chat/completions", headers=self._headers(),
                              json=body, timeout=120)
        reply.raise_for_status()
        chat_id = reply.json()["chat_id"]
        self._wait_for_tasks(chat_id, timeout)
        chat = requests.get(f"{self.url}/api/v1/chats/{chat_id}", headers=self._headers(),
                            timeout=60).json()
        answer = chat["chat"]["history"]["messages"][answer_id]
        if not answer.get("done") or answer.get("error"):
            raise RuntimeError(f"OpenWebUI chat turn failed: {answer}")
        return chat_id, answer_id, answer

    def _wait_for_tasks(self, chat_id: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            running = requests.get(f"{self.url}/api/tasks/chat/{chat_id}",
                                   headers=self._headers(), timeout=60).json()
            if not running.get("task_ids"):
                return
            time.sleep(1)
        raise TimeoutError(f"OpenWebUI chat {chat_id} still busy after {timeout:.0f} s")


def request_name(record: dict) -> str:
    """A fixture name for one recorded OpenWebUI request: its route, or its task."""
    if record["method"] == "GET":
        return record["path"].rsplit("/", 1)[-1]
    messages = (record.get("body") or {}).get("messages") or []
    users = [m for m in messages if m.get("role") == "user"]
    first = str(users[0].get("content", "")) if users else ""
    if len(users) == 1 and first.startswith("### Task:"):
        task = first.splitlines()[1].lower() if len(first.splitlines()) > 1 else ""
        for word, name in (("title", "task-title"), ("tags", "task-tags"),
                           ("predict", "task-follow-ups"), ("follow", "task-follow-ups")):
            if word in task:
                return name
        return "task"
    return f"chat-turn-{len(users)}"
