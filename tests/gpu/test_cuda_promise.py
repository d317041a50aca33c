"""Real-GPU checks of issue 16: the probed answer trains in the process that probed, after
OOM trials, for more steps than the probe ran; autotuning comes back as the user set it; the
runner's recovery from a real squeeze is sized by measurement. Skipped without CUDA."""

import io
from contextlib import contextmanager

import pytest
import torch
from torch.nn import functional as F

import autobatch
from autobatch import free_memory

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

GiB = 2**30


def cnn_step():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 64, 3, padding=1), torch.nn.BatchNorm2d(64), torch.nn.ReLU(),
        torch.nn.Conv2d(64, 64, 3, padding=1), torch.nn.BatchNorm2d(64), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(64, 10),
    ).cuda()
    optimizer = torch.optim.AdamW(model.parameters())

    def loss_fn(m, b):
        return F.cross_entropy(m(b[0]), b[1])

    def make(n):
        return torch.randn(n, 3, 64, 64, device="cuda"), torch.randint(0, 10, (n,), device="cuda")

    return model, optimizer, loss_fn, make


def hand_step(model, optimizer, loss_fn, make):
    """A plain callable, as a hand loop's step: forward, backward, step, zero_grad."""

    def step(batch_size):
        loss_fn(model, make(batch_size)).backward()
        optimizer.step()
        optimizer.zero_grad()

    return step


@contextmanager
def capped(limit: int = 2 * GiB):
    """The process capped at ``limit`` bytes of device memory (as the probe was), lifted after."""
    torch.cuda.set_per_process_memory_fraction(limit / torch.cuda.get_device_properties(0).total_memory)
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)


@pytest.fixture(autouse=True)
def _clean():
    free_memory()
    yield
    free_memory()


@pytest.mark.parametrize("benchmark", [False, True])
def test_answer_trains_50_steps_in_the_probing_process(benchmark):
    before = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = benchmark
    try:
        model, optimizer, loss_fn, make = cnn_step()
        result = autobatch.find_max_batch(autobatch.TrainStep(model, optimizer, loss_fn, make), memory_limit=2 * GiB,
                                          cache=False)
        assert torch.backends.cudnn.benchmark is benchmark  # the user's setting, exactly
        assert torch.backends.cudnn.deterministic is False  # flipped for untuned trials only
        assert result.promise and result.promise["after_last_oom"]
        if benchmark:
            assert result.promise["autotuned"] is True
            assert all(not r.autotuned for r in result.trials if r.purpose == "search")
            # only the answer's confirmation pays for autotuning (seconds per shape near the capacity)
            assert {r.purpose for r in result.trials if r.autotuned} == {"confirm"}
        with capped():
            for _ in range(50):
                optimizer.zero_grad(set_to_none=True)
                loss_fn(model, make(result.batch_size)).backward()
                optimizer.step()
    finally:
        torch.backends.cudnn.benchmark = before


def test_runner_recovery_from_a_real_squeeze_is_measured():
    model, optimizer, loss_fn, make = cnn_step()
    answer = autobatch.find_max_batch(autobatch.TrainStep(model, optimizer, loss_fn, make), memory_limit=2 * GiB,
                                      cache=False).batch_size
    squeeze = []
    try:
        with capped():
            def on_step_end(info):
                if info["step"] == 3:
                    squeeze.append(torch.empty(GiB // 10, dtype=torch.uint8, device="cuda"))  # 5 % of 2 GiB

            data = [tuple(t.cpu() for t in make(answer)) for _ in range(10)]
            runner = autobatch.Runner(model, optimizer, loss_fn, global_batch=answer, micro_batch=answer, progress=False)
            result = runner.fit(data, on_step_end=on_step_end)
    finally:
        squeeze.clear()
    assert result.samples == 10 * answer
    for recovery in result.oom_recoveries:
        if recovery["action"] == "measured":
            assert recovery["micro_batch"] >= 0.8 * recovery["micro_batch_before"]


def test_the_runners_step_allocates_what_a_hand_loop_does():
    """An fp32 batch from the host under bf16 autocast: the runner lets go of the inputs before
    backward, as ``loss_fn(model, x.cuda())`` in a hand loop does (it held them: +0.055 GiB at a
    ResNet-50 micro-batch of 180 on an H200)."""
    model, optimizer, loss_fn, _ = cnn_step()
    host = (torch.randn(256, 3, 64, 64), torch.randint(0, 10, (256,)))

    def hand_peak() -> int:
        for _ in range(3):  # the last step in steady state (Adam's moments exist)
            torch.cuda.reset_peak_memory_stats()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = loss_fn(model, tuple(t.cuda() for t in host))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            del loss
        return torch.cuda.max_memory_allocated()

    hand = hand_peak()
    peaks: list[int] = []

    def on_step_end(_info) -> None:
        peaks.append(torch.cuda.max_memory_allocated())
        torch.cuda.reset_peak_memory_stats()

    torch.cuda.reset_peak_memory_stats()
    autobatch.Runner(model, optimizer, loss_fn, global_batch=256, micro_batch=256, autocast_dtype=torch.bfloat16,
                     progress=False, step_guard="off").fit([host] * 3, steps=3, on_step_end=on_step_end)
    assert peaks[-1] <= hand + 2 * 2**20, (peaks, hand)


@pytest.mark.parametrize("hand_loop", [True, False])
def test_a_plain_callables_state_is_laid_out_after_the_probe(hand_loop):
    """After a hand loop's probe the optimizer state its trials created is laid out as loading a
    checkpoint places it (in new memory before the first step, and left there by it); with
    hand_loop=False it waits in a private pool and comes back at the next optimizer step. Values
    intact either way (autobatch.memory.parking). The loop trains the answer of a hand loop; with
    hand_loop=False (a loop that replays: its answer may sit at the allocator's wall) half of it."""
    model, optimizer, loss_fn, make = cnn_step()
    step = hand_step(model, optimizer, loss_fn, make)
    result = autobatch.find_max_batch(step, memory_limit=2 * GiB, device="cuda", hand_loop=hand_loop, cache=False)
    state = [t for s in optimizer.state.values() for t in s.values() if t.is_cuda]
    assert result.promise["laid_out_state_bytes"] == sum(t.numel() * t.element_size() for t in state)
    assert any(("laid out as loading" if hand_loop else "private memory pool") in note for note in result.notes)
    where = {t.data_ptr() for t in state}
    values = [t.clone() for t in state]
    seen = []  # hooks run in the order registered: this one after the park's
    optimizer.register_step_pre_hook(lambda opt, *_: seen.append(
        [torch.equal(t, v) for t, v in zip(state, values)] + [(t.data_ptr() in where) is hand_loop for t in state]))
    with capped():
        for _ in range(20):
            step(result.batch_size if hand_loop else result.batch_size // 2)
    assert seen[0] and all(seen[0])  # laid out already, or back in the default pool before the first step ran


def test_a_plain_callables_answer_trains_in_a_resumed_hand_loop():
    """A hand loop resumed from a checkpoint has its optimizer state before its first step; the
    probe's answer for a plain callable must train there too (its trial's last step no longer
    flushing the allocator's cache: docs/promise-log.md, "Resumed runs")."""
    model, optimizer, loss_fn, make = cnn_step()
    step = hand_step(model, optimizer, loss_fn, make)
    result = autobatch.find_max_batch(step, memory_limit=2 * GiB, device="cuda")
    assert result.promise is not None and not autobatch.probe.promise.still_flushing(result.promise)
    saved = io.BytesIO()  # a checkpoint file, read back to the host
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, saved)
    saved.seek(0)
    checkpoint = torch.load(saved, map_location="cpu", weights_only=True)
    del model, optimizer, step
    free_memory()
    model, optimizer, loss_fn, make = cnn_step()  # a resumed run: weights and state before step 0
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    with capped():
        step = hand_step(model, optimizer, loss_fn, make)
        for _ in range(50):
            step(result.batch_size)


def test_a_hand_loops_probe_leaves_the_cublas_workspaces_to_its_first_step():
    """A new process makes the cuBLAS workspaces in its first step, among its activations; a hand
    loop's trials, and training in the probing process after them, start without them too (a
    TrainStep's probe keeps them)."""
    from autobatch.memory.workspaces import release_workspaces

    x = torch.ones(64, 64, device="cuda")

    def workspace_made() -> bool:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        (x @ x).sum().item()
        return torch.cuda.memory_allocated() > before

    workspace_made()
    assert not workspace_made()  # kept for the life of the process
    assert release_workspaces(torch.device("cuda")) and workspace_made()
    model, optimizer, loss_fn, make = cnn_step()
    starts = []  # whether each call of the step began without a workspace

    def step(n: int) -> None:
        starts.append(workspace_made())
        release_workspaces(torch.device("cuda")) if starts[-1] else None  # the step makes them itself
        hand_step(model, optimizer, loss_fn, make)(n)

    result = autobatch.find_max_batch(step, memory_limit=2 * GiB, device="cuda", max_batch=64, cache=False)
    firsts, call = [], 0
    for trial in result.trials:
        firsts.append(starts[call])
        call += trial.steps
    assert all(firsts), firsts  # every trial's first step made them again
    assert workspace_made()  # released after the probe too


def test_state_laid_out_as_a_checkpoint_load_keeps_its_values_and_tensors():
    """Before a hand loop's settle trial the state the trials made is laid out again as loading
    a checkpoint places it (autobatch.memory.parking.relayout_as_loaded): new device memory,
    the same tensor objects and values, nothing left behind in a private pool."""
    from autobatch.memory.parking import relayout_as_loaded

    model, optimizer, loss_fn, make = cnn_step()
    hand_step(model, optimizer, loss_fn, make)(32)
    state = [t for s in optimizer.state.values() for t in s.values() if t.is_cuda]
    values = [t.clone() for t in state]
    where = [t.data_ptr() for t in state]
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    moved = relayout_as_loaded(optimizer, state, torch.device("cuda"))
    assert moved == sum(t.numel() * t.element_size() for t in state)
    now = [t for s in optimizer.state.values() for t in s.values() if t.is_cuda]
    assert len(now) == len(state) and all(a is b for a, b in zip(now, state))  # the same objects
    assert all(torch.equal(t, v) for t, v in zip(state, values))
    assert [t.data_ptr() for t in state] != where
    assert torch.cuda.memory_allocated() == held  # no copy left in a private pool
