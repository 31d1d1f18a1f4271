"""gunicorn settings: one worker (it owns the slots' locks), threads for waiting clients.

Streams can run for minutes, so the worker timeout must not cut them: with
gthread the heartbeat comes from the worker's main thread, not from the request,
so ``timeout`` only catches a worker that hangs as a whole. A stop (SIGTERM) lets
running answers finish for up to ``graceful_timeout`` seconds, then saves the
session the slot holds. Forwarded headers (X-Forwarded-Proto) are believed only
from the proxies listed in KVPROXY_FORWARDED_ALLOW_IPS.
"""
import os

bind = f"{os.environ.get('KVPROXY_HOST', '127.0.0.1')}:{os.environ.get('KVPROXY_PORT', '11434')}"
workers = 1
# gthread, with each request read in the worker's main loop before a thread serves it:
# silent or trickling clients never hold a thread (KVPROXY_RECEIVE_TIMEOUT bounds them).
worker_class = "kvproxy.web.worker.ReceivingWorker"
# Requests waiting for the slot hold a thread each (at most KVPROXY_MAX_WAITERS): keep
# threads beyond them so /health, /metrics and the admin API always find one.
threads = int(os.environ.get("KVPROXY_THREADS")
              or int(os.environ.get("KVPROXY_MAX_WAITERS") or 16) + 16)
timeout = int(os.environ.get("KVPROXY_WORKER_TIMEOUT", "120"))
graceful_timeout = int(os.environ.get("KVPROXY_GRACEFUL_TIMEOUT", "120"))
# Longer than nginx keeps an idle upstream connection (keepalive_timeout 60s in
# deploy/nginx/): the proxy, not gunicorn, must be the one to close it.
keepalive = int(os.environ.get("KVPROXY_KEEPALIVE", "75"))
forwarded_allow_ips = os.environ.get("KVPROXY_FORWARDED_ALLOW_IPS", "127.0.0.1,::1")
accesslog = "-"
errorlog = "-"
loglevel = os.environ.get("KVPROXY_LOG_LEVEL", "info").lower()
# Two copies may run side by side (see docs/operations.md); a shared control socket would collide.
control_socket_disable = True


# On SIGTERM a running stream may go on this long, then ends with an error event in its
# API's format, so the slot is free for worker_exit to save the session within graceful_timeout
# (20 s are kept for that save).
stop_grace = float(os.environ.get("KVPROXY_STOP_GRACE", max(0, graceful_timeout - 20)))


def post_worker_init(worker):
    """Start the stream deadline when the worker is told to stop, before gunicorn's handler."""
    import signal

    from kvproxy.web.relay import begin_shutdown

    previous = signal.getsignal(signal.SIGTERM)

    def on_term(signum, frame):
        begin_shutdown(stop_grace)
        if callable(previous):
            previous(signum, frame)

    signal.signal(signal.SIGTERM, on_term)


def worker_exit(server, worker):
    """Save the session every slot holds, so restarting both processes loses nothing."""
    app = getattr(worker, "wsgi", None)
    models = getattr(app, "extensions", {}).get("kvproxy.models") if app else None
    for switch in (models.switches() if models is not None else []):
        switch.checkpoint()
