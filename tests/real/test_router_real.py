"""Several models behind one llama-server (router mode) with room for one model at a time.

llama-server started with ``--models-dir`` (SmolLM2 and Gemma 3) and ``--models-max 1``
unloads one model whenever the other is asked for, and an unload loses its slots. Two
conversations on each model alternate so that every turn loads the other model: kvproxy
saves a model's unsaved turns before the other is loaded, so each returning turn is
restored from its file.
"""
from __future__ import annotations

import os
import time

import ollama
import openai
import pytest
import requests

from kvproxy.launch.processes import LlamaServer, ProxyServer, bundled_model, swa_model
from tests.conftest import long_text

pytestmark = pytest.mark.real


@pytest.fixture(scope="module")
def router(tmp_path_factory):
    root = tmp_path_factory.mktemp("router")
    models = root / "models"
    models.mkdir()
    for path in (bundled_model(), swa_model()):
        os.symlink(os.path.realpath(path), models / os.path.basename(path))
    llama = LlamaServer(str(root / "slots"), models_dir=str(models), models_max=1,
                        ctx_size=4096, swa_full=True, log_path=str(root / "llama-server.log"))
    proxy = ProxyServer(llama.url, str(root / "slots"), log_path=str(root / "proxy.log"),
                        env={"KVPROXY_LOCK_TIMEOUT": "120"})
    llama.start()
    try:
        proxy.start()
        yield llama, proxy
    finally:
        proxy.stop()
        llama.stop()


def test_every_model_is_listed_by_each_api(router):
    _, proxy = router
    ids = {m.id for m in openai.OpenAI(base_url=proxy.url + "/v1", api_key="x").models.list()}
    names = {m.model for m in ollama.Client(host=proxy.url).list().models}
    assert len(ids) == 2 and any("SmolLM2" in i for i in ids) and any("gemma" in i for i in ids)
    assert {n.split(":")[0] for n in names} == ids


@pytest.mark.timeout(900)
def test_conversations_come_back_from_their_files_when_their_model_was_unloaded(router):
    llama, proxy = router
    listed = requests.get(proxy.url + "/v1/models", timeout=30).json()["data"]
    smollm = next(m["id"] for m in listed if "SmolLM2" in m["id"])
    gemma = next(m["id"] for m in listed if "gemma" in m["id"])
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0, timeout=300)
    history: dict[str, list[dict]] = {}
    order = [("A", smollm), ("C", gemma), ("B", smollm), ("D", gemma)]
    for seed, (name, _) in enumerate(order):
        history[name] = [{"role": "system", "content": long_text(250, 40 + seed)},
                         {"role": "user", "content": "Name the first rule in three words."}]
    figures = []
    for turn in (1, 2):
        for name, model in order:
            raw = client.chat.completions.with_raw_response.create(
                model=model, max_tokens=8, temperature=0, messages=history[name],
                extra_headers={"X-Session-Id": name})
            reply = raw.parse()
            usage = reply.usage
            figures.append((turn, name, model, raw.headers["X-KVProxy-Cache"],
                            usage.prompt_tokens_details.cached_tokens, usage.prompt_tokens))
            history[name] += [{"role": "assistant", "content": reply.choices[0].message.content},
                              {"role": "user", "content": "And the second rule?"}]
    print("\n" + "\n".join(f"turn {t} {n} on {m}: {c}, {r} of {p} reused"
                           for t, n, m, c, r, p in figures))
    for turn, name, model, cache, reused, prompt in figures:
        if turn == 2:
            assert cache == "restored" and reused >= 0.9 * prompt, (name, model, cache, reused)
    states = {m["id"]: m["status"]["value"]
              for m in requests.get(llama.url + "/v1/models", timeout=30).json()["data"]}
    assert sorted(states.values()) == ["loaded", "unloaded"], states  # one model at a time


@pytest.mark.timeout(600)
def test_a_deleted_session_is_erased_from_its_models_slot(router):
    """DELETE /api/sessions/<id> behind the router erases the slot of the model the session
    ran on: its next turn computes the prompt afresh instead of finding it in the slot."""
    _, proxy = router
    listed = requests.get(proxy.url + "/v1/models", timeout=30).json()["data"]
    smollm = next(m["id"] for m in listed if "SmolLM2" in m["id"])
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0, timeout=300)
    messages = [{"role": "user", "content": long_text(200, 77) + "\nName the first rule."}]

    def turn():
        raw = client.chat.completions.with_raw_response.create(
            model=smollm, max_tokens=4, temperature=0, messages=messages,
            extra_headers={"X-Session-Id": "deleted"})
        usage = raw.parse().usage
        return raw.headers["X-KVProxy-Cache"], usage.prompt_tokens_details.cached_tokens, \
            usage.prompt_tokens
    turn()
    for _ in range(60):   # saved behind once the slot settled
        if any(s["session_id"] == "deleted" for s in
               requests.get(proxy.url + "/api/sessions", timeout=30).json()):
            break
        time.sleep(0.5)
    assert turn()[0] == "hit", "the slot holds the conversation"
    assert requests.delete(proxy.url + "/api/sessions/deleted", timeout=60).status_code == 204
    cache, reused, prompt = turn()
    print(f"\nafter DELETE: {cache}, {reused} of {prompt} reused")
    assert cache == "miss" and reused < 0.1 * prompt, (cache, reused, prompt)
