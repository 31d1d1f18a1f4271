"""The metrics of a real switch: saves, restores and reused tokens as llama-server did them."""
from __future__ import annotations

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import long_text
from tests.support import sample

pytestmark = pytest.mark.real


def _real_scrape(url: str) -> dict[str, dict]:
    text = requests.get(url + "/metrics", timeout=10).text
    families = {}
    for family in text_string_to_metric_families(text):
        families[family.name] = {"samples": {(s.name, tuple(sorted(s.labels.items()))): s.value
                                             for s in family.samples}}
    return families


def test_real_switch_shows_in_metrics(stack, http):
    def ask(system_seed: int, question: str) -> requests.Response:
        body = {"messages": [{"role": "system", "content": long_text(150, system_seed)},
                             {"role": "user", "content": question}],
                "max_tokens": 4, "temperature": 0}
        response = http.post(stack.url + "/v1/chat/completions", json=body, timeout=180)
        assert response.status_code == 200, response.text
        return response

    before = _real_scrape(stack.url)
    first = ask(9101, "What is rule 1?")
    ask(9102, "What is rule 2?")
    again = ask(9101, "What is rule 1?")   # the first session comes back
    assert again.headers["X-KVProxy-Session"] == first.headers["X-KVProxy-Session"]
    assert again.headers["X-KVProxy-Cache"] == "restored"
    after = _real_scrape(stack.url)

    def grew(family: str, name: str, **labels: str) -> float:
        return sample(after, family, name, **labels) - sample(before, family, name, **labels)

    actions = {kind: grew("kvproxy_swaps", "kvproxy_swaps_total", kind=kind)
               for kind in ("save", "restore", "erase")}
    # 9102 took the slot (save), then the first session came back from its file (restore)
    assert actions["save"] >= 2 and actions["restore"] >= 1, actions
    assert grew("kvproxy_swap_seconds", "kvproxy_swap_seconds_count", kind="restore") >= 1
    assert grew("kvproxy_prompt_tokens", "kvproxy_prompt_tokens_total", kind="reused") > 0
    assert grew("kvproxy_swap_seconds", "kvproxy_swap_seconds_count", kind="save") > 0
    assert sample(after, "kvproxy_slot_dir_bytes") > 0
    active = [dict(labels) for (name, labels), value
              in after["kvproxy_active_session"]["samples"].items() if value == 1]
    assert active == [{"kind": "conversation", "persistent": "true"}]
