"""Sessions stored as shared chunks: the map of a slot file, the cut, and the store on disk."""
import io
import json
import os

import pytest

from kvproxy.storage.chunks import cut, manifest
from kvproxy.storage.chunks.files import ChunkedFiles
from kvproxy.storage.store import SessionStore
from kvproxy.upstream import slot_file as slot_file_head
from kvproxy.upstream.slot_layout import layout_of
from tests.slot_files import MADE_BY, restored, save, slot_file

PROMPT = list(range(100, 180))          # 80 tokens: 5 chunks of 16
C = 16


# -- the map ---------------------------------------------------------------------
@pytest.mark.parametrize("cache", [{}, {"v_trans": 1}, {"ext": 12}, {"n_stream": 4, "stream": 2}])
def test_the_map_finds_every_layer_of_a_file_it_understands(cache):
    data = slot_file(PROMPT, **cache)
    layout = layout_of(data)
    assert layout is not None and layout.tokens == tuple(PROMPT) and layout.size == len(data)
    assert len(layout.layers) == 2 and layout.bytes_per_token == 2 * (128 + 128)
    assert layout.layers[0].v_el == (2 if cache.get("v_trans") else 0)


@pytest.mark.parametrize("why, data", [
    ("state version 3", slot_file(PROMPT, version=3)),
    ("media in the prompt", slot_file(PROMPT, media=1)),
    ("cells out of order", slot_file(PROMPT, positions=[1, 0] + list(range(2, 80)))),
    ("a window's cells", slot_file(PROMPT, positions=list(range(5, 85)))),
    ("two sequences", slot_file(PROMPT, seqs=[0] * 40 + [1] * 40)),
    ("an unknown cache type", slot_file(PROMPT, k_type=99)),
    ("cut short", slot_file(PROMPT)[:-10]),
    ("not a slot file", b"GGUF" + bytes(100)),
])
def test_a_file_it_does_not_fully_understand_has_no_map(why, data):
    assert layout_of(data) is None, why


def test_a_second_cache_holding_every_token_is_cut_too_and_what_follows_stays_whole():
    data = slot_file(PROMPT, sections=2, rest=b"recurrent state")
    layout = layout_of(data)
    assert len(layout.sections) == 2 and len(layout.layers) == 4
    assert data[layout.sections[-1].end:] == b"recurrent state"


def test_the_layout_fingerprint_changes_with_the_rows_format():
    assert layout_of(slot_file(PROMPT)).format == layout_of(slot_file(PROMPT[:40])).format
    assert layout_of(slot_file(PROMPT)).format != layout_of(slot_file(PROMPT, v_trans=1)).format
    assert layout_of(slot_file(PROMPT)).format != layout_of(slot_file(PROMPT, k_row=64)).format


# -- the cut ---------------------------------------------------------------------
def split(data: bytes, chunk_tokens: int = C):
    layout = layout_of(data)
    n = layout.cells // chunk_tokens
    chunks = [b"".join(cut.joined(cut.chunk_parts(data, layout, i * chunk_tokens,
                                                  (i + 1) * chunk_tokens))) for i in range(n)]
    tail = b"".join(cut.joined(cut.tail_parts(data, layout, n * chunk_tokens)))
    return layout, chunks, tail


@pytest.mark.parametrize("cache", [{}, {"v_trans": 1}, {"ext": 12}, {"sections": 2, "rest": b"x" * 7}])
@pytest.mark.parametrize("tokens", [PROMPT, PROMPT + [7, 8, 9], PROMPT[:10]])
def test_a_file_cut_and_put_back_together_is_the_same_bytes(cache, tokens):
    data = slot_file(tokens, **cache)
    layout, chunks, tail = split(data)
    out = io.BytesIO()
    cut.assemble(layout, tail, chunks.__getitem__, len(chunks), C, out)
    assert out.getvalue() == data
    assert all(len(c) == cut.chunk_bytes(layout, C) for c in chunks)
    assert len(tail) == len(data) - len(chunks) * cut.chunk_bytes(layout, C)


@pytest.mark.parametrize("cache", [{}, {"v_trans": 1}])
def test_two_files_sharing_a_prefix_share_its_chunks_byte_for_byte(cache):
    a = split(slot_file(PROMPT + [1] * 20, **cache))[1]
    b = split(slot_file(PROMPT + [2] * 20, **cache))[1]
    assert a[:5] == b[:5] and a[5] != b[5]


def test_keys_chain_the_whole_prefix_and_the_seed():
    first = cut.seed(MADE_BY, "f")
    keys = cut.chunk_keys(first, PROMPT, C)
    assert len(keys) == 5 and len(set(keys)) == 5
    assert cut.chunk_keys(first, PROMPT[:48] + [0] * 10, C) == keys[:3]
    changed_early = cut.chunk_keys(first, [0] + PROMPT[1:], C)
    assert not set(changed_early) & set(keys), "a chunk's key depends on every token before it"
    assert cut.chunk_keys(cut.seed(MADE_BY, "g"), PROMPT, C)[0] != keys[0]
    assert cut.chunk_keys(cut.seed({**MADE_BY, "model_path": "/n.gguf"}, "f"), PROMPT, C)[0] != keys[0]
    assert cut.seed({**MADE_BY, "n_ctx": 8192}, "f") == first, "the context size changes no row"


def test_a_chunk_of_the_wrong_size_is_refused():
    layout, chunks, tail = split(slot_file(PROMPT))
    with pytest.raises(ValueError):
        cut.assemble(layout, tail, lambda i: chunks[i][:-1], len(chunks), C, io.BytesIO())


# -- the store on disk -----------------------------------------------------------
@pytest.fixture
def files(tmp_path):
    return ChunkedFiles(SessionStore(tmp_path), chunk_tokens=C)


def test_a_save_is_stored_as_chunks_and_comes_back_whole(files):
    data = slot_file(PROMPT + [5, 6, 7])
    save(files, "a", data)
    assert not files.store.bin_path("a").exists() and files.store.chunked_path("a").exists()
    assert restored(files, "a") == data
    assert not list(files.store.root.glob("*.restoring.bin")), "the assembled file is removed"
    assert files.check("a") == (files.store.read_sidecar("a"), None)
    assert files.tokens("a") == PROMPT + [5, 6, 7] and files.store.bin_bytes("a") == len(data)
    sidecar = files.store.read_sidecar("a")
    assert sidecar["stored_as"] == "chunks" and sidecar["chunks"] == 5
    assert sidecar["written_bytes"] < len(data) * 1.2


def test_a_second_conversation_behind_the_same_prompt_writes_only_what_is_new(files):
    save(files, "a", slot_file(PROMPT + [1] * 40))
    before = sorted(k for k, _ in files.chunks.keys())
    save(files, "b", slot_file(PROMPT + [2] * 40))
    after = sorted(k for k, _ in files.chunks.keys())
    assert len(before) == 7 and len(after) == 9, "the five chunks of the prompt are stored once"
    per_token = layout_of(slot_file(PROMPT)).bytes_per_token
    written = files.store.read_sidecar("b")["written_bytes"]
    assert written < (40 + C) * per_token * 1.2, written
    assert restored(files, "b") == slot_file(PROMPT + [2] * 40)
    assert restored(files, "a") == slot_file(PROMPT + [1] * 40)


def test_one_more_turn_writes_its_new_tokens_and_at_most_one_chunk(files):
    save(files, "a", slot_file(PROMPT + [1] * 20))
    save(files, "a", slot_file(PROMPT + [1] * 20 + [3] * 12))
    per_token = layout_of(slot_file(PROMPT)).bytes_per_token
    assert files.store.read_sidecar("a")["written_bytes"] <= (12 + C) * per_token * 1.2
    assert restored(files, "a") == slot_file(PROMPT + [1] * 20 + [3] * 12)


def test_a_file_it_does_not_understand_is_kept_whole(files):
    data = slot_file(PROMPT, media=1)
    save(files, "m", data)
    assert files.store.bin_path("m").read_bytes() == data
    assert not files.store.chunked_path("m").exists()
    assert files.store.read_sidecar("m").get("stored_as") != "chunks"
    assert restored(files, "m") == data


def test_a_missing_or_damaged_chunk_keeps_the_session_from_being_restored(files):
    save(files, "a", slot_file(PROMPT))
    key = manifest.read_keys(files.store.chunked_path("a"))[2]
    files.chunks.path(key).write_bytes(b"short")
    assert "has 5 bytes" in files.check("a")[1]
    files.chunks.path(key).unlink()
    assert "is missing" in files.check("a")[1]
    with pytest.raises(Exception):
        restored(files, "a")
    assert files.set_aside("a", "missing chunk") and not files.has("a")


def test_a_manifest_of_a_newer_format_is_refused_loudly(files):
    save(files, "a", slot_file(PROMPT))
    path = files.store.chunked_path("a")
    raw = bytearray(path.read_bytes())
    raw[8:12] = (manifest.FORMAT + 1).to_bytes(4, "little")
    path.write_bytes(bytes(raw))
    assert "newer kvproxy" in files.check("a")[1]


def test_deleting_a_conversation_frees_only_what_it_alone_used(files):
    save(files, "a", slot_file(PROMPT + [1] * 40))
    save(files, "b", slot_file(PROMPT + [2] * 40))
    total, own = files.usage()
    chunk = cut.chunk_bytes(layout_of(slot_file(PROMPT)), C)
    assert own == {"a": 2 * chunk, "b": 2 * chunk} and total == 9 * chunk
    assert files.delete("a")
    assert len(list(files.chunks.keys())) == 7
    assert restored(files, "b") == slot_file(PROMPT + [2] * 40)


def test_the_budget_counts_shared_chunks_once_and_evicts_by_what_a_session_alone_holds(tmp_path):
    files = ChunkedFiles(SessionStore(tmp_path), chunk_tokens=C)
    save(files, "a", slot_file(PROMPT + [1] * 40))
    save(files, "b", slot_file(PROMPT + [2] * 40))
    entries, total = files.budget.entries(set())
    on_disk = sum(p.stat().st_size for p in tmp_path.rglob("*") if p.is_file()
                  and (p.suffix == ".chunked" or "chunks" in p.parts))
    assert total == on_disk
    chunk = cut.chunk_bytes(layout_of(slot_file(PROMPT)), C)
    sizes = {e.stem: e.size for e in entries}
    assert sizes == {s: files.store.chunked_path(s).stat().st_size + 2 * chunk for s in "ab"}


# -- crashes and the start-up sweep ------------------------------------------------
def test_a_whole_file_beside_a_manifest_is_the_newer_save(files):
    save(files, "a", slot_file(PROMPT))
    newer = slot_file(PROMPT + [9] * 20)
    files.store.bin_path("a").write_bytes(newer)   # a crash after install, before the cut
    files.store.update_sidecar("a", {}, saved_bytes=len(newer), stored_as="file")
    assert restored(files, "a") == newer
    lines = files.sweep()
    assert any("is newer" in line for line in lines) and not files.store.chunked_path("a").exists()
    assert restored(files, "a") == newer


@pytest.mark.parametrize("step", ["chunk", "manifest", "delete_whole"])
def test_a_crash_at_any_step_of_a_cut_leaves_the_newest_complete_save(files, monkeypatch, step):
    save(files, "a", slot_file(PROMPT))
    newer = slot_file(PROMPT + [4] * 40)

    class Killed(BaseException):
        pass

    def die(*args, **kwargs):
        raise Killed()
    if step == "chunk":
        monkeypatch.setattr(os, "link", die)
    elif step == "manifest":
        monkeypatch.setattr(manifest.os, "replace", die)
    else:
        monkeypatch.setattr("kvproxy.storage.chunks.files.unlink_with_companions", die)
    with pytest.raises(Killed):
        save(files, "a", newer)
    monkeypatch.undo()
    files.sweep()
    assert restored(files, "a") == newer
    assert files.check("a")[1] is None
    assert not [p for p in files.store.root.rglob("*") if ".tmp" in p.name]


def test_the_sweep_frees_chunks_no_manifest_names_and_leftovers(files):
    save(files, "a", slot_file(PROMPT))
    files.chunks.put("f" * 64, [b"orphan"])
    (files.chunks.root / "ff" / ".tmp-half").write_bytes(b"half")
    (files.store.root / "a.1234.restoring.bin").write_bytes(b"assembled")
    lines = files.sweep()
    assert not files.chunks.has("f" * 64) and not list(files.chunks.leftovers())
    assert not list(files.store.root.glob("*.restoring.bin")) and lines
    assert restored(files, "a") == slot_file(PROMPT)


def test_the_first_writer_of_a_chunk_wins(files):
    assert files.chunks.put("ab" * 32, [b"first"]) == 5
    assert files.chunks.put("ab" * 32, [b"second"]) == 0
    assert files.chunks.read("ab" * 32) == b"first"


def test_the_tokens_of_a_manifest_are_read_without_its_chunks(files, tmp_path):
    save(files, "a", slot_file(PROMPT))
    assert manifest.tokens(files.store.chunked_path("a")) == PROMPT
    assert slot_file_head.tokens(files.store.chunked_path("a")) is None, "not a slot file"
    meta = json.loads(files.store.chunked_path("a").read_bytes()[16:].split(b"\xff")[0][:0] or b"{}")
    assert meta == {}


def test_a_manifest_whose_tail_was_cut_short_is_not_trusted(files):
    save(files, "a", slot_file(PROMPT + [1] * 8))
    path = files.store.chunked_path("a")
    path.write_bytes(path.read_bytes()[:-100])
    assert "its tail is not" in files.check("a")[1]
    files.set_aside("a", "torn")
    assert not files.has("a") and list((files.store.root / "quarantine").glob("a.*.chunked"))


def test_a_file_shorter_than_one_chunk_stays_whole(files):
    data = slot_file(PROMPT[:C - 1])
    save(files, "short", data)
    assert files.store.bin_path("short").read_bytes() == data
    assert not list(files.chunks.keys())


def test_the_benchmarks_check_of_the_folder_reads_both_kinds_of_file(files):
    from bench.readings import files_match_sidecars
    save(files, "a", slot_file(PROMPT))
    save(files, "short", slot_file(PROMPT[:C - 1]))
    for stem in ("a", "short"):
        files.store.update_sidecar(stem, {}, n_bytes=files.store.bin_bytes(stem))
    assert files_match_sidecars(files.store.root) == []
    files.chunks.path(manifest.read_keys(files.store.chunked_path("a"))[0]).unlink()
    assert [line.split(":")[0] for line in files_match_sidecars(files.store.root)] == ["a.chunked"]


def test_a_crash_in_the_middle_of_freeing_chunks_leaves_every_named_chunk(files, monkeypatch):
    save(files, "a", slot_file(PROMPT + [1] * 40))
    save(files, "b", slot_file(PROMPT + [2] * 40))
    files.store.delete("b")        # b's own chunks are now named by no manifest
    removed = []
    real_remove = files.chunks.remove

    def remove_once(key):
        if removed:
            raise KeyboardInterrupt()   # killed after the first deletion
        removed.append(key)
        return real_remove(key)
    monkeypatch.setattr(files.chunks, "remove", remove_once)
    with pytest.raises(KeyboardInterrupt):
        files.sweep()
    monkeypatch.undo()
    assert restored(files, "a") == slot_file(PROMPT + [1] * 40)
    files.sweep()                  # the next start finishes it
    assert len(list(files.chunks.keys())) == 7


def test_every_model_of_a_folder_shares_one_chunk_folder_and_frees_none_of_anothers(tmp_path):
    default = ChunkedFiles(SessionStore(tmp_path), chunk_tokens=C)
    other = ChunkedFiles(SessionStore(tmp_path, model="other"), chunk_tokens=C)
    assert default.chunks.root == other.chunks.root
    save(default, "a@m", slot_file(PROMPT))
    save(other, "b@other", slot_file(PROMPT + [1] * 16))
    assert other.free() == 0 and default.free() == 0
    assert restored(default, "a@m") == slot_file(PROMPT)
    assert restored(other, "b@other") == slot_file(PROMPT + [1] * 16)


def test_freeing_waits_for_a_cut_in_progress(files):
    import threading
    save(files, "a", slot_file(PROMPT))
    files.store.delete("a")
    with files.naming_chunks():
        freeing = threading.Thread(target=files.free)
        freeing.start()
        freeing.join(0.3)
        assert freeing.is_alive() and len(list(files.chunks.keys())) == 5
    freeing.join(5)
    assert list(files.chunks.keys()) == []
