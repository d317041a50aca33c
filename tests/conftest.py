"""Test configuration: autobatch's per-trial log lines are captured at INFO."""

import logging

import pytest


@pytest.fixture(autouse=True)
def _autobatch_logging(caplog):
    caplog.set_level(logging.INFO, logger="autobatch")
