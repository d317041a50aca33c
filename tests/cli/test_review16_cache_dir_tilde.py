"""``cache list --dir=~/cache``: the shell expands no ``~`` after ``=``, so the directory was
"does not exist" although ``probe.cache_dir=~/cache`` (which is expanded) had just written it."""

from __future__ import annotations

from autobatch.__main__ import main


def test_a_tilde_in_cache_dir_is_the_home_directory(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "cache").mkdir()
    assert main(["cache", "list", "--dir=~/cache"]) == 0
    assert capsys.readouterr().out.startswith(f"probe cache {tmp_path / 'cache'}: 0 entries")
