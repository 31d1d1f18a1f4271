"""The recording relay's scrubbing: what identifies the recording machine goes, the rest stays."""
from pathlib import Path

import recorder
from recorder import machine_strings, scrub


def test_run_folders_and_home_paths_are_replaced_but_words_are_kept(monkeypatch):
    monkeypatch.setattr(recorder.socket, "gethostname", lambda: "vm")
    monkeypatch.setattr(recorder.getpass, "getuser", lambda: "root")
    monkeypatch.setattr(recorder.Path, "home", lambda: Path("/root"))
    pairs = machine_strings({"/tmp/rec-x/work": "/home/user/project"})
    sent = {"cwd": "<cwd>/tmp/rec-x/work</cwd><root>/tmp/rec-x/work</root>",
            "memory": "/root/.claude/projects/-tmp-rec-x-work/memory",
            "meta": '{"agent_name":"/root","sandbox":"seccomp","vm":"llvm"}'}
    assert scrub(sent, pairs) == {
        "cwd": "<cwd>/home/user/project</cwd><root>/home/user/project</root>",
        "memory": "/home/user/.claude/projects/-home-user-project/memory",
        "meta": '{"agent_name":"/root","sandbox":"seccomp","vm":"llvm"}'}


def test_long_host_and_user_names_are_replaced(monkeypatch):
    monkeypatch.setattr(recorder.socket, "gethostname", lambda: "build-box-7")
    monkeypatch.setattr(recorder.getpass, "getuser", lambda: "alice")
    monkeypatch.setattr(recorder.Path, "home", lambda: Path("/home/alice"))
    text = "alice@build-box-7:/home/alice/src on Linux 6.8.0-45-generic"
    assert scrub(text, machine_strings()) == "user@host:/home/user/src on Linux 6.0.0"
