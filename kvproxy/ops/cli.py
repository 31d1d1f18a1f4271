"""The ``kvproxy`` command (also ``python -m kvproxy``): ``serve`` runs kvproxy under gunicorn,
``doctor`` checks a running llama-server (see ops/doctor.py for its exit status), and the other
commands look at and steer a running kvproxy over its admin API.

The options of ``serve`` and ``doctor`` are generated from the settings tables of config.py;
each defaults to its ``KVPROXY_*`` environment variable, then to the setting's default.

Exit codes of the admin commands, which scripts can rely on:
  0 done; 1 not found (``rm`` of an unknown id); 2 usage error (also a request kvproxy refuses
  as bad, such as ``clear --slot`` of a slot it does not drive);
  3 kvproxy cannot be reached (refused, timed out, not kvproxy);
  4 refused: the admin token is missing or wrong; 5 kvproxy answered with an error (busy, 5xx).
Errors go to stderr in one line; ``--json`` prints machine-readable results on stdout.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import datetime, timezone
from typing import Any, Callable
from urllib.parse import quote

import requests

OK, NOT_FOUND, USAGE, UNREACHABLE, AUTH, SERVER_ERROR = 0, 1, 2, 3, 4, 5
DEFAULT_URL = "http://127.0.0.1:11434"


class CliError(Exception):
    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


class AdminClient:
    """The admin API of one kvproxy, every call bounded."""

    def __init__(self, url: str, token: str, timeout: float):
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.http = requests.Session()
        if token:
            self.http.headers["Authorization"] = f"Bearer {token}"

    def call(self, method: str, path: str, **params: Any) -> requests.Response:
        try:
            response = self.http.request(method, self.url + path, params=params or None,
                                         json={} if method == "POST" else None,
                                         timeout=(min(self.timeout, 5), self.timeout))
        except requests.RequestException as exc:
            raise CliError(UNREACHABLE, f"cannot reach kvproxy at {self.url}: "
                                        f"{exc.__class__.__name__}") from None
        if response.status_code == 401:
            raise CliError(AUTH, "kvproxy refused the admin token: set KVPROXY_ADMIN_TOKEN "
                                 "to the token kvproxy runs with")
        if response.status_code == 404 and method == "DELETE":
            return response
        if response.status_code == 400:
            raise CliError(USAGE, f"kvproxy refused the request: {_message(response)}")
        if response.status_code >= 400:
            raise CliError(SERVER_ERROR if response.status_code != 404 else UNREACHABLE,
                           f"{method} {path}: HTTP {response.status_code}: {_message(response)}")
        return response

    def json(self, path: str, **params: Any) -> Any:
        response = self.call("GET", path, **params)
        try:
            return response.json()
        except ValueError:
            raise CliError(UNREACHABLE, f"{self.url} did not answer like kvproxy "
                                        f"(no JSON from {path})") from None


def _message(response: requests.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text.strip()[:200] or response.reason
    if isinstance(body, dict):
        error = body.get("error")
        return str(body.get("message") or (error.get("message") if isinstance(error, dict) else error)
                   or body)
    return str(body)


# -- output ----------------------------------------------------------------------
def human_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KB", "MB", "GB"):
        if value < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TB"


def ago(iso: str | None, now: datetime | None = None) -> str:
    if not iso:
        return "-"
    try:
        then = datetime.fromisoformat(iso.replace("Z", "+00:00"))
    except ValueError:
        return iso
    seconds = max(0, ((now or datetime.now(timezone.utc)) - then).total_seconds())
    for size, unit in ((86400, "d"), (3600, "h"), (60, "min")):
        if seconds >= size:
            return f"{seconds // size:.0f} {unit} ago"
    return f"{seconds:.0f} s ago"


def table(headers: list[str], rows: list[list[Any]]) -> str:
    """Plain columns, as ``ollama ps`` prints them."""
    cells = [headers] + [["-" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    return "\n".join("   ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells)


def percent(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio * 100:.1f}%"


def stored_text(disk: dict) -> str:
    """How the saved sessions are stored: shared chunks against the whole files they stand for."""
    if not disk.get("chunks"):
        return "as whole files"
    text = (f"{disk['chunks']} shared chunks: {human_bytes(disk['used_bytes'])} on disk for "
            f"{human_bytes(disk['logical_bytes'])} of sessions ({percent(disk['stored_ratio'])})")
    if disk.get("written_per_save") is not None:
        text += (f"; a save wrote {human_bytes(disk['written_per_save'])} of "
                 f"{human_bytes(disk['logical_per_save'])} on average")
    return text


def restore_text(check: dict) -> str:
    if check.get("restoring_off"):
        cause = f": {check['cause']}" if check.get("cause") else ""
        return f"switched off since {check.get('off_since')}{cause}"
    if check.get("restoring_off") is None:
        return "unknown (llama-server did not say which model runs)"
    return f"on ({check.get('misses_in_a_row', 0)} unhonoured restores in a row)"


# -- commands ----------------------------------------------------------------------
def cmd_ps(client: AdminClient, args) -> tuple[Any, str]:
    data = client.json("/api/status", sessions="0")
    llama = data["llama_server"]
    rows = [[s["id"], s["session_id"], "busy" if s["busy"] else "idle",
             f"{s['tokens']}/{s['n_ctx']}" if s.get("n_ctx") else s["tokens"],
             ago(s.get("busy_since") if s["busy"] and s.get("busy_since") else
                 s.get("last_used_at") or s.get("since"))] for s in data["slots"]]
    text = table(["SLOT", "SESSION", "STATE", "TOKENS", "SINCE"], rows)
    text += f"\nllama-server {llama['status']}: {llama.get('model') or '-'} at {llama['url']}"
    return {"slots": data["slots"], "llama_server": llama}, text


def cmd_sessions(client: AdminClient, args) -> tuple[Any, str]:
    data = client.json("/api/status")
    sessions = data["sessions"]
    rows = [[s["id"], human_bytes(s["bytes"]), s["tokens"], ago(s["last_used"]), s["hits"],
             s["restores"], s["last_cache"]] for s in sessions]
    text = table(["SESSION", "SIZE", "TOKENS", "LAST USED", "HITS", "RESTORES", "LAST"], rows)
    return sessions, text if sessions else "no saved sessions"


def cmd_rm(client: AdminClient, args) -> tuple[Any, str]:
    response = client.call("DELETE", "/api/sessions/" + quote(args.session_id, safe=""))
    if response.status_code == 404:
        raise CliError(NOT_FOUND, f"no saved session {args.session_id!r}")
    return {"deleted": args.session_id}, f"deleted {args.session_id}"


def cmd_clear(client: AdminClient, args) -> tuple[Any, str]:
    params = {} if args.slot is None else {"slot": args.slot}
    answer = client.call("POST", "/api/sessions/clear", **params).json()
    slots = answer.get("slots") or []
    which = f"slot {slots[0]}" if len(slots) == 1 else f"{len(slots)} slots"
    return answer, f"{which} cleared (the sessions they held were saved first)"


def cmd_sweep(client: AdminClient, args) -> tuple[Any, str]:
    answer = client.call("POST", "/api/store/sweep").json()
    if not answer["swept"]:
        return answer, f"not swept: {answer.get('holder') or 'another node'} holds the sweep lease"
    text = (f"swept: {answer['checked']} chunks checked, {answer['deleted']} deleted, "
            f"{human_bytes(answer['freed_bytes'])} freed in {answer['seconds']:.2f} s")
    if answer.get("budget_bytes"):
        text += (f"; {human_bytes(answer['stored_bytes'])} stored, budget "
                 f"{human_bytes(answer['budget_bytes'])}: " +
                 (f"{answer['evicted']} conversation(s) evicted with "
                  f"{answer['evicted_chunks']} chunk(s), {human_bytes(answer['evicted_bytes'])}"
                  if answer.get("evicted") else "nothing evicted"))
    if answer.get("problem"):
        text += f" (stopped: {answer['problem']})"
    return answer, text


def cmd_stats(client: AdminClient, args) -> tuple[Any, str]:
    data = client.json("/api/status")
    stats, disk = data["stats"], data["disk"]
    outcomes = stats["outcomes"]
    bound = human_bytes(disk["bound_bytes"]) if disk["bound_bytes"] else "no bound"
    lines = [
        f"requests      {stats['requests']} since {stats['since']}",
        f"hit ratio     {percent(stats['hit_ratio'])} (hit {outcomes['hit']}, restored "
        f"{outcomes['restored']}, base {outcomes['base']}, miss {outcomes['miss']})",
        f"tokens        {stats['tokens']['reused']} reused, {stats['tokens']['computed']} computed "
        f"({percent(stats['reuse_ratio'])} reused)",
        f"disk          {human_bytes(disk['used_bytes'])} in {disk['files']} files of {bound}; "
        f"{human_bytes(disk['free_bytes'])} free",
        f"stored        {stored_text(disk)}",
        f"saved         {len(data['sessions'])} sessions, {len(data['bases'])} base snapshots",
        f"restoring     {restore_text(data['restore_check'])}",
    ]
    machine = {"stats": stats, "disk": disk, "sessions": len(data["sessions"]),
               "bases": len(data["bases"]), "restore_check": data["restore_check"]}
    return machine, "\n".join(lines)


def settings_environ(args, table) -> dict[str, str]:
    """The environment with the options given on the command line put in it."""
    environ = dict(os.environ)
    for setting in table:
        value = getattr(args, setting.name, None)
        if value is not None:
            environ[setting.env] = value
    return environ


def cmd_serve(args) -> int:
    """Check the settings, then become gunicorn with the package's settings and app."""
    from kvproxy.config import (PROCESS_SETTINGS, SETTINGS, ConfigError, check_slot_dir,
                                load_process_settings, load_settings)
    environ = settings_environ(args, SETTINGS + PROCESS_SETTINGS)
    try:
        settings = load_settings(environ)
        load_process_settings(environ)
        check_slot_dir(settings.slot_dir)
    except ConfigError as exc:
        print(f"kvproxy: {exc}", file=sys.stderr)
        return USAGE
    command = [sys.executable, "-m", "gunicorn", "-c", "python:kvproxy.gunicorn_conf",
               "kvproxy.wsgi:app"]
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, command, environ)
    except OSError as exc:
        print(f"kvproxy: cannot start gunicorn ({exc}): reinstall kvproxy", file=sys.stderr)
    return SERVER_ERROR


def cmd_doctor(args) -> int:
    import logging

    from kvproxy.config import SETTINGS, ConfigError, load_settings
    from kvproxy.ops import doctor
    quiet = logging.getLogger("kvproxy")   # the checks' own lines say what the log would
    quiet.addHandler(logging.NullHandler())
    quiet.propagate = False
    try:
        settings = load_settings(settings_environ(args, SETTINGS))
    except ConfigError as exc:
        print(f"kvproxy: {exc}", file=sys.stderr)
        return doctor.EXIT[doctor.FAIL]
    checks = doctor.diagnose(settings, doctor.local_flags(settings.upstream), wait=args.wait)
    status = doctor.exit_status(checks)
    if args.json:
        print(json.dumps({"checks": [vars(c) for c in checks], "exit_status": status}, indent=2))
    else:
        for check in checks:
            print(check.line())
        print(doctor.VERDICTS[status])
    return status


METAVARS = {"upstream": "URL", "slot_dir": "DIR", "host": "HOST", "port": "PORT"}


def add_settings_options(sub: argparse.ArgumentParser, table) -> None:
    """One option per setting (``slot_dir`` -> ``--slot-dir``); unset, the environment
    variable or the default applies, as kvproxy itself reads them."""
    for setting in table:
        current = os.environ.get(setting.env)
        default = f"${setting.env}={current!r}" if current is not None else \
            (f"{setting.default}" if setting.default else "empty")
        sub.add_argument("--" + setting.name.replace("_", "-"), dest=setting.name,
                         metavar=METAVARS.get(setting.name, "VALUE"),
                         help=f"{setting.help} [{setting.env}; default: {default}]"
                         .replace("%", "%%"))


SERVE_HELP = "run kvproxy under gunicorn in front of an existing llama-server"
DOCTOR_HELP = ("check a running llama-server for what kvproxy needs, one line per check with "
               "the fix (exit 0 good, 1 warnings, 2 kvproxy would not work)")

COMMANDS: dict[str, tuple[Callable, str]] = {
    "ps": (cmd_ps, "the slots and the session each holds"),
    "sessions": (cmd_sessions, "the saved sessions as a table"),
    "rm": (cmd_rm, "delete a saved session (exit 1 when there is none)"),
    "clear": (cmd_clear, "save the sessions the slots hold, then empty them (--slot N: one)"),
    "stats": (cmd_stats, "hit ratio, tokens reused and computed, disk"),
    "sweep": (cmd_sweep, "sweep the shared store of chunks no session names, and over "
                         "KVPROXY_STORE_MAX_GB of its least recently saved conversations, now "
                         "(one node at a time)"),
}


class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2
        self.exit(USAGE, f"kvproxy: usage error: {message} (see --help)\n")


def parser() -> argparse.ArgumentParser:
    # --url, --json and --timeout work before or after the command.
    common = Parser(add_help=False)
    common.add_argument("--url", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                        help="print JSON for machines")
    common.add_argument("--timeout", type=float, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    from kvproxy.version import __version__
    from kvproxy.config import PROCESS_SETTINGS, SETTINGS
    top = Parser(prog="kvproxy",
                 description="kvproxy: a session-aware front door for llama-server. 'serve' runs "
                             "it, 'doctor' checks a llama-server, the other commands look at and "
                             "steer a running kvproxy over its admin API.",
                 epilog="exit codes of the admin commands: 0 ok, 1 not found, 2 usage or bad "
                        "request, 3 cannot reach kvproxy, 4 admin token refused, "
                        "5 kvproxy answered with an error",
                 formatter_class=argparse.RawDescriptionHelpFormatter)
    top.add_argument("--version", action="version", version=f"kvproxy {__version__}")
    top.add_argument("--url", default=os.environ.get("KVPROXY_URL", DEFAULT_URL),
                     help="kvproxy's address (default: $KVPROXY_URL or %(default)s)")
    top.add_argument("--json", action="store_true", help="print JSON for machines")
    top.add_argument("--timeout", type=float, default=10, help="seconds to wait (default 10)")
    commands = top.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                  parser_class=Parser)
    serve = commands.add_parser("serve", help=SERVE_HELP, description=SERVE_HELP + "; each "
                                "option defaults to its environment variable")
    add_settings_options(serve, SETTINGS + PROCESS_SETTINGS)
    check = commands.add_parser("doctor", help=DOCTOR_HELP, description=DOCTOR_HELP + ". It "
                                "runs kvproxy's start-up checks (a probe save and restore in a "
                                "spare slot) over the slot folder kvproxy would use.")
    add_settings_options(check, SETTINGS)
    check.add_argument("--wait", type=float, default=10,
                       help="seconds to wait for busy slots (default 10)")
    check.add_argument("--json", action="store_true", help="print JSON for machines")
    for name, (_, help_text) in COMMANDS.items():
        sub = commands.add_parser(name, help=help_text, description=help_text, parents=[common])
        if name == "rm":
            sub.add_argument("session_id", help="the session id, as listed by 'sessions'")
        if name == "clear":
            sub.add_argument("--slot", type=int, default=None,
                             help="only this slot (default: every slot)")
    return top


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.command in ("serve", "doctor"):
        try:
            return (cmd_serve if args.command == "serve" else cmd_doctor)(args)
        except KeyboardInterrupt:
            return 130
        except Exception as exc:  # one line, never a traceback
            print(f"kvproxy {args.command}: stopped by {exc.__class__.__name__}: {exc}",
                  file=sys.stderr)
            return USAGE if args.command == "serve" else 2
    client = AdminClient(args.url, os.environ.get("KVPROXY_ADMIN_TOKEN", ""), args.timeout)
    try:
        machine, text = COMMANDS[args.command][0](client, args)
    except CliError as exc:
        print(f"kvproxy: {exc}", file=sys.stderr)
        return exc.code
    except (KeyError, TypeError, ValueError) as exc:
        print(f"kvproxy: {args.url} did not answer like kvproxy ({exc.__class__.__name__})",
              file=sys.stderr)
        return UNREACHABLE
    print(json.dumps(machine, indent=2) if args.json else text)
    return OK
