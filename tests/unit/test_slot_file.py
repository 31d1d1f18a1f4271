"""Reading a slot file's tokens and KV format from its header, as llama.cpp writes it."""
import struct

import pytest

from kvproxy.upstream.slot_file import SLOT_FILE_MAGIC, kv_format, tokens
from tests.support import slot_file


def test_the_kv_format_names_cache_types_and_layout(tmp_path):
    assert kv_format(slot_file(tmp_path / "a.bin")) == "k=f16 v=f16 v_trans=0 layers=2 rot=0,0"
    assert kv_format(slot_file(tmp_path / "b.bin", k_type=8, v_type=8, rot=(64, 64))) == \
        "k=q8_0 v=q8_0 v_trans=0 layers=2 rot=64,64"
    assert kv_format(slot_file(tmp_path / "c.bin", v_trans=1, v_type=0)) == \
        "k=f16 v=f32 v_trans=1 layers=2 rot=0,0"


def test_cells_with_the_m_rope_extension_and_empty_streams_are_read(tmp_path):
    assert kv_format(slot_file(tmp_path / "a.bin", ext=8, k_type=2, v_type=2)) == \
        "k=q4_0 v=q4_0 v_trans=0 layers=2 rot=0,0"
    # -np 3: one stream a slot, the file's sequence in one of them; llama-server refuses it
    # under another stream count ("n_stream mismatch"), so the count is part of the format.
    assert kv_format(slot_file(tmp_path / "b.bin", empty_streams_first=2)) == \
        "k=f16 v=f16 v_trans=0 layers=2 rot=0,0 streams=3"


@pytest.mark.parametrize("content", [b"", b"junk" * 10, struct.pack("<III", 1, 1, 0)])
def test_a_file_that_is_not_a_slot_file_claims_no_format(tmp_path, content):
    path = tmp_path / "x.bin"
    path.write_bytes(content)
    assert kv_format(path) is None and kv_format(tmp_path / "missing.bin") is None


def test_an_empty_slot_claims_no_format_and_tokens_are_read(tmp_path):
    path = tmp_path / "empty.bin"
    path.write_bytes(struct.pack("<IIIII", SLOT_FILE_MAGIC, 1, 0, 1, 0))
    assert kv_format(path) is None and tokens(path) == []
    assert tokens(slot_file(tmp_path / "a.bin", cells=4)) == [0, 1, 2, 3]
