"""Session switching against the real llama-server through kvproxy (OpenAI client)."""
import json
import subprocess

import openai
import pytest
import requests

from tests.conftest import long_text

pytestmark = pytest.mark.real

SYSTEM_A = long_text(1600, seed=101)   # over 2,000 tokens each
SYSTEM_B = long_text(1600, seed=202)


def ask(client, system, question, session=None):
    """One chat turn; returns (usage, reply headers)."""
    raw = client.chat.completions.with_raw_response.create(
        model="any", max_tokens=8, temperature=0,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
        extra_headers={"X-Session-Id": session} if session else None)
    return raw.parse().usage, raw.headers


def chat_turn(client, history, session):
    """One turn of a growing conversation; the answer joins ``history``."""
    raw = client.chat.completions.with_raw_response.create(
        model="any", max_tokens=8, temperature=0, messages=history,
        extra_headers={"X-Session-Id": session})
    reply = raw.parse()
    history.append({"role": "assistant", "content": reply.choices[0].message.content})
    return reply.usage, raw.headers


def cached_share(usage):
    return usage.prompt_tokens_details.cached_tokens / usage.prompt_tokens


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def saved_a_and_b(stack, client):
    """conv-a and conv-b both have slot files, whichever tests ran before (A, B, A)."""
    for system, question, session in ((SYSTEM_A, "Summarise rule 1.", "conv-a"),
                                      (SYSTEM_B, "Summarise rule 2.", "conv-b"),
                                      (SYSTEM_A, "Summarise rule 1.", "conv-a")):
        ask(client, system, question, session)


def test_prompts_are_long(stack):
    tokens = requests.post(stack.llama.url + "/tokenize", json={"content": SYSTEM_A}, timeout=30)
    assert len(tokens.json()["tokens"]) >= 2000


def test_a_b_a_reuses_a_from_its_slot_file(stack, client):
    usage_a, headers = ask(client, SYSTEM_A, "Summarise rule 1.", "conv-a")
    assert headers["x-kvproxy-session"] == "conv-a" and headers["x-kvproxy-cache"] == "miss"
    assert usage_a.prompt_tokens >= 2000
    _, headers_b = ask(client, SYSTEM_B, "Summarise rule 2.", "conv-b")
    assert headers_b["x-kvproxy-cache"] == "miss"
    usage, headers = ask(client, SYSTEM_A, "Summarise rule 1.", "conv-a")
    assert headers["x-kvproxy-cache"] == "restored"
    assert cached_share(usage) >= 0.9, usage


def test_restart_of_llama_server_restores_from_disk(stack, client, saved_a_and_b):
    ask(client, SYSTEM_A, "Summarise rule 1.", "conv-a")
    stack.llama.restart()
    usage, headers = ask(client, SYSTEM_A, "Summarise rule 1.", "conv-a")
    assert headers["x-kvproxy-cache"] == "restored"
    assert cached_share(usage) >= 0.9, usage


def test_restart_of_both_processes_restores_what_the_shutdown_saved(stack, client, saved_a_and_b):
    """The conversation grows after its last swap, so only the save at shutdown holds the
    newest turn: after both processes restart, the newest turn is reused, not only the old file."""
    history = [{"role": "system", "content": SYSTEM_B},
               {"role": "user", "content": "Summarise rule 2."}]
    older, _ = chat_turn(client, history, "conv-b")              # restored from its file
    history.append({"role": "user", "content": "Now read this appendix.\n" + long_text(300, seed=203)})
    newer, headers = chat_turn(client, history, "conv-b")        # same session: no swap, no save
    assert headers["x-kvproxy-cache"] == "hit"
    assert newer.prompt_tokens > older.prompt_tokens + 300
    stack.stop_proxy()          # saves the active session (conv-b) on the way out
    stack.llama.restart()
    stack.start_proxy()
    history.append({"role": "user", "content": "Which rule did the appendix add?"})
    usage, headers = chat_turn(client, history, "conv-b")
    assert headers["x-kvproxy-cache"] == "restored"
    reused = usage.prompt_tokens_details.cached_tokens
    assert reused > older.prompt_tokens + 300, (usage, older, newer)
    assert reused >= newer.prompt_tokens - 16, (usage, newer)


def test_session_endpoints_show_real_files(stack, client, saved_a_and_b):
    ask(client, SYSTEM_B, "Summarise rule 2.", "conv-b")
    listing = {s["session_id"]: s for s in requests.get(stack.url + "/api/sessions", timeout=10).json()}
    for session in ("conv-a", "conv-b"):
        entry = listing[session]
        path = stack.slot_dir / entry["file"]
        assert entry["file_bytes"] == path.stat().st_size and entry["n_bytes"] > 1_000_000
        # stored as chunks by default: its own file is the tail beyond its last whole chunk
        assert entry["stored_as"] == "chunks" and entry["file_bytes"] < entry["n_bytes"] / 4
        assert entry["n_tokens"] >= 2000 and entry["hits"] >= 1
    current = requests.get(stack.url + "/api/sessions/current", timeout=10).json()
    assert current["session_id"] == "conv-b" and current["file_exists"]


def test_a_session_is_listed_and_current_as_soon_as_its_answer_has_arrived(stack, client):
    """Its record is written after the reply was sent (on another thread, under gunicorn):
    the admin API reads it only once the replies already sent are recorded."""
    for n in range(12):
        session = f"listed-{n}"
        ask(client, "Be brief.", "hi", session)
        listed = {s["session_id"]: s for s in requests.get(stack.url + "/api/sessions", timeout=10).json()}
        assert session in listed, n
        assert requests.get(stack.url + "/api/sessions/current", timeout=10).json()["session_id"] == session


def test_delete_removes_files_and_unknown_is_404(stack, client):
    ask(client, "Be brief.", "hi", "conv-gone")
    ask(client, "Be brief.", "hi", "conv-stays")  # conv-gone is saved to disk
    entry = next(s for s in requests.get(stack.url + "/api/sessions", timeout=10).json()
                 if s["session_id"] == "conv-gone")
    assert (stack.slot_dir / entry["file"]).exists()
    reply = requests.delete(stack.url + "/api/sessions/conv-gone", timeout=30)
    assert reply.status_code == 204
    assert not (stack.slot_dir / entry["file"]).exists()
    assert not (stack.slot_dir / entry["file"].replace(".bin", ".json")).exists()
    missing = requests.delete(stack.url + "/api/sessions/conv-gone", timeout=30)
    assert missing.status_code == 404 and "conv-gone" in missing.json()["message"]


def test_clear_resets_to_default(stack, client):
    ask(client, SYSTEM_B, "Summarise rule 2.", "conv-b")
    # As the original design has it, and as curl sends it: no body, no content type.
    done = subprocess.run(["curl", "-sS", "--max-time", "60", "-X", "POST",
                           stack.url + "/api/sessions/clear"], capture_output=True, text=True,
                          timeout=90)
    assert done.returncode == 0 and json.loads(done.stdout)["session_id"] == "default", done
    assert requests.get(stack.url + "/api/sessions/current", timeout=10).json()["session_id"] == "default"
    slot = requests.get(stack.llama.url + "/slots", timeout=10).json()[0]
    assert not slot.get("n_prompt_tokens")
    # conv-b was saved before the erase, so it comes back from disk.
    usage, headers = ask(client, SYSTEM_B, "Summarise rule 2.", "conv-b")
    assert headers["x-kvproxy-cache"] == "restored" and cached_share(usage) >= 0.9


def test_openapi_document_lists_the_session_endpoints(stack):
    spec = requests.get(stack.url + "/api/openapi.json", timeout=10).json()
    assert {"/api/sessions", "/api/sessions/current", "/api/sessions/clear"} <= set(spec["paths"])


def test_health_reports_upstream_state(stack):
    reply = requests.get(stack.url + "/health", timeout=10)
    assert reply.status_code == 200 and reply.json()["llama_server"]["status"] == "ok"


def test_bad_json_is_a_400_openai_error(stack):
    reply = requests.post(stack.url + "/v1/chat/completions", data=b"{not json",
                          headers={"Content-Type": "application/json"}, timeout=10)
    assert reply.status_code == 400
    assert reply.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError):
        openai.OpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0).chat.completions.create(
            model="m", messages="not a list")


def test_streamed_completion_passes_chunks_and_usage(stack, client):
    stream = client.chat.completions.create(
        model="any", max_tokens=8, stream=True, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "Count to five."}])
    chunks = list(stream)
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) >= 2
    assert chunks[-1].usage.completion_tokens >= 1
    text = client.completions.create(model="any", prompt="Once upon a time", max_tokens=4)
    assert text.choices[0].text and text.usage.completion_tokens >= 1
