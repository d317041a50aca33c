"""An ``IndexError`` from a probe trial above batch 1 got a note blaming a dataset smaller than the
batch; two index errors are no batch size's at all, and their notes now say what they are."""

import pytest

from autobatch.probe.trial_notes import with_trial_note


@pytest.mark.parametrize(("message", "said", "not_said"), [
    ("Target 7 is out of bounds.", "target class id is not below the model's number of outputs", "max_batch"),
    ("index out of range in self", "embedding was given an id at or past its num_embeddings", "max_batch"),
    ("index 100 is out of bounds for dimension 0 with size 100", "max_batch=len(dataset)", "embedding"),
])
def test_an_index_error_in_a_trial_is_named_for_what_it_is(message, said, not_said):
    note = "\n".join(with_trial_note(IndexError(message), 128, passed=(8,)).__notes__)
    assert said in note and not_said not in note
