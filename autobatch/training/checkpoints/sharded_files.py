"""Where a sharded (FSDP2) checkpoint lives: one file per rank, and a resume that must match it.

A model whose parameters are ``DTensor`` s is checkpointed without gathering anything: each
rank writes its own local shards to ``last.rank<r>-of-<world>.pt`` next to where ``last.pt``
would be (:func:`sharded_path`). Such a set is only loadable by the same number of ranks,
each taking its own file, so a resume first checks the set against the job
(:func:`check_sharded_resume`) and says in one line what to change: the launcher's
``--nproc-per-node``, or ``train.fsdp``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from ...errors import CheckpointError
from ...memory.units import counted

__all__ = ["sharded_path", "sharded_sets", "check_sharded_resume", "base_path"]

_SHARD = re.compile(r"^(?P<stem>.+)\.rank(?P<rank>\d+)-of-(?P<world>\d+)$")


def _rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def base_path(path: str | os.PathLike) -> Path:
    """The ``last.pt`` a path names: ``path / last.pt`` for a directory, ``last.pt`` for one of
    its shard files (``last.rank0-of-2.pt``), else ``path``."""
    path = Path(path)
    if path.is_dir():
        return path / "last.pt"
    match = _SHARD.match(path.stem)
    return path.with_name(match["stem"] + path.suffix) if match else path


def sharded_path(path: str | os.PathLike, rank: int | None = None, world: int | None = None) -> Path:
    """This rank's file of the sharded checkpoint ``path`` names (a ``last.pt`` or its directory):
    ``last.pt`` becomes ``last.rank<r>-of-<world>.pt`` (rank and world from the process group)."""
    path = base_path(path)
    if rank is None or world is None:
        rank, world = _rank_world()
    return path.with_name(f"{path.stem}.rank{rank}-of-{world}{path.suffix}")


def sharded_sets(path: str | os.PathLike) -> dict[int, list[int]]:
    """The sharded checkpoints written next to ``path`` (a ``last.pt``, which need not exist):
    world size -> the ranks whose files are there."""
    path = base_path(path)
    found: dict[int, list[int]] = {}
    if not path.parent.is_dir():
        return found
    for candidate in path.parent.glob(f"{path.stem}.rank*-of-*{path.suffix}"):
        match = _SHARD.match(candidate.name[: len(candidate.name) - len(path.suffix)])
        if match and match["stem"] == path.stem:
            found.setdefault(int(match["world"]), []).append(int(match["rank"]))
    return {world: sorted(ranks) for world, ranks in found.items()}


def check_sharded_resume(path: str | os.PathLike, *, sharded: bool) -> Path:
    """The file this rank resumes from, for ``path`` (``last.pt`` or its directory), or one
    :class:`~autobatch.errors.CheckpointError` saying what to change: a sharded model needs a
    complete set written by as many ranks as this job has; an unsharded one needs ``last.pt``."""
    path = base_path(path)
    sets = sharded_sets(path)
    rank, world = _rank_world()
    if not sharded:
        if not path.is_file() and sets:
            written = max(sets)
            raise CheckpointError(
                path, f"it is an FSDP2 checkpoint sharded over {counted(written, 'rank')} ({path.stem}.rank<r>-of-{written}{path.suffix}); "
                f"resume with the model sharded again (fully_shard it before Runner(...); from the command line, "
                f"train.fsdp=true) under torchrun --nproc-per-node {written}",
            )
        return path
    mine = sharded_path(path, rank, world)
    if mine.is_file() and sorted(sets.get(world, [])) == list(range(world)):
        return mine
    if sets.get(world):
        missing = sorted(set(range(world)) - set(sets[world]))
        raise CheckpointError(
            path, f"the sharded checkpoint for {world} ranks is incomplete (no file for ranks {missing}); "
            "resume from a complete set of last.rank<r>-of-<world>.pt files",
        )
    if sets:
        written = sorted(sets)
        raise CheckpointError(
            path, f"it was sharded over {counted(written[-1], 'rank')} and this job has {world}: FSDP2 checkpoints hold each rank's "
            f"own shards, so resume with torchrun --nproc-per-node {written[-1]}",
        )
    if path.is_file():
        raise CheckpointError(
            path, "it holds an unsharded model (DDP or plain) and this model is sharded (FSDP2); resume into the model "
            "unsharded, as the run that wrote it (no fully_shard before Runner(...); from the command line, without "
            "train.fsdp), or start afresh",
        )
    raise FileNotFoundError(
        f"no checkpoint at {path} (nor its sharded files {path.stem}.rank<r>-of-{world}{path.suffix or '.pt'} next to "
        "it): give the last.pt a runner wrote, or its checkpoint_dir, where every rank's file is (fit(resume=None) "
        "starts afresh)")
