"""A stand-in for llama-server's slot and model endpoints, on top of `responses`.

It records every slot action and writes a small file on save, as llama-server
does, so tests can check the swap sequence and the files it leaves.
"""
from __future__ import annotations

import copy
import json
import re
import struct
from pathlib import Path

import responses
from responses import matchers

UPSTREAM = "http://llama.test"
PROPS = {"model_path": "/models/tiny.gguf", "build_info": "b1-test", "total_slots": 1,
         "default_generation_settings": {"n_ctx": 8192}, "modalities": {"vision": False}}
# The tag every file of the stub's model carries (``<stem>@tiny.bin``).
MODEL = "tiny"
MODELS = {"object": "list", "data": [{"id": "tiny.gguf", "object": "model", "created": 1,
                                      "meta": {"size": 1000, "n_params": 135, "n_ctx_train": 8192}}]}


class FakeLlama:
    """llama-server with ``n_slots`` slots (``-np``); ``tokens`` is slot 0's count, ``held``
    every slot's; ``actions`` lists slot actions, ``slot_actions`` them with their slot,
    ``pinned`` the ``id_slot`` of every generation request."""

    def __init__(self, mock: responses.RequestsMock, slot_dir: Path, n_slots: int = 1,
                 n_ctx: int = 8192):
        self.mock = mock
        self.slot_dir = Path(slot_dir)
        self.actions: list[tuple[str, str | None]] = []
        self.slot_actions: list[tuple[int, str, str | None]] = []
        self.pinned: list[int | None] = []
        self.held = [0] * n_slots   # tokens each slot holds
        self.tasks: dict[int, int] = {}  # per slot, the id of the last task it ran
        self.last_task = 0
        self.restarted = False  # since restart(), a slot lists id_task once a task ran there
        self.n_ctx = n_ctx          # per slot
        self.props = copy.deepcopy(PROPS)
        self.props["total_slots"] = n_slots
        self.props["default_generation_settings"]["n_ctx"] = n_ctx
        self.models = copy.deepcopy(MODELS)
        self.lora: list[dict] = []          # GET /lora-adapters: id, path, scale
        self.fail_restore = False
        self.fail_save = False
        self.slot_timings = True   # llama-server reports save_ms / restore_ms
        self.save_fault: str | None = None  # "short": a short file behind a success; "fail": 500
        self.on_save = None                 # called with the file name before a save writes
        self.saving_off = False             # as llama-server without --slot-save-path
        self.slots_off = False              # as llama-server with --no-slots (no GET /slots)
        # As newer llama-server, which saves context checkpoints beside a slot file: each save
        # also writes ``<file><companion>`` (``.ckpt``: 4 + 2 bytes a token), and each restore
        # records the tokens of the companion it found beside the file (None: none) here.
        self.companion: str | None = None
        self.restored_companions: list[int | None] = []
        self.chat_timings = {"cache_n": 0, "prompt_n": 10, "predicted_n": 2}
        # When set, saves write llama-server's real layout with these token ids at the head.
        self.slot_token_ids: list[int] | None = None
        self.prefills: list[list[int]] = []
        self.prefill_reused = 0   # tokens a prefill finds cached (llama-server's RAM cache)
        self.prefill_ms = 1.0     # a prefill's time per computed token
        mock.add_callback(responses.POST, re.compile(rf"{UPSTREAM}/slots/\d+\?action=\w+"),
                          callback=self._slot)
        mock.add_callback(responses.GET, f"{UPSTREAM}/props", callback=lambda r: self._json(self.props))
        mock.add_callback(responses.GET, f"{UPSTREAM}/v1/models",
                          callback=lambda r: self._json(self.models))
        mock.add_callback(responses.GET, f"{UPSTREAM}/slots", callback=self._slots)
        mock.add(responses.GET, f"{UPSTREAM}/health", json={"status": "ok"})
        mock.add_callback(responses.GET, f"{UPSTREAM}/lora-adapters",
                          callback=lambda r: self._json(self.lora))
        mock.add_callback(responses.POST, f"{UPSTREAM}/v1/chat/completions", callback=self._chat)
        mock.add_callback(responses.POST, f"{UPSTREAM}/v1/completions", callback=self._text)
        # Only kvproxy's own prefill (n_predict 0): tests register other /completion answers.
        mock.add_callback(responses.POST, f"{UPSTREAM}/completion", callback=self._prefill,
                          match=[matchers.json_params_matcher({"n_predict": 0},
                                                              strict_match=False)])

    @property
    def tokens(self) -> int:
        """Tokens slot 0 holds."""
        return self.held[0]

    @tokens.setter
    def tokens(self, value: int) -> None:
        self.held[0] = value

    def _slot_of(self, body: dict) -> int:
        slot = body.get("id_slot")
        self.pinned.append(slot)
        return slot % len(self.held) if isinstance(slot, int) and slot >= 0 else 0

    def _ran(self, body: dict) -> int:
        """A task ran in the request's slot: task ids count up from llama-server's start."""
        slot = self._slot_of(body)
        self.last_task += 1
        self.tasks[slot] = self.last_task
        return slot

    def restart(self, n_slots: int | None = None) -> None:
        """As llama-server started again (``n_slots``: with another -np): every slot empty,
        task ids from 0."""
        n_slots = n_slots or len(self.held)
        self.held, self.tasks, self.last_task, self.restarted = [0] * n_slots, {}, 0, True
        self.props["total_slots"] = n_slots

    def _prefill(self, request):
        body = json.loads(request.body)
        self.prefills.append(body["prompt"])
        self.held[self._ran(body)] = len(body["prompt"])
        reused = min(self.prefill_reused, len(body["prompt"]))
        computed = len(body["prompt"]) - reused
        return self._json({"content": "", "timings": {
            "cache_n": reused, "prompt_n": computed, "prompt_ms": computed * self.prefill_ms,
            "predicted_n": 0}})

    def slot_entry(self, slot: int = 0) -> dict:
        """As llama-server lists it, task ids counting up from its start; tests give slots
        tokens without tasks, so until ``restart`` every slot lists one (0 by default), and
        after it only a slot that ran a task or holds tokens."""
        if self.restarted and self.held[slot] == 0 and slot not in self.tasks:
            return {"id": slot, "n_ctx": self.n_ctx, "is_processing": False}
        return {"id": slot, "n_ctx": self.n_ctx, "is_processing": False,
                "id_task": self.tasks.get(slot, 0), "n_prompt_tokens": self.held[slot]}

    def _slots(self, request):
        if self.slots_off:
            return self._json({"error": {"code": 501, "type": "not_supported_error",
                                         "message": "This server does not support slots "
                                                    "endpoint. Start it with `--slots`"}}, 501)
        return self._json([self.slot_entry(i) for i in range(len(self.held))])

    @staticmethod
    def _json(body, status=200):
        return status, {"Content-Type": "application/json"}, json.dumps(body)

    def _slot(self, request):
        action = re.search(r"action=(\w+)", request.url).group(1)
        slot = int(request.url.split("/slots/")[1].split("?")[0]) % len(self.held)
        filename = json.loads(request.body or b"{}").get("filename")
        self.actions.append((action, filename))
        self.slot_actions.append((slot, action, filename))
        return self._slot_action(slot, action, filename)

    def _slot_action(self, slot, action, filename):
        def tokens_now():
            return self.held[slot]
        if action == "save" and self.fail_save:
            return self._json({"error": {"code": 500, "message": "failed to save slot",
                                         "type": "server_error"}}, 500)
        if self.saving_off:
            return self._json({"error": {"code": 501, "type": "not_supported_error",
                                         "message": "This server does not support slots action. "
                                                    "Start it with `--slot-save-path`"}}, 501)
        if action == "save":
            if self.on_save:
                self.on_save(filename)
            if self.save_fault == "fail":
                return self._json({"error": {"code": 500, "message": "Unable to save slot",
                                             "type": "server_error"}}, 500)
            if self.slot_token_ids is not None:
                ids = self.slot_token_ids[:tokens_now()]
                data = struct.pack(f"<III{len(ids)}i", 0x67677371, 4, len(ids), *ids)
                data += bytes(max(0, tokens_now() + 4 - len(data)))
            else:
                data = b"ggsq" + bytes(tokens_now())
            written = len(data)
            if self.save_fault == "short":
                data = data[:3]
            (self.slot_dir / filename).write_bytes(data)
            if self.companion:
                (self.slot_dir / (filename + self.companion)).write_bytes(
                    b"ckpt" + bytes(2 * tokens_now()))
            return self._json({"id_slot": slot, "filename": filename, "n_saved": tokens_now(),
                               "n_written": written,
                               **({"timings": {"save_ms": 1.234}} if self.slot_timings else {})})
        if action == "restore":
            path = self.slot_dir / filename
            if self.fail_restore or not path.exists():
                self.held[slot] = 0
                return self._json({"error": {"code": 400, "message": "Unable to restore slot",
                                             "type": "invalid_request_error"}}, 400)
            head = path.read_bytes()
            if self.companion:
                beside = self.slot_dir / (filename + self.companion)
                self.restored_companions.append(
                    (beside.stat().st_size - 4) // 2 if beside.is_file() else None)
            if head[:4] == b"ggsq":
                self.held[slot] = len(head) - 4
            else:
                self.held[slot] = struct.unpack("<III", head[:12])[2]
            return self._json({"id_slot": slot, "filename": filename, "n_restored": tokens_now(),
                               "n_read": tokens_now() + 4,
                               **({"timings": {"restore_ms": 0.456}} if self.slot_timings else {})})
        erased, self.held[slot] = self.held[slot], 0
        return self._json({"id_slot": slot, "n_erased": erased})

    def _chat(self, request):
        body = json.loads(request.body)
        timings = dict(self.chat_timings)
        self.held[self._ran(body)] = timings["cache_n"] + timings["prompt_n"] + timings["predicted_n"]
        message = {"role": "assistant", "content": "ok"}
        usage = {"prompt_tokens": timings["prompt_n"] + timings["cache_n"], "completion_tokens": 2,
                 "prompt_tokens_details": {"cached_tokens": timings["cache_n"]}}
        if body.get("stream"):
            # As llama-server: timings on every chunk with timings_per_token, else on the
            # last one, which is the usage chunk when stream_options asks for usage.
            each = {"timings": timings} if body.get("timings_per_token") else {}
            chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": "ok"}}],
                       **each},
                      {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}], **each}]
            if (body.get("stream_options") or {}).get("include_usage"):
                chunks.append({"choices": [], "usage": usage})
            chunks[-1]["timings"] = timings
            text = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
            return 200, {"Content-Type": "text/event-stream"}, text
        return self._json({"choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
                           "usage": usage, "timings": timings})

    def _text(self, request):
        """/v1/completions: the same answer as text chunks, timings on the last one."""
        body = json.loads(request.body)
        timings = dict(self.chat_timings)
        self.held[self._ran(body)] = timings["cache_n"] + timings["prompt_n"] + timings["predicted_n"]
        if body.get("stream"):
            chunks = [{"choices": [{"index": 0, "text": "ok"}]},
                      {"choices": [{"index": 0, "text": "", "finish_reason": "stop"}],
                       "timings": timings}]
            text = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
            return 200, {"Content-Type": "text/event-stream"}, text
        return self._json({"choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}],
                           "timings": timings})


def make_switch(slot_dir, **kwargs):
    """A slot switch over ``slot_dir`` talking to the stub; base snapshots off unless asked."""
    from kvproxy.upstream.llama import LlamaClient
    from kvproxy.storage.store import SessionStore
    from kvproxy.slots.switch import SlotSwitch
    kwargs.setdefault("base_snapshots", False)
    # Not the shipped default: these tests count the stub's slot actions one by one, and a
    # background save would add its own when its delay runs out (test_save_behind.py tests it).
    kwargs.setdefault("save_behind", False)
    return SlotSwitch(LlamaClient(UPSTREAM), SessionStore(slot_dir), **kwargs)


class FakePrompt:
    """What the relay hands the switch: the prompt's tokens and its system prompt's."""

    def __init__(self, tokens, system=None):
        self._tokens, self._system = list(tokens), system

    def tokens(self):
        return self._tokens

    def system_tokens(self, min_tokens=0):
        return self._system


def stem_of(key: str) -> str:
    """The file stem of a session key on the stub's model."""
    from kvproxy.sessions.identity import file_stem, on_model
    return on_model(file_stem(key), MODEL)

