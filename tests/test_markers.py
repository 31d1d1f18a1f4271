"""The rule that keeps test file names and markers in step (checked at every collection)."""
from tests.conftest import misnamed


def test_a_real_test_outside_a_real_file_and_a_unit_test_inside_one_are_named():
    assert misnamed([("test_a_real.py", {"real"}), ("test_b.py", set()),
                     ("test_deploy_x_real.py", {"deploy"})]) == []
    assert misnamed([("test_client.py", {"real", "parametrize"})]) == ["test_client.py (marked real)"]
    assert misnamed([("test_down_real.py", set())]) == ["test_down_real.py (not marked real or deploy)"]
