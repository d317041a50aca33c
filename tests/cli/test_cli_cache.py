"""The probe cache from the command line: ``probe.cache``, ``probe.cache_dir`` and
``python -m autobatch cache list|clear``. Every test has its own ``AUTOBATCH_CACHE_DIR``
(conftest), which the CLI subprocesses inherit through ``cli_env``."""

from __future__ import annotations

import json

from conftest import SMALL, run_cli

PROBE = ["probe", "model=mlp", *SMALL, "probe.memory_limit=1MiB"]


def result_of(tmp_path, name: str) -> dict:
    return json.loads((tmp_path / name / "result.json").read_text())


def test_a_repeated_probe_comes_from_the_cache_unless_turned_off(cli_here, tmp_path, isolated_probe_cache):
    """The first and the uncached runs go through ``main`` in this process; the second is a real
    ``python -m autobatch`` process, so the entry the first stored is found from another process."""
    first = cli_here(*PROBE, f"hydra.run.dir={tmp_path / 'first'}", dirs=False)
    assert first.returncode == 0, first.stderr
    assert result_of(tmp_path, "first")["cached"] is False and "from the probe cache" not in first.stdout
    assert len(list(isolated_probe_cache.glob("*.json"))) == 1  # stored under the per-test directory

    second = run_cli(*PROBE, f"hydra.run.dir={tmp_path / 'second'}", cwd=tmp_path)
    assert second.returncode == 0, second.stderr
    cached = result_of(tmp_path, "second")
    assert cached["cached"] is True and cached["batch_size"] == result_of(tmp_path, "first")["batch_size"]
    assert "cached          from the probe cache; no trial ran" in second.stdout

    fresh = cli_here(*PROBE, "probe.cache=false", f"hydra.run.dir={tmp_path / 'fresh'}", dirs=False)
    assert fresh.returncode == 0, fresh.stderr
    assert result_of(tmp_path, "fresh")["cached"] is False and "cached   " not in fresh.stdout
    assert (tmp_path / "fresh" / "probe.log").read_text().count("trial ") >= 1  # it really probed


def test_cache_list_and_clear(cli_here, tmp_path, isolated_probe_cache):
    empty = cli_here("cache", "list", dirs=False)
    assert empty.returncode == 0 and f"probe cache {isolated_probe_cache}: 0 entries" in empty.stdout
    done = cli_here(*PROBE, f"hydra.run.dir={tmp_path / 'run'}", dirs=False)
    assert done.returncode == 0, done.stderr
    batch = result_of(tmp_path, "run")["batch_size"]

    listed = cli_here("cache", "list", dirs=False)
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()
    assert lines[0] == f"probe cache {isolated_probe_cache}: 1 entry"
    assert lines[1].split() == ["key", "model", "device", "batch", "size", "created"]
    (entry,) = isolated_probe_cache.glob("*.json")
    row = lines[2]
    assert row.startswith(entry.stem[:12]) and " MLP " in row and "cpu" in row and f" {batch} " in row

    cleared = cli_here("cache", "clear", dirs=False)
    assert cleared.returncode == 0 and f"removed 1 entry from {isolated_probe_cache}" in cleared.stdout
    assert "0 entries" in cli_here("cache", "list", dirs=False).stdout


def test_probe_cache_dir_and_cache_dir_flag(cli_here, tmp_path, isolated_probe_cache):
    elsewhere = tmp_path / "my-cache"
    done = cli_here(*PROBE, f"probe.cache_dir={elsewhere}", f"hydra.run.dir={tmp_path / 'run'}", dirs=False)
    assert done.returncode == 0, done.stderr
    assert len(list(elsewhere.glob("*.json"))) == 1 and not list(isolated_probe_cache.glob("*.json"))
    listed = cli_here("cache", "list", "--dir", str(elsewhere), dirs=False)
    assert f"probe cache {elsewhere}: 1 entry" in listed.stdout


def test_cache_dir_that_is_missing_or_a_file_is_one_line(tmp_path, capsys, monkeypatch):
    """A mistyped --dir used to list "0 entries" (and clear nothing) with exit status 0."""
    from autobatch.__main__ import main

    monkeypatch.delenv("AUTOBATCH_TRACEBACK", raising=False)
    afile = tmp_path / "afile"
    afile.write_text("mine")
    for action, where, words in [("list", tmp_path / "nowhere", "does not exist"), ("clear", afile, "is a file, not a directory")]:
        assert main(["cache", action, "--dir", str(where)]) == 2
        err = capsys.readouterr().err
        assert err == f"autobatch: error: cache {action} --dir {where}: {words}; give the cache directory (a probe's probe.cache_dir)\n"
    assert afile.read_text() == "mine"


def test_cache_list_skips_a_malformed_entry_with_a_warning(tmp_path, capsys, caplog):
    """An entry whose batch_size is null used to crash ``cache list`` (TypeError in int())."""
    import logging

    import autobatch
    from autobatch.__main__ import main
    from autobatch.probe.caching import cache as probe_cache
    from workloads import ThresholdStep

    autobatch.find_max_batch(ThresholdStep(50), cache_key="x", steps_per_trial=1, cache=tmp_path)
    (path,) = tmp_path.glob("*.json")
    entry = json.loads(path.read_text())
    entry["result"]["batch_size"] = None
    path.write_text(json.dumps(entry))
    probe_cache._warned.clear()
    with caplog.at_level(logging.WARNING, logger="autobatch"):
        assert main(["cache", "list", "--dir", str(tmp_path)]) == 0
    assert f"probe cache {tmp_path}: 0 entries" in capsys.readouterr().out
    assert any(f"{path}: malformed result (batch_size None" in r.getMessage() for r in caplog.records)


def test_cache_clear_on_a_directory_it_cannot_lock_is_one_line(tmp_path, capsys, monkeypatch):
    """A lock file that cannot be created used to end ``cache clear`` in a raw PermissionError
    traceback (EACCES), or a 60 s hang and a filelock.Timeout traceback (ENOENT)."""
    import errno
    import os
    import time

    from autobatch.__main__ import main

    monkeypatch.delenv("AUTOBATCH_TRACEBACK", raising=False)
    real = os.open
    for code in (errno.EACCES, errno.ENOENT):

        def refusing(path, flags, *args, **kwargs):
            if str(path).startswith(str(tmp_path)) and flags & os.O_CREAT:
                raise OSError(code, os.strerror(code), str(path))
            return real(path, flags, *args, **kwargs)

        monkeypatch.setattr(os, "open", refusing)
        began = time.monotonic()
        assert main(["cache", "clear", "--dir", str(tmp_path)]) == 1
        assert time.monotonic() - began < 10
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"autobatch: error: cache clear: cannot clear {tmp_path}: "), err
        assert f"{tmp_path / '.lock'} ({os.strerror(code)})" in err
