"""Review 16: ``fit_batch_size`` with a data collator that tokenizes raw text itself.

``longest_sample`` counted a string as 0 elements, so a dataset of ``{"text": ...}`` rows (or of
chat ``messages``) was probed at its *first* sample's text, with no warning: a short first text
answered 64, and ``train()`` then ran out of memory on a longer one under the same budget. Text
now counts its characters (a chat as its messages x the longest), so the longest text is probed
(on the CPU's simulated 12 MiB with a tiny GPT-2 and a character collator: 17, which trains)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from autobatch.integrations.transformers import longest_sample  # noqa: E402

TEXTS = ["short text", "x" * 60, "mid length text", "yy" * 20]


def test_the_longest_text_is_the_sample():
    assert longest_sample([{"text": t, "id": i} for i, t in enumerate(TEXTS)])["text"] == "x" * 60
    assert longest_sample(["short", "a much longer text"]) == "a much longer text"
    chats = [[{"role": "user", "content": "hi"}] * 3, [{"role": "user", "content": "a long question " * 4}]]
    assert longest_sample([{"messages": chat} for chat in chats])["messages"] is chats[1]

