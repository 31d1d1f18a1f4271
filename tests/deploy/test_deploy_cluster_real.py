"""Several machines: the shipped deploy/nginx/kvproxy-cluster.conf in front of two
kvproxy + llama-server pairs (node-a, node-b), each with its own slot folder, on loopback.

The 20 conversations are placed once per module (a fixture), so each test also runs alone:
they stay on one machine, a stopped pair's sessions are answered by the other and come back,
restored from their own machine's slot folder, when it returns.
"""
from __future__ import annotations

import re
import time
from collections import Counter
from dataclasses import dataclass, field

import anthropic
import openai
import pytest
import requests

from tests.conftest import Stack
from tests.nginx_harness import Cluster, Nginx, httpx_client_from, node_of

pytestmark = [pytest.mark.real, pytest.mark.deploy]

SESSION_HEADERS = ["X-Session-Id", "X-OpenWebUI-Chat-Id", "X-Claude-Code-Session-Id"]
SYSTEM = "You are a terse assistant. Answer in a few words."
N_SESSIONS = 20
LONG_SILENCE_S = 65          # longer than nginx's default proxy_read_timeout (60 s)


@dataclass
class Turn:
    node: str
    cache: str
    prompt_tokens: int
    cached_tokens: int


@dataclass
class Conversation:
    """One chat with its id in one of the session headers, asked through the OpenAI client."""
    index: int
    messages: list = field(default_factory=lambda: [{"role": "system", "content": SYSTEM}])
    turns: list = field(default_factory=list)

    @property
    def id(self) -> str:
        return f"chat-{self.index:02d}"

    @property
    def header(self) -> str:
        return SESSION_HEADERS[self.index % len(SESSION_HEADERS)]

    def ask(self, client: openai.OpenAI) -> Turn:
        self.messages.append({"role": "user",
                              "content": f"Chat {self.index}, question {len(self.turns) + 1}: "
                                         f"name a colour and a number."})
        raw = client.chat.completions.with_raw_response.create(
            model="any", max_tokens=8, temperature=0, messages=self.messages,
            extra_headers={self.header: self.id})
        reply = raw.parse()
        assert raw.headers["x-kvproxy-session"] == self.id
        self.messages.append({"role": "assistant", "content": reply.choices[0].message.content})
        details = reply.usage.prompt_tokens_details
        turn = Turn(raw.headers["x-kvproxy-node"], raw.headers["x-kvproxy-cache"],
                    reply.usage.prompt_tokens, details.cached_tokens if details else 0)
        self.turns.append(turn)
        return turn


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    running = Cluster(tmp_path_factory.mktemp("cluster")).start()
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=cluster.nginx.url + "/v1", api_key="x", max_retries=0,
                         timeout=300)


@pytest.fixture(scope="module")
def conversations(client):
    """20 conversations placed by nginx: two turns back to back each (the second finds its
    session still in the slot), then a third round-robin (each comes back after the others
    on its machine took the slot: restored from that machine's folder)."""
    placed = [Conversation(i) for i in range(N_SESSIONS)]
    for conversation in placed:
        conversation.ask(client)
        conversation.ask(client)
    for conversation in placed:
        conversation.ask(client)
    return placed


def home(conversation: Conversation) -> str:
    return conversation.turns[0].node


def test_sessions_stay_on_one_machine_and_reuse_their_cache(conversations):
    spread = Counter(home(c) for c in conversations)
    print(f"\n20 sessions over the nodes: {dict(spread)}; second turn cache: "
          f"{dict(Counter(c.turns[1].cache for c in conversations))}; third (round-robin): "
          f"{dict(Counter(c.turns[2].cache for c in conversations))}")
    assert set(spread) == {"node-a", "node-b"}
    for conversation in conversations:
        first, second, third = conversation.turns[:3]
        assert first.node == second.node == third.node, conversation.id
        assert second.cache == "hit", (conversation.id, second)
        assert second.cached_tokens >= 0.9 * first.prompt_tokens, (conversation.id, first, second)
        assert third.cache in ("hit", "restored"), (conversation.id, third)
        assert third.cached_tokens >= 0.9 * second.prompt_tokens, (conversation.id, second, third)


def test_a_stopped_pair_moves_only_its_sessions_and_they_come_back(cluster, client,
                                                                   conversations):
    """node-a stops (gracefully: kvproxy saves the session its slot holds): its sessions are
    answered by node-b from scratch, node-b's own keep their cache. node-a comes back: its
    sessions return to it, restored from its own slot folder."""
    before = len(conversations[0].turns)
    moved = [c for c in conversations if home(c) == "node-a"]
    cluster.pairs["node-a"].stop()
    try:
        for conversation in conversations:
            conversation.ask(client)
    finally:
        cluster.pairs["node-a"].start()
    away = [c.turns[before] for c in conversations]
    print(f"\nnode-a stopped: {len(moved)} sessions answered by "
          f"{dict(Counter(c.turns[before].node for c in moved))}, cache "
          f"{dict(Counter(c.turns[before].cache for c in moved))}; the others: "
          f"{dict(Counter(c.turns[before].cache for c in conversations if c not in moved))}")
    for conversation, turn in zip(conversations, away):
        assert turn.node == "node-b", conversation.id
        if conversation not in moved:
            assert turn.cache in ("hit", "restored"), (conversation.id, turn)
        else:                                 # node-b has nothing of it: starts afresh
            assert turn.cache in ("miss", "base"), (conversation.id, turn)

    # nginx tries a failed server again after the shipped fail_timeout.
    time.sleep(cluster.fail_timeout() + 1)
    for conversation in conversations:
        conversation.ask(client)
    print(f"\nnode-a back: its {len(moved)} sessions cache "
          f"{dict(Counter(c.turns[before + 1].cache for c in moved))}, cached tokens "
          f"{[c.turns[before + 1].cached_tokens for c in moved]}")
    for conversation in conversations:
        turn = conversation.turns[before + 1]
        assert turn.node == home(conversation), conversation.id
        assert turn.cache in ("hit", "restored"), (conversation.id, turn)
    for conversation in moved:     # restored from node-a's folder: the turn before it stopped
        last_at_home = conversation.turns[before - 1]
        assert conversation.turns[before + 1].cached_tokens >= 0.9 * last_at_home.prompt_tokens


def test_body_only_id_clients_stick_by_address(cluster):
    """Anthropic clients with the id only in the body (metadata.user_id) and no id header,
    each from its own address: each stays on one machine, and they spread over both.
    (The ring depends on the test ports: on nginx's ketama ring 12 addresses all land on one
    machine for about 1 in 2,000 port pairs, 24 for none of 100,000.)"""
    homes = {}
    for n in range(10, 34):
        address = f"127.0.0.{n}"
        with httpx_client_from(address) as http:
            client = anthropic.Anthropic(base_url=cluster.nginx.url, api_key="x", max_retries=0,
                                         http_client=http)
            messages, nodes = [], []
            for turn in range(2):
                messages.append({"role": "user", "content": f"Client {n}, turn {turn}: hello."})
                raw = client.messages.with_raw_response.create(
                    model="any", max_tokens=8, messages=messages,
                    metadata={"user_id": f"user-{n}"}, extra_body={"temperature": 0})
                messages.append({"role": "assistant", "content": raw.parse().content[0].text})
                assert raw.headers["x-kvproxy-session"] == f"user-{n}"
                nodes.append(raw.headers["x-kvproxy-node"])
        assert len(set(nodes)) == 1, (address, nodes)
        homes[address] = nodes[0]
    print(f"\nbody-only id clients by address: {dict(Counter(homes.values()))}")
    assert set(homes.values()) == {"node-a", "node-b"}


def generation_rate(pair: Stack) -> float:
    """Tokens per second llama-server generates here (short context: its fastest)."""
    reply = requests.post(pair.llama.url + "/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": "Tell a story."}], "max_tokens": 64,
        "ignore_eos": True})
    return reply.json()["timings"]["predicted_per_second"]


def silent_request(url: str, session: str, tokens: int) -> tuple[int, float, str]:
    """A non-streamed answer of ``tokens`` tokens: nothing reaches nginx until it is done."""
    started = time.perf_counter()
    reply = requests.post(url + "/v1/chat/completions", timeout=600,
                          headers={"X-Session-Id": session},
                          json={"messages": [{"role": "user", "content": "Tell a long story."}],
                                "max_tokens": tokens, "ignore_eos": True, "stream": False})
    return reply.status_code, time.perf_counter() - started, reply.headers.get("X-KVProxy-Node", "")


KEYS = [f"probe-{n}" for n in range(24)]  # 12 all on one machine: 1 in 1,300 port pairs


def test_long_silent_request_is_not_cut_and_does_not_mark_the_machine_down(cluster):
    """A whole answer that takes longer than nginx's default 60 s read timeout: answered,
    and no session moves afterwards (a failed machine would lose its sessions)."""
    url = cluster.nginx.url
    before = {key: node_of(url, key) for key in KEYS}
    assert set(before.values()) == {"node-a", "node-b"}
    node = before["probe-0"]
    rate = generation_rate(cluster.pairs[node])
    tokens = int(LONG_SILENCE_S * rate)   # the rate is measured at its fastest: takes longer
    if tokens > 7500:
        pytest.skip(f"llama-server makes {rate:.0f} tokens/s here: a {LONG_SILENCE_S} s answer "
                    "does not fit the 8192-token context")
    status, took, answered_by = silent_request(url, "probe-0", tokens)
    print(f"\nsilent request: {tokens} tokens in {took:.1f} s, status {status}, {answered_by}")
    assert status == 200 and answered_by == node
    assert took > 60, f"only {took:.1f} s: not longer than nginx's default timeout"
    assert {key: node_of(url, key) for key in KEYS} == before
    assert "timed out" not in cluster.nginx.error_log()


def test_control_a_short_read_timeout_cuts_and_marks_down(cluster, tmp_path):
    """The same site with proxy_read_timeout at 2 s (nginx's default of 60 s, scaled down)
    and a 6 s answer: 504, and the machine is taken out, so its sessions move. This is what
    the shipped timeout prevents, and shows the test above would see it."""
    with Nginx(tmp_path, "kvproxy-cluster.conf", cluster.upstreams(),
               {"proxy_read_timeout": "2s"}) as short:
        node = node_of(short.url, "probe-0")
        tokens = int(6 * generation_rate(cluster.pairs[node]))
        status, took, _ = silent_request(short.url, "probe-0", tokens)
        moved = node_of(short.url, "probe-0")
        error_log, access_log = short.error_log(), short.access_log()
    print(f"\ncontrol: status {status} after {took:.1f} s; then sent to {moved}, was {node}")
    assert status == 504 and "upstream timed out" in error_log
    assert moved != node
    # The POST that timed out after it was sent was not run again on the other machine.
    (post,) = [line for line in access_log.splitlines() if '"POST ' in line]
    tried = re.search(r"upstream=(.*?) upstream_status=", post).group(1)
    assert "," not in tried, post
