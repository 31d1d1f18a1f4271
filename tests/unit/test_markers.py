"""The rule that keeps test folders and markers in step (checked at every collection)."""
from tests.conftest import misplaced


def test_a_test_outside_the_folder_of_its_markers_is_named():
    assert misplaced([("real/test_a_real.py", {"real"}), ("unit/test_b.py", set()),
                      ("deploy/test_c_real.py", {"real", "deploy"}),
                      ("deploy/test_d_real.py", {"deploy"})]) == []
    assert misplaced([("unit/test_client.py", {"real", "parametrize"})]) == [
        "unit/test_client.py (marked real: belongs in tests/real/)"]
    assert misplaced([("real/test_down_real.py", set())]) == [
        "real/test_down_real.py (not marked real or deploy: belongs in tests/unit/)"]
    assert misplaced([("real/test_x_real.py", {"real", "deploy"})]) == [
        "real/test_x_real.py (marked deploy/real: belongs in tests/deploy/)"]
    assert misplaced([("test_loose.py", set())]) == [
        "test_loose.py (not marked real or deploy: belongs in tests/unit/)"]


def test_no_test_file_imports_another():
    """Shared helpers live in tests/support.py (fixtures in conftest.py): a test file that
    imports another runs that file's module-level set-up and couples the two."""
    import re
    from pathlib import Path
    tests = Path(__file__).resolve().parents[1]
    pattern = re.compile(r"^\s*(from|import) (tests\.)?((unit|real|deploy)\.)?test_\w+\b", re.M)
    assert [p.name for p in tests.rglob("test_*.py") if pattern.search(p.read_text())] == []
