"""An override the shell split before the command saw it (review 26): one line naming the fix."""

from __future__ import annotations


def test_dict_split_at_spaces_names_the_working_form(cli_here):
    # bash passes model={_target_: torch.nn.Linear, in_features: 8} as four words; Hydra read the
    # first alone and the hint quoted it as a string ('model="{_target_:"'), a wrong value
    result = cli_here("probe", "model={_target_:", "torch.nn.Linear,", "in_features:", "8}", "data.shape=[8]")
    assert result.returncode == 2
    line = result.stderr.strip()
    assert line.count("autobatch: error:") == 1
    assert "the shell split the override 'model={_target_: torch.nn.Linear, in_features: 8}' into 4 words" in line
    assert line.endswith("model=target model._target_=torch.nn.Linear +model.in_features=8")


def test_list_split_at_spaces_and_brace_expansion_say_quote_it(cli_here):
    result = cli_here("probe", "data.shape=[3,", "32,", "32]", "--cfg", "job")
    assert result.returncode == 2
    assert result.stderr.strip().endswith("quote it whole: 'data.shape=[3, 32, 32]'")
    # without spaces bash's brace expansion makes one override per item
    result = cli_here("probe", "data.dataset=_target_:mymod.Data", "data.dataset=root:/data")
    assert result.returncode == 2
    assert "by brace expansion" in result.stderr
    assert result.stderr.strip().endswith("quote it whole: 'data.dataset={_target_: mymod.Data, root: /data}'")
