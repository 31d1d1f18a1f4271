"""The rule that keeps test file names and markers in step (checked at every collection)."""
from tests.conftest import misnamed


def test_a_real_test_outside_a_real_file_and_a_unit_test_inside_one_are_named():
    assert misnamed([("test_a_real.py", {"real"}), ("test_b.py", set()),
                     ("test_deploy_x_real.py", {"deploy"})]) == []
    assert misnamed([("test_client.py", {"real", "parametrize"})]) == ["test_client.py (marked real)"]
    assert misnamed([("test_down_real.py", set())]) == ["test_down_real.py (not marked real or deploy)"]


def test_no_test_file_imports_another():
    """Shared helpers live in tests/support.py (fixtures in conftest.py): a test file that
    imports another runs that file's module-level set-up and couples the two."""
    import re
    from pathlib import Path
    here = Path(__file__).resolve().parent
    pattern = re.compile(r"^\s*(from tests\.test_\w+ import|import tests\.test_)", re.M)
    assert [p.name for p in here.glob("test_*.py") if pattern.search(p.read_text())] == []
