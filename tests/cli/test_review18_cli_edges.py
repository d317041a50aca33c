"""Review 18: what a Hydra user meets at the command line's edge.

* An override Hydra's grammar cannot read (``hydra.run.dir=runs/ü``: an accented letter, a
  stray bracket) was ``LexerNoViableAltException: ... ^``, naming neither cause nor fix; now the
  line gives the quoted form that Hydra reads.
* ``HYDRA_FULL_ERROR=1``, Hydra's own switch for tracebacks, was ignored.
* A ``_target_`` whose constructor needs an argument nobody gave said ``check model=target
  model._target_=...`` (the override that was right); now it names ``+model.width=VALUE``.
* ``model._target_=mymodels.Net`` beside ``mymodels.py`` was "no module named 'mymodels'" under
  the ``autobatch`` console script (no current directory on ``sys.path``); now it says so.
* A sweep whose jobs all failed wrote a ``summary.csv`` without its command's columns
  (``cached``, ``final_loss``), so a script reading them back failed.
"""

from __future__ import annotations

import shlex
import sys

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.utils import JobReturn, JobStatus
from hydra.errors import OverrideParseException
from omegaconf import OmegaConf

from autobatch.cli.build import locate
from autobatch.cli.construct import construct
from autobatch.cli.errors import BAD_INPUT, describe, traceback_wanted
from autobatch.cli.sweep import COMMAND_COLUMNS, PLAN_COLUMNS, _job_row


@pytest.mark.parametrize("override", ["hydra.run.dir=runs/ü", "model.layers=3)"])
def test_an_unparsable_override_names_the_quoted_form_hydra_reads(override):
    with pytest.raises(OverrideParseException) as raised:
        OverridesParser.create().parse_overrides([override])
    message, code = describe(raised.value)
    assert code == BAD_INPUT and "LexerNoViableAltException" not in message, message
    key, value = override.split("=", 1)
    quoted = message.rsplit(": ", 1)[1]
    assert quoted == shlex.quote(f'{key}="{value}"'), message
    parsed = OverridesParser.create().parse_overrides([shlex.split(quoted)[0]])[0]  # the advice parses
    assert parsed.value() == value


def test_hydra_full_error_asks_for_the_traceback(monkeypatch):
    monkeypatch.delenv("AUTOBATCH_TRACEBACK", raising=False)
    monkeypatch.setenv("HYDRA_FULL_ERROR", "0")
    assert traceback_wanted() is False
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    assert traceback_wanted() is True


class NeedsWidth:
    """A user's model whose constructor takes a required argument."""

    def __init__(self, width: int, *, depth: int) -> None:
        self.width, self.depth = width, depth


class CallsBadly:
    """A model whose own ``__init__`` calls something without its argument: the user's bug."""

    def __init__(self) -> None:
        NeedsWidth(3)  # type: ignore[call-arg]


def test_a_missing_constructor_argument_names_the_override_that_adds_it():
    with pytest.raises(ValueError, match=r"give \+model\.width=VALUE$"):
        construct("model", {"_target_": f"{__name__}.NeedsWidth", "depth": 2})
    with pytest.raises(ValueError, match=r"give \+model\.depth=VALUE$"):  # keyword-only
        construct("model", {"_target_": f"{__name__}.NeedsWidth", "width": 2})
    with pytest.raises(ValueError) as raised:  # not the model's argument: its code's line, no + advice
        construct("model", {"_target_": f"{__name__}.CallsBadly"})
    assert "+model." not in str(raised.value) and f"raised at {__file__}:" in str(raised.value)


def test_the_console_script_imports_from_the_current_directory(monkeypatch, tmp_path, capsys):
    """The ``autobatch`` console script had no current directory on ``sys.path`` (``python -m``
    has): ``model._target_=mymodels.Net`` beside ``mymodels.py`` was "no module named"."""
    from autobatch.__main__ import main

    (tmp_path / "review18_mymodels.py").write_text("class Net:\n    pass\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [entry for entry in sys.path if entry not in ("", ".", str(tmp_path))])
    with pytest.raises(ImportError, match="no module named 'review18_mymodels'"):
        locate("review18_mymodels.Net")
    assert main(["--version"]) == 0
    assert locate("review18_mymodels.Net").__name__ == "Net"


@pytest.mark.parametrize(("command", "global_batch", "columns"), [
    ("train", None, COMMAND_COLUMNS["train"]),
    ("probe", None, COMMAND_COLUMNS["probe"]),
    ("probe", 64, COMMAND_COLUMNS["probe"] + PLAN_COLUMNS),
])  # fmt: skip
def test_a_failed_jobs_row_has_its_commands_columns(command, global_batch, columns):
    config = OmegaConf.create({"train": {"global_batch": global_batch},
                               "hydra": {"job": {"num": 0, "name": command}, "overrides": {"task": ["a=1"]}}})
    row = _job_row(config, JobReturn(overrides=["a=1"], status=JobStatus.FAILED, _return_value=KeyError("lr")))
    assert {column: row[column] for column in columns} == dict.fromkeys(columns)
    assert row["status"] == "failed" and row["error"] == "KeyError: 'lr'"


def test_review35_a_misspelt_module_names_the_closest(monkeypatch, tmp_path):
    """``model._target_=mymodel.Net`` beside ``mymodels.py`` said "no module named 'mymodel'" with no
    suggestion (a misspelt class got one); a package's misspelt submodule was looked for among its attributes."""
    (tmp_path / "review35_mymodels.py").write_text("class Net:\n    pass\n")
    (tmp_path / "review35_pkg").mkdir()
    (tmp_path / "review35_pkg" / "__init__.py").write_text("")
    (tmp_path / "review35_pkg" / "models.py").write_text("class Net:\n    pass\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        with pytest.raises(ImportError, match=r"no module named 'review35_mymodel'; did you mean review35_mymodels\.Net\?$"):
            locate("review35_mymodel.Net")
        with pytest.raises(ImportError, match=r"has no attribute 'modls'; did you mean review35_pkg\.models\.Net\?$"):
            locate("review35_pkg.modls.Net")
    finally:
        sys.modules.pop("review35_pkg", None)
