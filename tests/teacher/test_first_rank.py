from tests.launcher import run_workers


def test_every_rank_gets_the_first_ranks_result_or_its_failure(tmp_path):
    """Any exception on the first rank reaches the others (which would otherwise wait for a broadcast)."""
    ranks = run_workers("first_rank_errors.py", 2, tmp_path, timeout=120)
    assert ranks[0] == ranks[1]
    assert ranks[1]["value"] == ["ok", {"url": "http://teacher:1"}]
    assert ranks[1]["unexpected"] == ["TeacherError", "AttributeError: 'str' object has no attribute 'get'"]
    assert ranks[1]["config"] == ["ModelConfigError", "vocab 10 != 12"]
