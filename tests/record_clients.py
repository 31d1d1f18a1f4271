"""Record the request fixtures under tests/fixtures/recorded/<client>/ from real clients.

    .venv/bin/python tests/record_clients.py [claude-code codex anthropic openai ollama openwebui]

Starts llama-server (bundled model) and kvproxy on free ports, puts the recording
relay (``recorder.py``) in front of kvproxy and drives each client through a short
multi-turn session, so every later turn carries the real earlier answers. Each request
becomes one scrubbed JSON file ``NN-<what>.json`` (``{"method","path","headers","body"}``).
Claude Code is answered by the relay itself with a canned reply: its prompt (about 4,200
tokens plus twelve tool schemas) and ``max_tokens: 128000`` would keep the bundled model
busy for many minutes per turn, and the fixture is the request, not the answer.
Codex CLI (``codex_cli.py`` says how to install it) runs ``codex exec`` and
``codex exec resume`` with a model provider whose ``base_url`` is the relay.
OpenWebUI runs as its own server with its Ollama connection at the relay and is driven
through its HTTP API (see ``openwebui_app.py``, which says how to install it: it is not
a dependency of kvproxy, and the recording takes several minutes because its follow-up
task asks for an unbounded answer).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from claude_cli import claude_binary, run_claude  # noqa: E402
from codex_cli import codex_binary, run_codex, thread_id  # noqa: E402
from openwebui_app import OPENWEBUI_VERSION, OpenWebUI, openwebui_command, request_name  # noqa: E402
from recorder import Recorder, machine_strings, write_fixtures  # noqa: E402

from kvproxy.launch.processes import LlamaServer, ProxyServer  # noqa: E402

FIXTURES = HERE / "fixtures" / "recorded"
SYSTEM = "You are a concise assistant. Answer in one short sentence."
WEATHER = {"name": "get_weather", "description": "Current weather for a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"]}}


def record_claude_code(url: str, tmp: Path) -> tuple[list[str], dict[str, str]]:
    """Two turns of the real CLI: a question, then ``--resume`` with a follow-up."""
    binary = claude_binary()
    if not binary:
        raise SystemExit("claude is not installed: run 'make claude-cli'")
    home, workdir = tmp / "home", tmp / "project"
    first = run_claude(binary, url, "Say hello in five words.", home, workdir, timeout=120)
    run_claude(binary, url, "Now say it in French.", home, workdir,
               resume=first["session_id"], timeout=120)
    return ["first-turn", "resumed-turn"], {str(workdir): "/home/user/project",
                                            str(home): "/home/user"}


def record_codex(url: str, tmp: Path) -> tuple[list[str], dict[str, str]]:
    """Two turns of ``codex exec``: a question, then ``exec resume`` with a follow-up."""
    binary = codex_binary()
    if not binary:
        raise SystemExit("codex is not installed: see tests/codex_cli.py")
    home, workdir = tmp / "home", tmp / "project"
    first = run_codex(binary, url, "Say hello in one word.", home / ".codex", workdir)
    run_codex(binary, url, "Now say it in French.", home / ".codex", workdir,
              resume=thread_id(first))
    return ["responses-first-turn", "responses-second-turn"], {
        str(workdir): "/home/user/project", str(home): "/home/user"}


def record_anthropic(url: str) -> list[str]:
    import anthropic
    client = anthropic.Anthropic(base_url=url, api_key="dummy", max_retries=0, timeout=300)
    history = [{"role": "user", "content": "Name a colour."}]
    first = client.messages.create(model="claude-opus-5-5", max_tokens=24, system=SYSTEM,
                                   messages=history)
    history += [{"role": "assistant", "content": first.content[0].text},
                {"role": "user", "content": "And another one?"}]
    client.messages.count_tokens(model="claude-opus-5-5", system=SYSTEM, messages=history)
    with client.messages.stream(model="claude-opus-5-5", max_tokens=24, system=SYSTEM,
                                messages=history) as stream:
        second = stream.get_final_message()
    history += [{"role": "assistant", "content": [b.model_dump() for b in second.content]},
                {"role": "user", "content": "What is the weather in Paris?"}]
    client.messages.create(model="claude-opus-5-5", max_tokens=24, system=SYSTEM,
                           messages=history, tools=[WEATHER])
    return ["create", "count-tokens", "stream", "tools"]


def record_openai(url: str) -> list[str]:
    import openai
    client = openai.OpenAI(base_url=url + "/v1", api_key="dummy", max_retries=0, timeout=300)
    client.models.list()
    history = [{"role": "system", "content": SYSTEM},
               {"role": "user", "content": "Name a colour."}]
    first = client.chat.completions.create(model="any", messages=history, max_tokens=24)
    history += [{"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "And another one?"}]
    stream = client.chat.completions.create(model="any", messages=history, max_tokens=24,
                                            stream=True, stream_options={"include_usage": True})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    history += [{"role": "assistant", "content": text},
                {"role": "user", "content": "What is the weather in Paris?"}]
    tool = {"type": "function", "function": {"name": WEATHER["name"],
                                             "description": WEATHER["description"],
                                             "parameters": WEATHER["input_schema"]}}
    client.chat.completions.create(model="any", messages=history, max_tokens=24, tools=[tool])
    return ["models", "chat", "chat-stream", "chat-tools"]


def record_ollama(url: str) -> list[str]:
    import ollama
    client = ollama.Client(host=url, timeout=300)
    models = client.list()
    name = models.models[0].model
    client.show(name)
    history = [{"role": "system", "content": SYSTEM},
               {"role": "user", "content": "Name a colour."}]
    first = client.chat(model=name, messages=history, options={"num_predict": 24})
    history += [{"role": "assistant", "content": first.message.content},
                {"role": "user", "content": "And another one?"}]
    text = "".join(part.message.content or "" for part in
                   client.chat(model=name, messages=history, stream=True,
                               options={"num_predict": 24}))
    history += [{"role": "assistant", "content": text},
                {"role": "user", "content": "Say it in French."}]
    client.chat(model=name, messages=history, options={"num_predict": 24})
    client.generate(model=name, prompt="Complete: the sky is", options={"num_predict": 8})
    return ["tags", "show", "chat", "chat-stream", "chat-3rd-turn", "generate"]


def record_openwebui(url: str, tmp: Path) -> tuple[list[str], dict[str, str]]:
    """Sign up the admin, list models, then two chat turns with OpenWebUI's background
    tasks (title, tags and follow-ups on the first turn, follow-ups on the second)."""
    command = openwebui_command()
    if not command:
        raise SystemExit(f"open-webui is not installed: see tests/openwebui_app.py "
                         f"(open-webui=={OPENWEBUI_VERSION} in a venv of its own)")
    app = OpenWebUI(command, url, tmp / "data", tmp / "openwebui.log").start()
    try:
        app.sign_up_admin()
        model = app.models()[0]
        chat_id, answer_id, _ = app.chat_turn(model, "Name a colour.")
        app.chat_turn(model, "And another one?", chat_id=chat_id, parent_id=answer_id)
    finally:
        app.stop()
    return [], {str(tmp): "/tmp/openwebui"}


# None: driven by main() itself (its own program, folders and request names)
CLIENTS = {"claude-code": None, "codex": None, "openwebui": None, "anthropic": record_anthropic,
           "openai": record_openai, "ollama": record_ollama}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("clients", nargs="*", default=list(CLIENTS), choices=list(CLIENTS))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvproxy-record-") as tmp_name:
        tmp = Path(tmp_name)
        llama = LlamaServer(str(tmp / "slots"), log_path=str(tmp / "llama-server.log"))
        proxy = ProxyServer(llama.url, str(tmp / "slots"), log_path=str(tmp / "proxy.log"))
        llama.start()
        try:
            proxy.start()
            for client in args.clients:
                upstream = None if client == "claude-code" else proxy.url
                with Recorder(upstream, timeout=900) as recorder:
                    extra: dict[str, str] = {}
                    if client == "claude-code":
                        names, extra = record_claude_code(recorder.url, tmp / "claude")
                    elif client == "codex":
                        names, extra = record_codex(recorder.url, tmp / "codex")
                    elif client == "openwebui":
                        _, extra = record_openwebui(recorder.url, tmp / "openwebui")
                        # its tasks run beside the chat: name each request by what it is
                        names = [request_name(r) for r in recorder.requests]
                    else:
                        names = CLIENTS[client](recorder.url)
                if len(names) != len(recorder.requests):
                    names = [f"request-{i + 1}" for i in range(len(recorder.requests))]
                paths = write_fixtures(FIXTURES / client, recorder.requests, names,
                                       machine_strings(extra))
                print(f"{client}: {len(paths)} requests -> {FIXTURES / client}")
        finally:
            proxy.stop()
            llama.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
