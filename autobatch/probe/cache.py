"""A persistent cache of probe results, keyed by everything that changes the answer.

Re-probing the same model in every sweep job and every restart is waste. A probe result is
stored as one JSON file per key in a directory: ``$AUTOBATCH_CACHE_DIR``, else
``$XDG_CACHE_HOME/autobatch``, else ``~/.cache/autobatch``; or a directory given to
``find_max_batch(cache=path)``.

The key is the SHA-256 of a canonical JSON of its components (stored in the file too, so
:func:`list_entries` can show what each entry is):

* ``model``: the module tree (qualified names and classes), parameter and buffer names,
  shapes, dtypes and ``requires_grad``; which modules are activation-checkpointed;
* ``code``: a hash of the bytecode of the loss function and of every module class's
  ``forward`` (edit the model's forward and the key changes);
* ``inputs``: the structure, shapes and dtypes of ``make_batch(1)`` and ``make_batch(2)``
  (built with fake tensors, so nothing is allocated);
* ``optimizer``: its class and the hyperparameters that change its state or temporaries
  (momentum on or off, ``amsgrad``, ``foreach``, ``fused``, ...; not the learning rate);
* ``precision``: the autocast dtype and the grad scaler;
* ``device``: its name and capacity (in 64 MiB steps, so a few MiB of driver noise do not
  miss), and the memory cap; the torch and autobatch versions;
* ``probe``: the strategy and its parameters (``start``, ``max_batch``, ``margin``,
  ``multiple_of``, ``steps_per_trial``, ``search_steps``), and the allocator headroom a
  passing trial must leave on an accelerator (``autobatch.probe.ALLOCATOR_HEADROOM``).

A plain callable has no structure to key on; it is cached only under an explicit
``cache_key``. Writes are atomic (a temporary file, then ``os.replace``) under a file lock, so
concurrent sweep jobs never see half a file. A corrupt or foreign file is reported once (a
warning per path) and treated as a miss: the probe runs and the entry is rewritten.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from filelock import FileLock

from ..memory.allocator import expandable_segments
from ..version import __version__
from .result import ProbeResult
from .train_step import TrainStep

__all__ = ["SCHEMA", "CacheEntry", "ProbeCache", "default_dir", "list_entries", "clear", "key_components", "key_of"]

log = logging.getLogger("autobatch")

#: Version of the entry format; entries of another version are ignored (with a warning).
SCHEMA = 1
KIND = "autobatch.probe-result"
#: Device capacity enters the key in steps of this many bytes.
CAPACITY_STEP = 64 * 1024**2
#: Optimizer hyperparameters that change the optimizer's state or its temporaries.
STATE_HYPERPARAMETERS = (
    "momentum", "nesterov", "dampening", "amsgrad", "foreach", "fused", "capturable",
    "differentiable", "centered", "weight_decay", "decoupled_weight_decay",
)

_warned: set[str] = set()


def default_dir() -> Path:
    """``$AUTOBATCH_CACHE_DIR``, else ``$XDG_CACHE_HOME/autobatch``, else ``~/.cache/autobatch``."""
    explicit = os.environ.get("AUTOBATCH_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "autobatch"


# -- the key --------------------------------------------------------------------------------
def _hash_code(code: Any, digest: "hashlib._Hash") -> None:
    """Feed a code object into ``digest``: bytecode, names and constants, nested code objects
    (lambdas, generator expressions) by their content, never by their address."""
    digest.update(code.co_code)
    digest.update(repr(code.co_names).encode())
    for const in code.co_consts:
        if hasattr(const, "co_code"):
            _hash_code(const, digest)
        else:
            digest.update(repr(const).encode())


def _code_hash(fn: Any) -> str:
    code = getattr(fn, "__code__", None) or getattr(getattr(fn, "__call__", None), "__code__", None)
    if code is None:
        return getattr(fn, "__qualname__", type(fn).__qualname__)
    digest = hashlib.sha256()
    _hash_code(code, digest)
    return digest.hexdigest()[:16]


def _describe(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return {"shape": list(value.shape), "dtype": str(value.dtype), "device": value.device.type}
    if isinstance(value, dict):
        return {str(key): _describe(item) for key, item in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple)):
        return [_describe(item) for item in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return type(value).__qualname__


def _inputs(make_batch: Callable[[int], Any]) -> Any:
    """Shapes and dtypes of batches of 1 and 2, built with fake tensors (no memory)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            return [_describe(make_batch(1)), _describe(make_batch(2))]
    except Exception:  # noqa: BLE001 - a make_batch fake tensors cannot run: build them for real
        return [_describe(make_batch(1)), _describe(make_batch(2))]


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else list(value.shape)
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    return repr(value)


def _optimizer(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    groups = []
    for group in optimizer.param_groups:
        settings = {name: _plain(group[name]) for name in STATE_HYPERPARAMETERS if name in group}
        for name in ("momentum", "weight_decay"):  # only whether it is on changes memory
            if name in settings and isinstance(settings[name], (int, float)):
                settings[name] = bool(settings[name])
        groups.append({"params": len(group["params"]), **settings})
    state_tensors = sum(
        1 for state in optimizer.state.values() for value in state.values() if isinstance(value, torch.Tensor)
    )
    return {"class": type(optimizer).__qualname__, "groups": groups, "state_tensors": state_tensors}


def step_components(step: TrainStep) -> dict[str, Any]:
    """The parts of the key that describe a :class:`TrainStep`."""
    model = step.model
    classes = {type(module) for module in model.modules()}
    return {
        "model": {
            # with each module's settings: heads, a scale factor, train or eval change the memory
            "modules": [[name, type(module).__qualname__, _settings(module)] for name, module in model.named_modules()],
            "parameters": [
                [name, list(p.shape), str(p.dtype), p.requires_grad] for name, p in model.named_parameters()
            ],
            "buffers": [[name, list(b.shape), str(b.dtype)] for name, b in model.named_buffers()],
            # Blocks whose forward is replaced on the instance (activation checkpointing, by
            # autobatch's planner or anyone's wrapper) train with a different memory profile.
            "checkpointed": sorted(name for name, module in model.named_modules() if "forward" in module.__dict__),
        },
        "code": {
            "loss_fn": _code_hash(step.loss_fn),
            "forward": sorted(f"{cls.__qualname__}:{_code_hash(cls.forward)}" for cls in classes),
            "step": type(step).__qualname__,
        },
        "inputs": _inputs(step.make_batch),
        "optimizer": _optimizer(step.optimizer),
        "precision": {
            "autocast": str(step.autocast_dtype) if step.autocast_dtype is not None else None,
            "grad_scaler": type(step.grad_scaler).__qualname__ if step.grad_scaler is not None else None,
        },
        "clipping": step.max_grad_norm,  # clip_grad_norm_ allocates the norms of every gradient
    }


_PLAIN = (bool, int, float, str, type(None))


def _settings(module: torch.nn.Module) -> dict[str, Any]:
    """A module's plain public attributes (``num_heads``, ``scale_factor``, ``max_norm``,
    ``training``...): what shapes its activations beside its parameters' shapes and its code."""
    settings = {}
    for name, value in vars(module).items():
        if name.startswith("_"):
            continue
        if isinstance(value, (tuple, list)) and all(isinstance(item, _PLAIN) for item in value):
            value = list(value)
        elif not isinstance(value, _PLAIN):
            continue
        settings[name] = value if not isinstance(value, float) or math.isfinite(value) else str(value)
    return settings


def key_components(
    fn: Any,
    *,
    cache_key: Any = None,
    device: str,
    capacity: int | None,
    memory_limit: int | None,
    probe: dict[str, Any],
) -> dict[str, Any] | None:
    """Everything that changes a probe's answer, as JSON-able data; None when ``fn`` is a plain
    callable without a ``cache_key`` (nothing to key on)."""
    if isinstance(fn, TrainStep):
        components = step_components(fn)
    elif cache_key is not None:
        components = {}
    else:
        return None
    if cache_key is not None:
        components["user_key"] = _describe(cache_key) if not isinstance(cache_key, str) else cache_key
    components["device"] = {
        "name": device,
        "capacity_steps": None if capacity is None else capacity // CAPACITY_STEP,
        "memory_limit": memory_limit,
        "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),  # autotuned workspaces change the answer
    }
    if device.startswith("cuda"):  # where free memory may sit decides what fits at the edge
        components["device"]["expandable_segments"] = expandable_segments()
    components["versions"] = {"torch": torch.__version__, "autobatch": __version__}
    components["probe"] = dict(probe)
    return components


def key_of(components: dict[str, Any]) -> str:
    """SHA-256 of the canonical JSON of ``components``."""
    canonical = json.dumps(components, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


# -- the store ------------------------------------------------------------------------------
@dataclass
class CacheEntry:
    """One cached probe result, as :func:`list_entries` shows it."""

    key: str
    path: Path
    created: str
    batch_size: int
    device: str
    components: dict[str, Any]


def _warn_once(path: Path, why: str) -> None:
    if str(path) not in _warned:
        _warned.add(str(path))
        log.warning("ignoring probe cache file %s: %s", path, why)


class ProbeCache:
    """The cache directory: :meth:`get` and :meth:`put` probe results by key."""

    LOCK_NAME = ".lock"

    def __init__(self, directory: str | os.PathLike | None = None) -> None:
        self.directory = Path(directory).expanduser() if directory is not None else default_dir()

    def path_of(self, key: str) -> Path:
        return self.directory / f"{key}.json"

    def _lock(self) -> FileLock:
        self.directory.mkdir(parents=True, exist_ok=True)
        return FileLock(str(self.directory / self.LOCK_NAME), timeout=60)

    def _read(self, path: Path) -> dict[str, Any] | None:
        """The entry in ``path``, or None (with one warning per path) when it is not ours."""
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            _warn_once(path, f"not readable JSON ({type(exc).__name__}: {exc})")
            return None
        if not isinstance(data, dict) or data.get("kind") != KIND:
            _warn_once(path, "not an autobatch probe-cache entry")
            return None
        if data.get("schema") != SCHEMA:
            _warn_once(path, f"schema {data.get('schema')!r}, this autobatch reads {SCHEMA}")
            return None
        if data.get("key") != path.stem:
            _warn_once(path, "its key does not match its file name")
            return None
        try:
            ProbeResult.from_dict(data["result"])
        except Exception as exc:  # noqa: BLE001 - any malformed result is a miss
            _warn_once(path, f"malformed result ({type(exc).__name__}: {exc})")
            return None
        return data

    def get(self, key: str) -> ProbeResult | None:
        """The cached result for ``key`` (marked ``cached``), or None on a miss."""
        try:
            data = self._read(self.path_of(key))
        except OSError as exc:
            _warn_once(self.path_of(key), f"{type(exc).__name__}: {exc}")
            return None
        if data is None:
            return None
        result = ProbeResult.from_dict(data["result"])
        result.cached = True
        return result

    def put(self, key: str, components: dict[str, Any], result: ProbeResult) -> Path | None:
        """Store ``result`` under ``key`` atomically; a failure to write is logged, not raised."""
        entry = {
            "schema": SCHEMA,
            "kind": KIND,
            "key": key,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "components": components,
            "result": result.to_dict(),
        }
        text = json.dumps(entry, indent=1, default=str)
        path = self.path_of(key)
        try:
            with self._lock():
                handle, temporary = tempfile.mkstemp(dir=self.directory, prefix=".tmp-", suffix=".json")
                try:
                    with os.fdopen(handle, "w") as out:
                        out.write(text)
                        out.flush()
                        os.fsync(out.fileno())
                    os.replace(temporary, path)
                except BaseException:
                    os.unlink(temporary)
                    raise
        except Exception as exc:  # noqa: BLE001 - a cache that cannot be written is no reason to fail
            log.warning("could not write the probe cache entry %s: %s", path, exc)
            return None
        return path

    def entries(self) -> list[CacheEntry]:
        """Every valid entry, oldest first (invalid files are warned about once, and skipped)."""
        if not self.directory.is_dir():
            return []
        found = []
        for path in sorted(self.directory.glob("*.json")):
            if path.name.startswith(".tmp-"):
                continue
            data = self._read(path)
            if data is None:
                continue
            found.append(
                CacheEntry(
                    key=data["key"],
                    path=path,
                    created=str(data.get("created", "")),
                    batch_size=int(data["result"]["batch_size"]),
                    device=str(data["result"].get("device", "")),
                    components=data["components"],
                )
            )
        return sorted(found, key=lambda entry: entry.created)

    def clear(self) -> int:
        """Delete every entry, of this schema or an older one, and leftover temporary files;
        return how many entries went. Any other file, JSON or not, stays: ``--dir`` may name a
        directory that holds more than the cache."""
        if not self.directory.is_dir():
            return 0
        removed = 0
        with self._lock():
            for path in self.directory.glob("*.json"):
                temporary = path.name.startswith(".tmp-")
                if not temporary and not _is_entry(path):
                    continue
                try:
                    path.unlink()
                except FileNotFoundError:
                    continue
                removed += not temporary
        return removed


def _is_entry(path: Path) -> bool:
    """Whether ``path`` holds a probe-cache entry (any schema): the only files ``clear`` deletes."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return isinstance(data, dict) and data.get("kind") == KIND


def list_entries(directory: str | os.PathLike | None = None) -> list[CacheEntry]:
    """The valid entries of the cache in ``directory`` (default :func:`default_dir`)."""
    return ProbeCache(directory).entries()


def clear(directory: str | os.PathLike | None = None) -> int:
    """Delete the entries of the cache in ``directory`` (default :func:`default_dir`); return
    how many were deleted."""
    return ProbeCache(directory).clear()
