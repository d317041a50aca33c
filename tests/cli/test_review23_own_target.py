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


def _not_in_struct(key: str, value: str, parent: dict):
    """Hydra's words and OmegaConf's error for ``key=value`` on a node without that key."""
    from omegaconf import OmegaConf
    from omegaconf.errors import ConfigAttributeError

    error = ConfigAttributeError(f"Key {key.rsplit('.', 1)[1]!r} is not in struct")
    error.parent_node, error.full_key = OmegaConf.create(parent), key
    message = (f"Could not override '{key}'. To append to your config use +{key}={value}: "
               f"Key {key.rsplit('.', 1)[1]!r} is not in struct")
    return message, error


def test_review35_a_dataset_of_ones_own_key_by_key_names_the_plus_form():
    """``data.dataset._target_=mymods.DS`` (the form model._target_= takes) on the default null
    data.dataset was Hydra's "To append ... use +...: Key '_target_' is not in struct"."""
    from autobatch.cli.override_hints import override_hint

    assert override_hint(*_not_in_struct("data.dataset._target_", "mymods.DS", {})) == (
        "Could not override 'data.dataset._target_': data.dataset is null (nothing is set there yet); add it with "
        "+data.dataset._target_=mymods.DS (and +data.dataset.<argument>=VALUE for each argument of it)")
    assert override_hint(*_not_in_struct("data.dataset.n", "3", {})).endswith(
        "data.dataset is null (nothing is set there yet); add its class first: +data.dataset._target_=CLASS +data.dataset.n=3")


def test_review35_a_misspelt_argument_under_model_target_names_the_one_meant():
    """``model=target model._target_=mymods.Net +model.hiden=64`` was told "Remove it with
    ~model.hiden or start from model=target": the option it already was, and not the key meant."""
    import pytest
    import torch
    from omegaconf import OmegaConf

    from autobatch.cli.validation import check_target_arguments

    class Net(torch.nn.Module):
        def __init__(self, hidden: int, classes: int = 10) -> None:
            super().__init__()

    for extra, fix in (({"hiden": 64}, "Give +model.hidden=64 in its place (~model.hiden removes it where a config of "
                                       "yours sets it)"), ({"hidden": 3, "bogus": 1}, "Remove it with ~model.bogus")):
        node = OmegaConf.create({"_target_": "mymods.Net", "inputs": "tensor", **extra})
        with pytest.raises(ValueError) as raised:
            check_target_arguments("model", node, Net, own=("inputs",))
        assert str(raised.value).endswith(f"its arguments: hidden, classes. {fix}"), raised.value
