"""A tiny WSGI app run under the repository's gunicorn.conf.py to test the process settings.

/health       200
/scheme       the wsgi.url_scheme gunicorn worked out (X-Forwarded-Proto, if trusted)
/slow?s=N     answers after N seconds of silence (like a long prefill)
/stream?s=N   streams one line every 0.25 s for N seconds (like a long answer)
"""
import time
from urllib.parse import parse_qs


def app(environ, start_response):
    path = environ["PATH_INFO"]
    seconds = float(parse_qs(environ.get("QUERY_STRING", "")).get("s", ["0"])[0])
    if path == "/scheme":
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [environ["wsgi.url_scheme"].encode()]
    if path == "/slow":
        time.sleep(seconds)
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"done\n"]
    if path == "/stream":
        start_response("200 OK", [("Content-Type", "text/plain")])

        def lines():
            count = int(seconds / 0.25)
            for n in range(count):
                time.sleep(0.25)
                yield f"line {n + 1} of {count}\n".encode()
        return lines()
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"ok\n"]
