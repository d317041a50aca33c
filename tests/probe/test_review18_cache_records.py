"""Probe results read back by another process or version, and a cache that cannot be written
(review 18, CPU): a trial field a newer autobatch added made ``ProbeResult.from_dict`` raise a
``TypeError`` (and ``cache list`` skip the entry as malformed), a dict without the result's fields
raised a bare ``KeyError: 'trials'``, and a full disk warned again on every probe of a process."""

import errno
import json
import logging

import pytest

from autobatch import ProbeResult
from autobatch.probe.caching import cache as cache_module
from autobatch.probe.caching.cache import ProbeCache
from autobatch.probe.trial import TrialRecord


def _result() -> ProbeResult:
    trials = [TrialRecord(64, True, 2_000_000, 0.1, steps=3), TrialRecord(128, False, 3_900_000, 0.05, error="OOM")]
    return ProbeResult(batch_size=64, strategy="auto", strategy_used="binary", trials=trials, capacity_bytes=4 << 20,
                       elapsed_s=0.2, margin=0.0, notes=["a note"], promise={"steps": 3})


def test_a_newer_or_older_result_reads_back_and_a_wrong_dict_says_what_to_pass():
    data = json.loads(_result().to_json())
    newer = {**data, "added_later": 1, "trials": [{**trial, "added_later": 2} for trial in data["trials"]]}
    assert ProbeResult.from_dict(newer) == _result()
    older = {key: value for key, value in data.items() if key not in ("promise", "diagnostics", "estimate")}
    older["trials"] = [{key: value for key, value in trial.items() if key not in ("flushes", "wall_bytes")}
                       for trial in data["trials"]]
    assert ProbeResult.from_dict(older).trials == _result().trials
    with pytest.raises(ValueError, match="lacks trials, elapsed_s.*ProbeResult.to_dict"):
        ProbeResult.from_dict({key: value for key, value in data.items() if key not in ("trials", "elapsed_s")})
    with pytest.raises(ValueError, match="a trial lacks passed"):
        ProbeResult.from_dict({**data, "trials": [{"batch_size": 8, "peak_bytes": 1, "seconds": 0.1}]})
    with pytest.raises(TypeError, match=r"json.loads\(text\)"):
        ProbeResult.from_dict(_result().to_json())


def test_an_entry_with_a_newer_trial_field_is_listed(tmp_path, caplog):
    store = ProbeCache(tmp_path)
    path = store.put("a" * 64, {"model": "m"}, _result())
    entry = json.loads(path.read_text())
    entry["result"]["trials"][0]["added_later"] = 1
    path.write_text(json.dumps(entry))
    with caplog.at_level(logging.WARNING, logger="autobatch"):
        assert [found.batch_size for found in store.entries()] == [64]
        assert store.get("a" * 64).batch_size == 64
    assert "ignoring" not in caplog.text


def test_a_full_disk_warns_once_and_caches_nothing(tmp_path, caplog, monkeypatch):
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(cache_module.tempfile, "mkstemp", full)
    store = ProbeCache(tmp_path)
    with caplog.at_level(logging.WARNING, logger="autobatch"):
        assert store.put("b" * 64, {}, _result()) is None
        assert store.put("c" * 64, {}, _result()) is None
    assert caplog.text.count("could not write the probe cache entry") == 1
    assert "No space left" in caplog.text and "AUTOBATCH_CACHE_DIR" in caplog.text
    assert store.entries() == []
