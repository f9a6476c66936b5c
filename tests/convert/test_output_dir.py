"""Staging and publishing of conversion outputs: replace only what --overwrite allows, all or nothing."""

import pytest

from megatron_armor.convert.output_dir import OutputExistsError, check_output_dir, fresh_staging_dir, publish, staging_dir


def is_marked(path) -> bool:
    return (path / "MARK").is_file()


def test_publish_replaces_an_allowed_checkpoint(tmp_path):
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "MARK").write_text("old")
    with pytest.raises(OutputExistsError, match="pass --overwrite"):
        check_output_dir(out, overwrite=False, is_checkpoint=is_marked, kind="test")
    check_output_dir(out, overwrite=True, is_checkpoint=is_marked, kind="test")
    staging = fresh_staging_dir(out)
    (staging / "MARK").write_text("new")
    publish(staging, out)
    assert (out / "MARK").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no staging or previous copy left


def test_empty_or_missing_directories_are_fine_and_stale_staging_is_cleared(tmp_path):
    (tmp_path / "empty").mkdir()
    for out in (tmp_path / "empty", tmp_path / "missing"):
        check_output_dir(out, overwrite=False, is_checkpoint=is_marked, kind="test")
    stale = staging_dir(tmp_path / "missing")
    stale.mkdir()
    (stale / "half-written").write_text("x")
    assert list(fresh_staging_dir(tmp_path / "missing").iterdir()) == []


def test_a_file_is_refused(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputExistsError, match="is a file"):
        check_output_dir(tmp_path / "file", overwrite=True, is_checkpoint=is_marked, kind="test")
