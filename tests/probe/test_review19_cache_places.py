"""Review 19: a cache "directory" that is a file (``cache="result.json"``, or a path under a file)
was two warnings, the first calling the entry "not readable JSON (NotADirectoryError ...)"; it is
now a miss and one warning that says the cache is a directory."""

from __future__ import annotations

import logging

from autobatch.probe.caching import cache as probe_cache
from autobatch.probe.caching.cache import ProbeCache
from autobatch.probe.result import ProbeResult


def test_a_cache_path_that_is_a_file_is_one_warning_saying_so(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(probe_cache, "_warned", set())
    file = tmp_path / "result.json"
    file.write_text("{}")
    result = ProbeResult(batch_size=8, strategy="binary", strategy_used="binary", trials=[], capacity_bytes=None,
                         elapsed_s=0.0, margin=0.0)
    for where in (file, file / "cache"):
        store = ProbeCache(where)
        with caplog.at_level(logging.WARNING, logger="autobatch"):
            assert store.get("0" * 64) is None
            assert store.put("0" * 64, {}, result) is None
    messages = [record.getMessage() for record in caplog.records]
    assert len(messages) == 2 and all("is a file or lies under one" in message for message in messages)
    assert not any("JSON" in message for message in messages)
    assert file.read_text() == "{}"
