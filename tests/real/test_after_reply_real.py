"""A client that has its whole answer sees that answer's record in the admin API, under
gunicorn, even when the server closes the reply well after its last byte was sent."""
import openai
import pytest
import requests

from tests.conftest import Stack

pytestmark = pytest.mark.real


@pytest.fixture(scope="module")
def late_stack(tmp_path_factory):
    stack = Stack(tmp_path_factory.mktemp("late-close"))
    stack.proxy.wsgi_app = "tests.late_close_wsgi:app"
    stack.start()
    yield stack
    stack.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_the_admin_api_lists_an_answer_the_client_already_has(late_stack, stream):
    """Each answer is in the listing and is the current session at once: the admin reads
    wait for the record of a reply the client has, not only of one the server closed."""
    client = openai.OpenAI(base_url=late_stack.url + "/v1", api_key="unused", max_retries=0,
                           timeout=120)
    for n in range(3):
        session = f"late-{'stream' if stream else 'whole'}-{n}"
        reply = client.chat.completions.create(
            model="any", max_tokens=4, temperature=0, stream=stream,
            messages=[{"role": "user", "content": f"Say {n}."}],
            extra_headers={"X-Session-Id": session})
        if stream:
            assert [chunk for chunk in reply]
        else:
            assert reply.choices[0].message.content is not None
        listed = [s["session_id"] for s in
                  requests.get(late_stack.url + "/api/sessions", timeout=10).json()]
        assert session in listed, (n, listed)
        current = requests.get(late_stack.url + "/api/sessions/current", timeout=10).json()
        assert current["session_id"] == session
