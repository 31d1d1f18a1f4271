"""The cluster with a shared session store (issue 38): the shipped kvproxy-cluster.conf in
front of kvproxy + llama-server pairs that copy their sessions to one bucket of a real
SeaweedFS (``weed mini``), all on loopback.

- Four conversations live on node-a; it is killed with SIGKILL (kvproxy and llama-server,
  no exit save) and its slot folder deleted. nginx sends their next turns to node-b, which
  fetches each from the store and reuses at least 90% of its prompt.
- A new node with an empty slot folder takes node-a's address (a replaced machine): nginx
  sends the four back to it, and it carries each on from node-b's newer turn, fetched from
  the store, again at least 90% reused.
- The store is stopped: answers go on from the slot folders, ``/health`` says degraded,
  and once the store is started again (same data, same ports) the turns taken meanwhile
  reach it.

Every figure the assertions judge is also printed (``-s``). The scenario is built by
module fixtures, so each test also runs alone.
"""
from __future__ import annotations

import re
import shutil
import time
from dataclasses import dataclass, field

import botocore.exceptions
import openai
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from kvproxy.launch.seaweed import WeedMini
from kvproxy.storage.shared.location import NO_USER, StoreLocation
from kvproxy.storage.shared.session_object import decode
from tests.conftest import long_text, started_weed
from tests.nginx_harness import Cluster, kill_pair, node_of

pytestmark = [pytest.mark.real, pytest.mark.deploy]

REUSE = 0.9
ON_NODE_A = 4
SYSTEM_WORDS = 600          # about 800 tokens: several 256-token chunks per conversation
IN_STORE_TIMEOUT = 120      # uploads back off up to 30 s between tries while the store is down
FETCHED = re.compile(r"^store; ms=(?P<ms>[\d.]+)$")


@dataclass
class Turn:
    node: str
    cache: str
    prompt_tokens: int
    cached_tokens: int
    fetched: str | None      # X-KVProxy-Fetched: the session came from the store, this fast
    seconds: float

    @property
    def reuse(self) -> float:
        return self.cached_tokens / self.prompt_tokens

    @property
    def fetch_ms(self) -> float | None:
        match = FETCHED.match(self.fetched or "")
        return float(match["ms"]) if match else None


@dataclass
class Conversation:
    """A chat of its own long system prompt (so its chunks are its own), its id in
    X-Session-Id, which is also nginx's key for the machine."""
    id: str
    seed: int
    messages: list = field(default_factory=list)
    turns: list = field(default_factory=list)

    def __post_init__(self):
        self.messages = [{"role": "system", "content": "You answer in a few words. Handbook: "
                          + long_text(SYSTEM_WORDS, seed=self.seed)}]

    def ask(self, url: str) -> Turn:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=300)
        self.messages.append({"role": "user", "content": f"Question {len(self.turns) + 1}: "
                              "which rule names a colour?"})
        started = time.perf_counter()
        raw = client.chat.completions.with_raw_response.create(
            model="any", max_tokens=8, temperature=0, messages=self.messages,
            extra_headers={"X-Session-Id": self.id})
        reply = raw.parse()
        assert raw.headers["x-kvproxy-session"] == self.id
        self.messages.append({"role": "assistant", "content": reply.choices[0].message.content})
        details = reply.usage.prompt_tokens_details
        turn = Turn(raw.headers["x-kvproxy-node"], raw.headers["x-kvproxy-cache"],
                    reply.usage.prompt_tokens, details.cached_tokens if details else 0,
                    raw.headers.get("x-kvproxy-fetched"), time.perf_counter() - started)
        self.turns.append(turn)
        return turn


# -- the store, read as another node would --------------------------------------------------
def stored_tokens(store: WeedMini, location: StoreLocation) -> dict[str, int]:
    """Tokens of each conversation's session object in the bucket, by session id (kvproxy
    without API keys: user ``_``); base snapshots left out."""
    s3 = store.client()
    found = {}
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=location.bucket,
                                                         Prefix=location.sessions(NO_USER))
    for item in (item for page in pages for item in page.get("Contents") or ()):
        body = s3.get_object(Bucket=location.bucket, Key=item["Key"])["Body"].read()
        sidecar = decode(body).sidecar
        if sidecar.get("kind") != "base" and sidecar.get("session_id"):
            found[sidecar["session_id"]] = max(found.get(sidecar["session_id"], 0),
                                               int(sidecar.get("n_tokens") or 0))
    return found


def until_in_store(store: WeedMini, location: StoreLocation,
                   conversations: list[Conversation]) -> float:
    """Seconds until the bucket holds each conversation's last turn (a session object with at
    least that turn's prompt); uploads are behind the request path, so this is polled."""
    started = time.monotonic()
    while True:
        try:
            stored = stored_tokens(store, location)
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError):
            stored = {}       # the store still starting: asked again, within the bound
        missing = [c.id for c in conversations
                   if stored.get(c.id, 0) < c.turns[-1].prompt_tokens]
        if not missing:
            return time.monotonic() - started
        if time.monotonic() - started > IN_STORE_TIMEOUT:
            raise AssertionError(f"not in the store {IN_STORE_TIMEOUT} s after their last "
                                 f"turn: {missing}; the bucket holds {stored}")
        time.sleep(0.5)


def health(url: str) -> dict:
    reply = requests.get(url + "/health", timeout=30)
    assert reply.status_code == 200, reply.text
    return reply.json()


def until_health(url: str, status: str, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        now = health(url)
        if now["status"] == status or time.monotonic() > deadline:
            return now
        time.sleep(0.5)


def store_figure(url: str, name: str, **labels: str) -> float:
    """A sample of a node's /metrics, summed over the labels not named."""
    text = requests.get(url + "/metrics", timeout=30).text
    return sum(sample.value for family in text_string_to_metric_families(text)
               for sample in family.samples if sample.name == name
               and all(sample.labels.get(k) == v for k, v in labels.items()))


def sessions_on(url: str, node: str, prefix: str, count: int) -> list[str]:
    """``count`` session ids nginx sends to ``node`` (its consistent hash depends on the
    test's ports, so they are looked for)."""
    found = [key for key in (f"{prefix}-{n}" for n in range(400)) if node_of(url, key) == node]
    assert len(found) >= count, f"only {len(found)} of 400 ids land on {node}"
    return found[:count]


# -- the cluster ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A SeaweedFS of this module's own, since the outage test stops and starts it."""
    yield from started_weed(tmp_path_factory)


@pytest.fixture(scope="module")
def location(store) -> StoreLocation:
    return StoreLocation(store.new_bucket(), "kv")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, store, location):
    """node-a and node-b on one bucket; llama-server's own RAM prompt cache off, so every
    reused token is one kvproxy restored."""
    running = Cluster(tmp_path_factory.mktemp("cluster"), llama_args={"cache_ram_mib": 0},
                      KVPROXY_STORE_URL=location.url, **store.env()).start()
    yield running
    running.stop()


@pytest.fixture(scope="module")
def on_node_a(cluster, store, location) -> list[Conversation]:
    """Four conversations nginx sends to node-a, two turns each, each one's second turn in
    the store."""
    url = cluster.nginx.url
    placed = [Conversation(key, seed=3800 + n)
              for n, key in enumerate(sessions_on(url, "node-a", "lost", ON_NODE_A))]
    for turn in range(2):
        for conversation in placed:
            conversation.ask(url)
    took = until_in_store(store, location, placed)
    print(f"\n{ON_NODE_A} conversations on node-a, prompts "
          f"{[c.turns[-1].prompt_tokens for c in placed]} tokens; all in the store "
          f"{took:.1f} s after the last answer")
    assert {t.node for c in placed for t in c.turns} == {"node-a"}
    return placed


@pytest.fixture(scope="module")
def node_a_lost(cluster, on_node_a) -> list[Turn]:
    """node-a killed (kvproxy and llama-server, SIGKILL) and its slot folder deleted, then
    each of its conversations' next turn, through nginx."""
    lost = cluster.pairs["node-a"]
    kill_pair(lost)
    shutil.rmtree(lost.slot_dir)
    return [conversation.ask(cluster.nginx.url) for conversation in on_node_a]


def test_node_a_killed_with_its_disk_its_conversations_resume_on_node_b_from_the_store(
        on_node_a, node_a_lost):
    print(f"\nnode-a killed, its disk deleted; next turns on "
          f"{[t.node for t in node_a_lost]}: cache {[t.cache for t in node_a_lost]}, reuse "
          f"{[f'{t.reuse:.1%}' for t in node_a_lost]} ({[t.cached_tokens for t in node_a_lost]}"
          f" of {[t.prompt_tokens for t in node_a_lost]} tokens), fetch ms "
          f"{[t.fetch_ms for t in node_a_lost]}, turn s "
          f"{[round(t.seconds, 2) for t in node_a_lost]}")
    for conversation, turn in zip(on_node_a, node_a_lost):
        before = conversation.turns[-2]
        assert turn.node == "node-b", (conversation.id, turn)
        assert turn.cache == "restored" and turn.fetch_ms is not None, (conversation.id, turn)
        assert turn.reuse >= REUSE, (conversation.id, turn)
        assert turn.cached_tokens >= before.prompt_tokens, (conversation.id, before, turn)


@pytest.fixture(scope="module")
def on_new_node(cluster, store, location, on_node_a, node_a_lost) -> list[Turn]:
    """node-b's turns in the store, then a new pair with an empty slot folder at node-a's
    address ("node-c"); once nginx tries that address again (after the shipped
    fail_timeout) the four conversations go to it."""
    took = until_in_store(store, location, on_node_a)
    print(f"\nnode-b's turns in the store {took:.1f} s after its last answer")
    cluster.replace("node-a", "node-c")
    deadline = time.monotonic() + cluster.fail_timeout() + 30
    while node_of(cluster.nginx.url, on_node_a[0].id) != "node-c":
        assert time.monotonic() < deadline, "nginx never sent node-a's sessions to node-c"
        time.sleep(0.5)
    return [conversation.ask(cluster.nginx.url) for conversation in on_node_a]


def test_a_new_node_with_an_empty_disk_carries_on_what_another_node_answered_last(
        on_node_a, node_a_lost, on_new_node):
    print(f"\nnode-c (empty disk, node-a's address): cache {[t.cache for t in on_new_node]}, "
          f"reuse {[f'{t.reuse:.1%}' for t in on_new_node]} "
          f"({[t.cached_tokens for t in on_new_node]} of "
          f"{[t.prompt_tokens for t in on_new_node]} tokens), fetch ms "
          f"{[t.fetch_ms for t in on_new_node]}")
    for conversation, on_b, turn in zip(on_node_a, node_a_lost, on_new_node):
        assert turn.node == "node-c", (conversation.id, turn)
        assert turn.cache == "restored" and turn.fetch_ms is not None, (conversation.id, turn)
        assert turn.reuse >= REUSE, (conversation.id, turn)
        # node-b's turn, not node-a's older save (which would still be most of the prompt)
        assert turn.cached_tokens >= on_b.prompt_tokens, (conversation.id, on_b, turn)


def test_answers_continue_while_the_store_is_down_and_reach_it_when_it_returns(
        cluster, store, location):
    """Two conversations on one node, in the store; the store stopped: their turns are
    restored from the node's own slot folder (one slot: each swap restores the other), a new
    conversation is computed, /health says degraded; the store started again on the same
    data and ports: those turns reach it and /health says ok."""
    url = cluster.nginx.url
    node = node_of(url, "outage-0")
    *conversations, fresh = [Conversation(key, seed=3900 + n)
                             for n, key in enumerate(sessions_on(url, node, "outage", 3))]
    for conversation in conversations:
        conversation.ask(url)
    until_in_store(store, location, conversations)
    pair = cluster.pairs[node]
    dropped_before = store_figure(pair.url, "kvproxy_store_uploads_dropped_total")

    store.stop()
    try:
        down = [conversation.ask(url) for conversation in conversations * 2]
        failed_before = store_figure(pair.url, "kvproxy_store_fetches_total", outcome="failed")
        fetching_before = store_figure(pair.url, "kvproxy_store_fetch_seconds_sum")
        new = fresh.ask(url)
        failed = store_figure(pair.url, "kvproxy_store_fetches_total",
                              outcome="failed") - failed_before
        fetching = store_figure(pair.url, "kvproxy_store_fetch_seconds_sum") - fetching_before
        degraded = until_health(pair.url, "degraded", 60)
    finally:
        store.start()
    print(f"\nstore down: turns on {[t.node for t in down]}, cache {[t.cache for t in down]}, "
          f"reuse {[f'{t.reuse:.1%}' for t in down]}, turn s "
          f"{[round(t.seconds, 2) for t in down]}; a new conversation {new.cache} in "
          f"{new.seconds:.2f} s, of which {fetching:.2f} s its failed lookup in the store; "
          f"/health {degraded}")
    for turn in down:             # each swap restores the other from the node's slot folder
        assert turn.node == node and turn.fetched is None, turn
        assert turn.cache == "restored" and turn.reuse >= REUSE, turn
    # the new conversation was looked up in the store, which failed, and was computed
    assert new.node == node and new.cache in ("miss", "base") and new.fetched is None, new
    assert failed == 1, failed
    assert degraded["status"] == "degraded" and "store" in degraded, degraded
    assert "cannot reach the shared store" in degraded["store"], degraded

    came_back = [*conversations, fresh]
    took = until_in_store(store, location, came_back)
    healthy = until_health(pair.url, "ok", 60)
    dropped = store_figure(pair.url, "kvproxy_store_uploads_dropped_total") - dropped_before
    print(f"store started again: the outage's turns of {[c.id for c in came_back]} in it "
          f"{took:.1f} s later; /health {healthy['status']}; uploads dropped {dropped:.0f}")
    assert healthy["status"] == "ok", healthy
    assert dropped == 0
