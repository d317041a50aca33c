"""Review 23: a model class of one's own given by ``model._target_`` without ``model=target``.

``python -m autobatch train model._target_=mymods.Net +model.width=16`` got Hydra's "remove +
prefix, or ``++``", whose advice passed the default ``gpt`` option's keys to the class (then
``model.vocab_size is not an argument of mymods.Net``); the line now says to add ``model=target``.
(:func:`autobatch.cli.preflight.check` applies the hint to the composition error; the hint is
tested on Hydra's own words, as a compose costs more than this test's budget.)
"""

from __future__ import annotations

from autobatch.cli.override_hints import own_target_hint

HYDRA = ("Could not append to config. An item is already at 'model.width'. Either remove + prefix: 'model.width=16' "
         "Or add a second + to add or override 'model.width': '++model.width=16'")


def test_a_model_target_without_the_target_option_says_to_add_it():
    assert own_target_hint(HYDRA, ["model._target_=mymods.Net", "+model.width=16"]) == (
        "+model.width cannot be added: the model option's schema already has it; model._target_ of your own starts "
        "from model=target (only _target_ and inputs; +model.<argument>=VALUE for each argument): add model=target")


def test_with_a_model_option_chosen_the_message_is_left_as_it_is():
    assert own_target_hint(HYDRA, ["model=gpt", "model._target_=mymods.Net", "+model.width=16"]) == HYDRA
