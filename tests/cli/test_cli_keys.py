"""The library's argument names in an error become the command line's keys."""

from autobatch.cli.errors import cli_keys


def test_the_checkpointing_hint_names_the_cli_key():
    message = "batch 1 does not fit, so accumulation cannot help; pass allow_checkpointing=True"
    assert cli_keys(message).endswith("pass plan.allow_checkpointing=true")
    assert cli_keys("allow_accumulation=True") == "plan.allow_accumulation=true"
