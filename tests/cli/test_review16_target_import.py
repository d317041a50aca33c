"""A ``_target_`` that imports but is no constructor, or whose module fails as it is imported.

``model._target_=torch.nn`` (a module) ended in Hydra's "Expected a callable target, got
'<module ...>'", naming no key; a user's module with a ``SyntaxError`` or any exception at import
time was a line about that error alone, not the key that named it. Both are one line naming
``<key>._target_``, and the module's own error stays chained for ``AUTOBATCH_TRACEBACK=1``.
"""

from __future__ import annotations

import sys

import pytest

from autobatch.__main__ import main


def _error(capsys, *args):
    assert main(["probe", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("autobatch: error: ") and err.count("\n") == 1, err
    return err


@pytest.mark.parametrize("key, target, words", [
    ("model", "torch.nn", "model._target_='torch.nn' names a module; give the class (or function) that builds the model"),
    ("optimizer", "torch.float32", "optimizer._target_='torch.float32' names a dtype, not a class or function"),
])
def test_a_target_that_is_not_callable_names_its_key(capsys, monkeypatch, key, target, words):
    monkeypatch.delenv("AUTOBATCH_TRACEBACK", raising=False)
    extra = ["model=target"] if key == "model" else []
    assert words in _error(capsys, *extra, f"{key}._target_={target}")


def test_a_module_that_fails_on_import_names_the_key_and_the_error(capsys, monkeypatch, tmp_path):
    monkeypatch.delenv("AUTOBATCH_TRACEBACK", raising=False)
    (tmp_path / "review16_broken.py").write_text("import torch\nvalue = 1 / 0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "review16_broken", raising=False)
    err = _error(capsys, "model=target", "model._target_=review16_broken.Net")
    assert "model._target_='review16_broken.Net' cannot be imported" in err and "ZeroDivisionError" in err
    assert "review16_broken.py:2" in err and err.rstrip().endswith("fix that module (or its installation)")


def test_review37_a_missing_module_the_users_module_imports_is_chained_with_its_place(monkeypatch, tmp_path):
    """A ``ModuleNotFoundError`` raised by the user's module importing a missing dependency was re-raised
    ``from None``: no place, no traceback under ``AUTOBATCH_TRACEBACK=1``, and "fix the import path" for a path
    that was right. It names the file and line of the import and the module to install, chained."""
    from omegaconf import OmegaConf

    from autobatch.cli.build import _check_target

    (tmp_path / "review37_needs_dep.py").write_text("import torch\nimport review37_absent_dep\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "review37_needs_dep", raising=False)
    with pytest.raises(ValueError) as caught:
        _check_target("model", OmegaConf.create({"_target_": "review37_needs_dep.Net"}))
    err = str(caught.value)
    assert "No module named 'review37_absent_dep'" in err and "review37_needs_dep.py:2" in err, err
    assert err.endswith("install the package that provides 'review37_absent_dep', or fix that import"), err
    assert isinstance(caught.value.__cause__, ModuleNotFoundError)  # the traceback AUTOBATCH_TRACEBACK=1 shows
