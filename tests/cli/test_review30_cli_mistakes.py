"""Review 30: the README's quick start, each with one plausible mistake. ``train.resume=lastest`` said only "no
checkpoint at .../lastest" (a path that was never meant); a value close to ``latest`` now names it. A word that
is no override (``probe mlp``, or ``probe.memory_limit=2 MiB`` split at its space) was Hydra's "cannot parse the
override 'mlp' (missing EQUAL at '<EOF>')"; it is now one line naming ``model=mlp`` or the quotes to add."""

from __future__ import annotations

import pytest

from autobatch.cli.errors import CLIError
from autobatch.cli.split_words import check_split
from autobatch.cli.training import find_resume


def test_a_misspelt_latest_names_train_resume_latest(tmp_path):
    with pytest.raises(ValueError, match=r"no checkpoint at \S+lastest \(did you mean train\.resume=latest\?\); give"):
        find_resume("lastest", "checkpoints", tmp_path)
    with pytest.raises(ValueError) as caught:  # a path of another name gets no such advice
        find_resume("runs/old", "checkpoints", tmp_path)
    assert "did you mean" not in str(caught.value)


def test_a_bare_word_names_the_group_option_or_the_split_value():
    with pytest.raises(CLIError, match=r"'mlp' is no override: each word after the command is KEY=VALUE "
                                       r"\(did you mean model=mlp\?\)$"):
        check_split(["-m", "mlp"])
    with pytest.raises(CLIError, match=r"split that at its space: quote it whole: 'probe.memory_limit=2 MiB'$"):
        check_split(["probe.memory_limit=2", "MiB"])
    check_split(["--cfg", "job", "--info", "defaults", "~train.epochs", "model=mlp"])  # flags' values, a delete
