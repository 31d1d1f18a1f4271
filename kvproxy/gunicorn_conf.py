"""gunicorn settings: one worker (it owns the slots' locks), threads for waiting clients.

``kvproxy serve`` runs with them, and so does the checkout's gunicorn.conf.py.

Streams can run for minutes, so the worker timeout must not cut them: with
gthread the heartbeat comes from the worker's main thread, not from the request,
so ``timeout`` only catches a worker that hangs as a whole. A stop (SIGTERM) lets
running answers finish for up to ``graceful_timeout`` seconds, then saves the
session the slot holds. Forwarded headers (X-Forwarded-Proto) are believed only
from the proxies listed in KVPROXY_FORWARDED_ALLOW_IPS.
"""
import os
import sys

from kvproxy.config import ConfigError, load_process_settings

try:
    _process = load_process_settings()
except ConfigError as _exc:  # one line, not gunicorn's "Failed to read config file" traceback
    sys.stderr.write(f"kvproxy: {_exc}\n")
    sys.exit(2)

bind = f"{_process.host}:{_process.port}"
workers = 1
# gthread, with each request read in the worker's main loop before a thread serves it:
# silent or trickling clients never hold a thread (KVPROXY_RECEIVE_TIMEOUT bounds them).
worker_class = "kvproxy.web.worker.ReceivingWorker"
# Requests waiting for the slot hold a thread each (at most KVPROXY_MAX_WAITERS): by default
# threads beyond them, so /health, /metrics and the admin API always find one.
threads = _process.threads
timeout = _process.worker_timeout
graceful_timeout = _process.graceful_timeout
# Longer than nginx keeps an idle upstream connection (keepalive_timeout 60s in
# deploy/nginx/): the proxy, not gunicorn, must be the one to close it.
keepalive = _process.keepalive
forwarded_allow_ips = _process.forwarded_allow_ips
accesslog = "-"
errorlog = "-"
loglevel = os.environ.get("KVPROXY_LOG_LEVEL", "info").lower()
# Two copies may run side by side (see docs/operations.md); a shared control socket would collide.
control_socket_disable = True


# On SIGTERM a running stream may go on this long, then ends with an error event in its
# API's format, so the slot is free for worker_exit to save the session within graceful_timeout
# (20 s are kept for that save).
stop_grace = float(_process.stop_grace)


def post_worker_init(worker):
    """Start the stream deadline when the worker is told to stop, before gunicorn's handler."""
    import signal

    from kvproxy.relay.answer import begin_shutdown

    previous = signal.getsignal(signal.SIGTERM)

    def on_term(signum, frame):
        begin_shutdown(stop_grace)
        if callable(previous):
            previous(signum, frame)

    signal.signal(signal.SIGTERM, on_term)


# Seconds the exit waits for uploads to the shared store (their local copies stay regardless).
EXIT_UPLOAD_SECONDS = 10.0


def worker_exit(server, worker):
    """Save the session every slot holds, so restarting both processes loses nothing."""
    app = getattr(worker, "wsgi", None)
    app = getattr(app, "__wrapped__", app)   # ReceivingWorker wraps the app (worker.load_wsgi)
    models = getattr(app, "extensions", {}).get("kvproxy.models") if app else None
    for switch in (models.switches() if models is not None else []):
        switch.checkpoint()
    shared = getattr(app, "extensions", {}).get("kvproxy.shared_store") if app else None
    if shared is not None:   # those saves, and any still waiting, go to the store too
        shared.drain(EXIT_UPLOAD_SECONDS)
