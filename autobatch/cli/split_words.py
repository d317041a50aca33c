"""Overrides the shell took apart before the command saw them, named with the quoting that keeps them whole.

A dict or list override typed without quotes, ``model={_target_: torch.nn.Linear, in_features: 8}``,
reaches the command as several words, split at its spaces (``model={_target_:``,
``torch.nn.Linear,``, ``in_features:``, ``8}``). Hydra then reports the first word alone
(``no viable alternative at input '{_target_:'``) and the hint for a bad character advised
quoting that word as a string, which composes the wrong value; a ``model=`` that did parse
went on to "_target_ is not set". Written without spaces, bash's brace expansion splits it
another way (``model={_target_:torch.nn.Linear,in_features:8}`` arrives as
``model=_target_:torch.nn.Linear model=in_features:8``, one override per item). Both are told
apart from a plain mistake here, before Hydra parses anything, and become one line that shows
the override whole, quoted for the shell: ``'model={_target_: torch.nn.Linear, in_features: 8}'``.
"""

from __future__ import annotations

import shlex
from typing import Sequence

from .errors import CLIError

__all__ = ["check_split", "key_by_key"]

#: Hydra flags followed by a value in the next word (``--cfg job``); ``--info``'s value is optional.
_VALUED = {"-c", "--cfg", "-p", "--package"}
_INFO = ({"-i", "--info"}, {"all", "config", "defaults", "defaults-tree", "plugins", "searchpath"})
_OPEN, _CLOSE = "[{(", "]})"


def _depth(word: str) -> int:
    """Brackets ``word`` opens minus those it closes, outside quotes."""
    depth, quote = 0, ""
    for char in word:
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in _OPEN:
            depth += 1
        elif char in _CLOSE:
            depth -= 1
    return depth


def _is_override(word: str) -> bool:
    return "=" in word and not word.startswith("-")


def _words(args: Sequence[str]) -> list[tuple[int, str]]:
    """``(index, word)`` of each argument that is no flag and no flag's value."""
    words, skip = [], False
    for index, arg in enumerate(args):
        if skip:
            skip = False
            continue
        if arg.startswith("-"):
            skip = ("=" not in arg and arg in _VALUED) or (
                arg in _INFO[0] and index + 1 < len(args) and args[index + 1] in _INFO[1])
            words.append((index, "\0flag"))
            continue
        words.append((index, arg))
    return words


def _split_apart(args: Sequence[str]) -> tuple[str, list[str]] | None:
    """The first override split at its spaces: ``(the override whole, its words)``, else None."""
    words = [word for _, word in _words(args)]
    for start, word in enumerate(words):
        if not _is_override(word) or not (_depth(word) > 0 or word.endswith((",", ":", "="))):
            continue  # a whole override: a stray word after it is a mistake of its own
        depth, pieces = _depth(word), [word]
        for following in words[start + 1:]:
            if following == "\0flag" or (depth <= 0 and _is_override(following)):
                break
            pieces.append(following)
            depth += _depth(following)
        if len(pieces) > 1 and (depth <= 0 or not any(_is_override(piece) for piece in pieces[1:])):
            return " ".join(pieces), pieces
    return None


def _brace_expanded(args: Sequence[str]) -> tuple[str, list[str]] | None:
    """Consecutive overrides of one key whose values are ``name:value`` items (bash's brace
    expansion of ``key={a:1,b:2}``): ``(the override whole, its words)``, else None."""
    words = [word for _, word in _words(args)]
    for start, word in enumerate(words):
        key, _, value = word.partition("=")
        if not _is_override(word) or ":" not in value or value.startswith(("'", '"', "{", "[", "$")):
            continue
        run = [word]
        for following in words[start + 1:]:
            if not following.startswith(f"{key}=") or ":" not in following.partition("=")[2]:
                break
            run.append(following)
        if len(run) > 1:
            items = [item.partition("=")[2] for item in run]
            return f"{key}={{{', '.join(item.replace(':', ': ', 1) for item in items)}}}", run
    return None


def check_split(args: Sequence[str]) -> None:
    """Raise :class:`CLIError` when the shell split one override into several words (at its
    spaces, or by brace expansion), naming the override whole and the quotes that keep it so."""
    found = _split_apart(args)
    how = "at its spaces"
    if found is None:
        found, how = _brace_expanded(args), "by brace expansion (bash turns key={a:1,b:2} into key=a:1 key=b:2)"
    if found is None:
        return _check_bare_word(args)
    whole, pieces = found
    close = " (and close its bracket)" if _depth(whole) > 0 else ""
    fix = f"quote it whole{close}: {shlex.quote(whole)}"
    by_key = key_by_key(whole)
    if by_key:  # the quoted dict would be merged into the option's schema, which lacks its arguments
        fix = f"give it key by key (no quotes needed): {by_key}"
    raise CLIError(f"the shell split the override {whole!r} into {len(pieces)} words {how}: {pieces}; {fix}")


def _check_bare_word(args: Sequence[str]) -> None:
    """Raise :class:`CLIError` for a word that is no override (``KEY=VALUE``, ``~KEY``): Hydra's "cannot parse the
    override 'mlp' (missing EQUAL at '<EOF>')" named neither the form nor, after ``probe.memory_limit=2 MiB``, the
    space that split a value."""
    words = [word for _, word in _words(args)]
    for index, word in enumerate(words):
        if word == "\0flag" or "=" in word or word.startswith("~"):
            continue
        before = words[index - 1] if index else ""
        if _is_override(before) and not before.endswith("="):
            raise CLIError(f"{word!r} is no override (KEY=VALUE); if it is part of {before}'s value, the shell "
                           f"split that at its space: quote it whole: {shlex.quote(f'{before} {word}')}")
        from .dict_target import packaged_options

        groups = ("model", "data", "optimizer", "scheduler", "device", "probe")
        chosen = [f"{group}={word}" for group in groups if word in packaged_options(group) | {"target"}]
        hint = f" (did you mean {' or '.join(chosen)}?)" if chosen else " (a config group's option is GROUP=OPTION: model=mlp)"
        raise CLIError(f"{word!r} is no override: each word after the command is KEY=VALUE{hint}")


def key_by_key(whole: str) -> str | None:
    """``model=target model._target_=torch.nn.Linear +model.in_features=8`` for a dict with a
    ``_target_`` given to a group that has a ``target`` option: quoted whole, the dict is merged
    into the group's default option (``model`` is ``gpt``), whose schema has none of its
    arguments, so the quotes alone lead to a second error. None for any other override."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        override = OverridesParser.create().parse_override(whole)
    except Exception:  # noqa: BLE001 - unparsable even whole (an unclosed bracket): the quoting advice stands
        return None
    key, value = override.get_key_element(), override.value()
    if key not in _TARGET_GROUPS or not isinstance(value, dict) or "_target_" not in value:
        return None
    if not all(isinstance(item, (str, int, float, bool)) for item in value.values()):
        return None
    import dataclasses

    from .config import ModelConfig, OptimizerConfig
    from .schedulers import SchedulerConfig

    schema = {"model": ModelConfig, "optimizer": OptimizerConfig, "scheduler": SchedulerConfig}[key]
    own = {field.name for field in dataclasses.fields(schema)}  # set without +; any other is added with +
    words = [f"{key}=target", f"{key}._target_={value['_target_']}"]
    words += [f"{'' if name in own else '+'}{key}.{name}={str(item).lower() if isinstance(item, bool) else item}"
              for name, item in value.items() if name != "_target_"]
    return " ".join(shlex.quote(word) for word in words)


#: Config groups with a ``target`` option (any class by import path, its arguments added with ``+``).
_TARGET_GROUPS = {"model", "optimizer", "scheduler"}
