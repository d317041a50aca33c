"""Shared fixtures: every test gets its own probe cache directory, so no test writes to the
real user cache or sees another test's entries."""

import pytest


@pytest.fixture(autouse=True)
def isolated_probe_cache(tmp_path_factory, monkeypatch):
    directory = tmp_path_factory.mktemp("autobatch-cache")
    monkeypatch.setenv("AUTOBATCH_CACHE_DIR", str(directory))
    return directory
