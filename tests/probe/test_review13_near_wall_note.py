"""Review 13: a hand loop's answer whose trial reserved nearly all the capacity under fixed
segments, without flushing, gets a note (Swin-S on an H100, 8 GiB cap: 66 passed without a
flush at 98.7 % reserved and ran out of memory at a new process's second step; under expandable
segments it answered 69 and trained everywhere)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from autobatch.probe import promise


def _note(monkeypatch, *, reserved, flushes=0, steps=3, expandable=False, autotuned=False, hand_loop=True, unused=0.0):
    capacity = 8 * 2**30
    figures = {"batch_size": 66, "steps": steps, "after_last_oom": True, "autotuned": autotuned, "flushes": flushes,
               "step_peak_bytes": int(0.956 * capacity), "peak_fraction": 0.956, "reserved_peak_bytes": int(reserved * capacity),
               "fragmentation_bytes": int(unused * capacity), "inactive_split_bytes": 0, "expandable_segments": expandable,
               "capacity_bytes": capacity, "allocator_headroom_bytes": capacity // 100}
    runner = SimpleNamespace(peak_limit=capacity - capacity // 100, settle_final=True, hand_loop=hand_loop)
    monkeypatch.setattr(promise, "promise_of", lambda *a: dict(figures))
    return figures, promise.promise_note(runner, SimpleNamespace(promise=None), memory=None)


@pytest.mark.parametrize(
    ("reserved", "changes", "noted"),
    [(0.987, {}, True), (0.975, {}, False), (0.987, {"expandable": True}, False), (0.987, {"autotuned": True}, False),
     (0.987, {"hand_loop": False}, False), (0.987, {"flushes": 2, "steps": 4}, False)],
)
def test_a_hand_loops_answer_at_the_fixed_wall_says_a_new_process_may_fail(monkeypatch, reserved, changes, noted):
    """Noted for a hand loop under fixed segments, untuned, reserving within 2 % of the capacity;
    not below that, with expandable segments or autotuning, for the Runner (it replays), nor where
    the flushing note (AT_FIXED_WALL) already says it."""
    _, note = _note(monkeypatch, reserved=reserved, **changes)
    assert (promise.NEAR_FIXED_WALL in note) is noted
    if noted:
        assert "its steps reserved 98.7 % of the capacity" in note and "expandable_segments:True" in note
    if changes.get("flushes"):
        assert promise.AT_FIXED_WALL in note


@pytest.mark.parametrize(
    ("unused", "changes", "noted"),
    [(0.24, {}, True), (0.073, {}, True), (0.24, {"expandable": True}, False), (0.24, {"hand_loop": True}, False)],
)
def test_the_runners_answer_at_a_fragmented_fixed_wall_says_a_new_process_may_replay(monkeypatch, unused, changes, noted):
    """Wav2Vec2's TrainStep (H200, 8 GiB): 64 passed reserving 99.9 % with 1.9 GiB (24 %) unused at
    its peak, and the Runner recovered once in each new process; a ViT-MAE's 109 (review 39) with
    7.3 % unused recovered in both processes too, so the Runner's answer is noted under fixed segments
    whatever its unused share, not under expandable segments, nor for a hand loop (NEAR_FIXED_WALL
    says it there)."""
    _, note = _note(monkeypatch, reserved=0.999, unused=unused, **{"hand_loop": False, **changes})
    assert (promise.FRAGMENTED_WALL in note) is noted
    if noted:
        assert f"its steps reserved 99.9 % of the capacity, {'1.92 GiB (24' if unused > 0.2 else '598'}" in note
    if changes.get("hand_loop"):
        assert promise.NEAR_FIXED_WALL in note
