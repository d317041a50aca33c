"""A torch.compile'd TrainStep is probed under a hand loop's rules (autobatch.probe.arguments)."""

from __future__ import annotations

import torch
from torch import nn

import autobatch
from autobatch.probe.arguments import COMPILED_NOTE, compiled_model, hand_loop_of, simulated_compile_note


def _step(model: nn.Module) -> autobatch.TrainStep:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return autobatch.TrainStep(model, optimizer, lambda m, b: nn.functional.mse_loss(m(b), b),
                               lambda n: torch.randn(n, 8))


def test_a_compiled_model_is_seen_wrapped_in_place_and_inside_another():
    assert not compiled_model(nn.Linear(8, 8))
    assert compiled_model(torch.compile(nn.Linear(8, 8)))
    in_place = nn.Linear(8, 8)
    in_place.compile()
    assert compiled_model(in_place)
    assert compiled_model(nn.Sequential(torch.compile(nn.Linear(8, 8)), nn.ReLU()))


def test_a_compiled_trainstep_defaults_to_a_hand_loop_and_says_why():
    assert hand_loop_of(_step(nn.Linear(8, 8)), None) == (False, [])
    assert hand_loop_of(_step(torch.compile(nn.Linear(8, 8))), None) == (True, [COMPILED_NOTE])
    assert hand_loop_of(_step(torch.compile(nn.Linear(8, 8))), False) == (False, [])  # the user's word stands
    assert hand_loop_of(lambda n: None, None) == (True, [])


def test_the_note_reaches_the_result_and_the_answer_trains():
    torch.manual_seed(0)
    model = torch.compile(nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 8)))
    result = autobatch.find_max_batch(_step(model), device="cpu", memory_limit="4MiB", cache=False)
    assert COMPILED_NOTE in result.notes
    with autobatch.simulated_memory("4MiB"):  # the answer trains in the budget it was found in
        for _ in range(3):
            _step(model)(result.batch_size)


def test_review32_a_plan_of_a_compiled_step_says_what_its_probes_measured():
    # plan()'s summary dropped both notes: on the CPU it sized the eager step, under a hand loop's rules, silently
    model = torch.compile(nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 8)), backend="eager")
    made = autobatch.plan(_step(model), global_batch=32, memory_limit="4MiB", cache=False)
    assert COMPILED_NOTE in made.notes and simulated_compile_note(model)[0] in made.notes
    assert "torch.compile" in str(made)
    uncompiled = autobatch.plan(_step(nn.Linear(8, 8)), global_batch=32, memory_limit="4MiB", cache=False)
    assert not any("torch.compile" in note for note in uncompiled.notes)


def test_review37_a_compiled_model_compiles_again_after_the_simulated_device():
    """Dynamo marked the frames it met under a dispatch mode skipped for good: after a CPU probe (or an estimate,
    tests/probe/test_review14_estimate_errors.py) the model trained uncompiled with no word, and a fullgraph=True
    model raised torch's bare "found no compiled frames", there and ever after (autobatch.memory.uncompiled)."""
    compiles = []

    def backend(graph, inputs):
        compiles.append(graph)
        return graph.forward

    model = torch.compile(nn.Linear(8, 8), backend=backend, fullgraph=True)
    with autobatch.simulated_memory("1MiB"):
        model(torch.randn(2, 8))  # eager here
    assert not compiles
    model(torch.randn(2, 8))
    assert len(compiles) == 1  # compiled after it


def test_review39_the_plans_split_check_runs_a_compiled_model_uncompiled():
    """plan()'s loss check (autobatch.planning.split_checks) ran the model outside the simulated device, at sizes
    8, 1, 3 and 5 in eval mode without grad: four graphs the run never uses (seconds each with inductor), half of
    dynamo's recompile limit with dynamic=False, so that a few OOM replays later a fullgraph=True run raised."""
    from autobatch.planning.split_checks import loss_split_note

    compiles = []

    def backend(graph, inputs):
        compiles.append(graph)
        return graph.forward

    model = torch.compile(nn.Linear(8, 8), backend=backend, dynamic=False, fullgraph=True)
    step = _step(model)
    assert loss_split_note(step, [16, 16]) is None  # a mean over samples: checked, and no note
    assert not compiles and model.training
    model(torch.randn(2, 8))
    assert len(compiles) == 1  # compiled after it


def test_review39_recompile_note_says_reached_near_or_nothing():
    """On an accelerator a dynamic=False model's trials compile a graph per size; past dynamo's recompile limit
    the later trials and training's new sizes ran uncompiled (fullgraph=True: raised), and nothing said so."""
    from autobatch.probe.recompiles import CompileCount, recompile_note

    assert recompile_note(CompileCount(1, 0), CompileCount(4, 0), 8) is None  # room to spare
    assert recompile_note(CompileCount(6, 0), CompileCount(6, 0), 8) is None  # the trials compiled nothing
    near = recompile_note(CompileCount(1, 0), CompileCount(6, 0), 8)
    assert "compiled 5 more batch sizes" in near and "came near it: 2 more sizes" in near
    assert "dynamic=None" in near and "mark_dynamic" in near and "recompile_limit" in near
    reached = recompile_note(CompileCount(None, 0), CompileCount(None, 1), 8)  # entries unreadable: dynamo's counter
    assert "reached it" in reached and "uncompiled" in reached and "dynamic=None" in reached
    assert recompile_note(None, CompileCount(8, 1), 8) is None  # the compiler never imported


def test_review39_a_compiled_models_trials_at_the_recompile_limit_are_counted():
    from autobatch.probe.recompiles import RecompileWatch

    class Tiny(nn.Linear):  # its own forward's code: nn.Linear's compiled frame is shared with the other tests' models
        def forward(self, x):
            return super().forward(x)

    model = torch.compile(Tiny(4, 2), backend="eager", dynamic=False)
    with torch._dynamo.config.patch(recompile_limit=2):
        watch, simulated = RecompileWatch(model, simulated=False), RecompileWatch(model, simulated=True)
        model(torch.randn(5, 4))
        assert "came near it: 1 more size" in watch.note()
        model(torch.randn(6, 4))
        assert "compiled 2 more batch sizes" in watch.note() and "reached it" in watch.note()
        assert simulated.note() is None  # the simulated device's trials run uncompiled: nothing counted
