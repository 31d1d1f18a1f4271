"""kvproxy's app behind a layer that is half a second late where a client may already have
its whole answer: before closing a reply, and before reading on after a stream's ``[DONE]``.

gunicorn writes a reply's last byte, then asks the body for more, writes its access log and
only then closes it; openai's Python client stops reading a stream at ``[DONE]``. A thread
that loses the CPU there, or a middleware outside kvproxy's, widens those gaps; here they are
wide enough for a test to ask the admin API inside them every time.
"""
import time

from kvproxy.wsgi import app as kvproxy_app

LATE_S = 0.5


class _Late:
    def __init__(self, body):
        self._body = body

    def __iter__(self):
        for item in self._body:
            yield item
            if b"data: [DONE]" in item:
                time.sleep(LATE_S)

    def close(self):
        time.sleep(LATE_S)
        close = getattr(self._body, "close", None)
        if close is not None:
            close()


def app(environ, start_response):
    return _Late(kvproxy_app(environ, start_response))


app.__wrapped__ = kvproxy_app   # what gunicorn.conf.py's worker_exit saves the slots of
