"""Why a step cannot be estimated with fake tensors, and whose error a failed trace raised.

A trace fails for one of two reasons. Fake tensors cannot do what the step asks (read a value
with ``.item()``, an output shaped by the data, an operator with no fake kernel, ``.numpy()``):
that is the estimate's limit, an :class:`~autobatch.probe.tracing.estimate.EstimateError` saying what
the step did and where (:func:`untraceable`), and ``auto`` probes with trials instead. Or the
step's own code raised, as it would in a real step (a ``KeyError`` in a collate, a shape
mismatch in the loss, the user's own ``ValueError``): that error is re-raised as itself, its type
and traceback kept so that the caller's ``except`` still catches it, with a note that it came
from the trace (:func:`step_error`; :func:`~autobatch.errors.add_note` also on Python 3.10); before, it came out as
an ``EstimateError``, which no ``except ValueError`` of the user's caught. :func:`check_operands`
raises what a real matrix product refuses and its fake kernel takes (two dtypes), so such a step
fails as it would for real instead of being given an answer. :func:`untraceable_memory` names the
steps fake tensors would count short, refused before any trace; :func:`check_sparse` refuses an operator
whose result is sparse (a fake one has no nonzeros) when the trace reaches it.
"""

from __future__ import annotations

import math
import re

from typing import Any, Callable, Iterator

import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, FakeTensor
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_leaves, tree_map

from ...errors import add_note, in_packages, raised_through
from ...memory.accounting import _COMPONENTS, StorageAccountant
from ..trial_notes import index_hint

__all__ = ["grouped_mm", "GROUPED_MM", "untraceable", "untraceable_memory", "sparse_embeddings", "sparse_gradients", "step_error", "refused_size", "from_the_step",
           "check_operands", "check_sparse", "SparseTraceError", "RealBatches"]

#: What a fake tensor cannot do, by the exception PyTorch raises, in the words of the user's code.
_CANNOT = {
    "DataDependentOutputException": "the step reads a tensor's value in Python, by .item(), float(), int(), "
                                    "bool() or `if tensor:`, and a fake tensor has none",
    "DynamicOutputShapeException": "an output's shape depends on the data, as after nonzero, boolean-mask "
                                   "indexing or unique, and a fake tensor cannot know it",
}
#: How PyTorch words, in a plain ``RuntimeError``/``NotImplementedError``, what a fake tensor has not:
#: data (``.numpy()``: "not supported for tensor subclasses"), a storage, a kernel ("no fake impl
#: registered" for a custom op, "could not run ... with arguments from the 'Meta' backend").
_FAKE_LIMIT = re.compile(
    r"[Ff]ake|[Ff]akif|'Meta'|Meta tensor|meta (?:tensor|kernel|function|impl)|tensor subclass|data pointer"
    r"|(?:have|without|access) storage|Sym(?:Int|Float|Bool|Node)"
)
#: A fake tensor's repr (``FakeTensor(..., size=(2, 16))``) in a message: the step's own error formatting a
#: tensor it was given (``loss_fn`` returning a tuple, a shape check of the user's), not a limit of fake tensors.
_FAKE_REPR = re.compile(r"FakeTensor\(\.\.\.")
#: PyTorch's words where a fake tensor's value is read other than by ``.item()``: ``.numpy()`` (``np.asarray``
#: too) and a format spec (``f"{loss:.3f}"``, to log it), a plain ``RuntimeError``/``TypeError`` that named
#: only a tensor subclass; given the meaning of a value read (and the line, as every refusal).
_VALUE_READ = re.compile(r"\.numpy\(\) is not supported for tensor subclasses|format string passed to FakeTensor")
_VALUE_READ_MEANS = ("the step reads a tensor's value in Python, by .numpy(), np.asarray() or a format string such "
                     "as f'{loss:.3f}' (to log it), and a fake tensor has none; log outside the loss_fn and forward "
                     "that the probe runs")
#: Where the note of a step's own error begins (how :func:`from_the_step` knows it).
NOTE = "autobatch: raised by the training step while autobatch traced it with fake tensors"


#: PyTorch's compiler, which does not compile under the trace's dispatch modes ("non-infra torch
#: dispatch mode present"): a ``torch.compile(fullgraph=True)`` model raises, where it may not run eagerly.
_COMPILER = ("torch._dynamo", "torch._inductor")
_COMPILED = ("torch.compile does not compile under the fake-tensor trace, and fullgraph=True forbids running the "
             "code uncompiled: estimate the uncompiled module (the compiled one's _orig_mod)")


#: What to pass instead, by the torch module and function whose code read a value the user's line handed it.
_ADVICE = {
    ("torch.nn.modules.transformer", ("_detect_is_causal_mask",)):
        "it compares a mask with a causal one; with a causal mask, pass tgt_is_causal=True (is_causal=True to an "
        "encoder) and it compares nothing",
    ("torch.distributions", ("__init__", "_validate_sample")):
        "a distribution built with validate_args=True checks its parameters' values; leave validate_args at its "
        "default, which the trace skips and training still checks",
}


def untraceable(exc: BaseException) -> str:
    """Why a step could not be traced: the exception, what it means where PyTorch's name does not
    say it (``aten._local_scalar_dense`` is ``.item()``), and the line of the user's code that
    raised it (the innermost frame outside torch and autobatch; else torch's own code outside its
    dispatch machinery, such as an optimizer's ``step`` reading a norm), so the message says what to change.
    Where the user's line called torch code that did it (``nn.Transformer`` comparing a ``tgt_mask``
    with a causal one, ``F.gaussian_nll_loss`` checking its variance), that function is named too:
    the user's line alone did not say what read a value, nor what to pass instead."""
    meaning = _COMPILED if _in_compiler(exc) else _CANNOT.get(type(exc).__name__)
    if meaning is None and _VALUE_READ.search(str(exc)):
        meaning = _VALUE_READ_MEANS
    if meaning is None and any(in_packages(frame[0], _JAGGED) for frame in raised_through(exc)):
        meaning = _JAGGED_MEANS
    library = [frame for frame in raised_through(exc, leaving=("autobatch",))
               if frame[0] != "torch" and not frame[0].startswith(("torch._", "torch.utils._"))]
    frames = raised_through(exc, leaving=("torch", "autobatch")) or library
    where = "at {}:{} in {}".format(*frames[-1][1:]) if frames else ""
    if frames and library and library[-1] != frames[-1]:  # the user's line called torch code that read the value
        where += ", inside {0}.{3} ({1}:{2})".format(*library[-1])
        where += next((f": {advice}" for (prefix, functions), advice in _ADVICE.items()
                       if library[-1][0].startswith(prefix) and library[-1][3] in functions), "")
    told = "; ".join(part for part in (meaning, where) if part)
    said = str(exc).split("\n")[0] if _in_compiler(exc) else str(exc)  # the compiler's lists every frame it skipped
    return f"{type(exc).__name__}: {said}" + (f" ({told})" if told else "")


def cut_below_user_code(exc: BaseException) -> BaseException:
    """``exc`` with its traceback cut after the frame :func:`untraceable` names (the user's line, or
    the torch function it called that read a value), returned as the ``EstimateError``'s cause: the
    frames below it, PyTorch's dispatch and fake-tensor machinery and autobatch's accountants (some
    90 lines under ``if tensor:``), said nothing a user can change and buried the message."""
    tb, last = exc.__traceback__, None
    while tb is not None:
        module = str(tb.tb_frame.f_globals.get("__name__", ""))
        if not in_packages(module, ("autobatch",)) and module != "torch" and not module.startswith(("torch._", "torch.utils._")):
            last = tb
        tb = tb.tb_next
    if last is not None:
        last.tb_next = None
    return exc


def _in_compiler(exc: BaseException) -> bool:
    """Whether ``exc`` was raised by PyTorch's compiler (:data:`_COMPILER`)."""
    frames = raised_through(exc)
    return bool(frames) and in_packages(frames[-1][0], _COMPILER)


#: PyTorch's fake-tensor errors for what a real step refuses too (tensors on two devices: a real
#: step's ``RuntimeError``, of which it is a subclass): the step's own.
_AS_REAL = ("FakeTensorDeviceMismatchError",)
#: autobatch's tracing machinery (the fake world, what it puts back, the accountant): an error
#: raised there is the estimate's, not the step's.
_MACHINERY = ("autobatch.memory", "autobatch.probe.tracing.fake_trace", "autobatch.probe.tracing.trace_state", "autobatch.probe.tracing.estimate",
              "torch._subclasses")
#: PyTorch's fake-tensor machinery itself (``torch._subclasses``), which raises a bare ``AssertionError``
#: where it cannot represent a tensor: a jagged nested tensor's ragged size needs a symbolic-shape
#: environment the trace does not run (torch 2.13). That was reported as the step's own error.
#: Except where it is a kernel's own input check: the fake kernels there (``fake_impls``: a convolution's) check
#: their inputs as the real kernels do and raise the same plain ``RuntimeError`` or ``IndexError`` (a ``Conv2d``
#: given 4 channels where it takes 3), which was reported as a limit of fake tensors before review 39.
_KERNEL_CHECKS = (RuntimeError, IndexError)
_JAGGED = ("torch.nested",)
_JAGGED_MEANS = ("a jagged nested tensor (torch.nested, layout=torch.jagged), whose ragged size the trace's fake "
                 "tensors cannot represent; a padded batch (torch.nn.utils.rnn.pad_sequence) can be estimated")


def _fake_limit(exc: BaseException) -> bool:
    """Whether ``exc`` is what fake tensors cannot do rather than the step's own error: an
    exception class of PyTorch's (its fake-tensor, compiler and symbolic-shape errors; the errors
    a real step raises in torch are Python's own ``RuntimeError``, ``ValueError``, ...), one its
    compiler or autobatch's tracing machinery raised, or one whose message speaks of fake tensors,
    the meta backend, storage or symbolic sizes."""
    if type(exc).__name__ in _AS_REAL:
        return False
    frames = raised_through(exc)
    machinery = bool(frames) and in_packages(frames[-1][0], _MACHINERY)
    if machinery and type(exc) in _KERNEL_CHECKS and in_packages(frames[-1][0], ("torch._subclasses",)):
        machinery = False  # a fake kernel's input check, as the real kernel's: unless its message speaks of fakes
    if in_packages(type(exc).__module__, ("torch",)) or machinery:
        return True
    return _in_compiler(exc) or bool(_FAKE_LIMIT.search(_FAKE_REPR.sub("", str(exc))))


def step_error(failure: BaseException, batch_size: int, left: str | None, trials: str) -> BaseException | None:
    """``failure`` itself, with a note, where it is the step's own error (:func:`_fake_limit` says
    it is not a limit of fake tensors, and it is no error of autobatch's): the same error a real
    step raises, to be raised as it is. None where the estimate's own ``EstimateError`` is due.
    ``left`` says where the trace left a fake tensor, ``trials`` what to do if the step runs."""
    if not isinstance(failure, Exception) or _fake_limit(failure) or in_packages(type(failure).__module__, ("autobatch",)):
        return None
    kept = f" ({left})" if left else ""
    return add_note(failure, f"{NOTE} at batch {batch_size} to estimate its memory (strategy='estimate', "
                             f"estimate_max_batch); no step ran for real{kept}. If the step runs without this error, "
                             f"{trials}")


def refused_size(exc: BaseException, batch_size: int, passed: list[int]) -> None:
    """Add to the step's own error at ``batch_size`` (:func:`from_the_step`) a note where traces of
    the sizes ``passed`` ran before it: the step may refuse some sizes (a batch split in pairs),
    and ``multiple_of`` keeps the search to those it takes, as a probe trial's note says
    (:func:`~autobatch.probe.trial_notes.with_trial_note`); an ``IndexError`` (a dataset of fewer
    samples) gets ``max_batch`` instead."""
    if not passed or not from_the_step(exc):
        return
    divisor, ordered = math.gcd(*passed), sorted(passed)
    sizes = ", ".join(map(str, ordered)) if len(ordered) <= 4 else f"{', '.join(map(str, ordered[:3]))}, ..., {ordered[-1]}"
    if isinstance(exc, IndexError):  # a dataset of fewer samples, not a size the step refuses
        add_note(exc, f"autobatch: traces at {sizes} ran before batch {batch_size}: {index_hint(batch_size, str(exc))}")
        return
    why = (f": every size traced is a multiple of {divisor} and {batch_size} is not, so the multiple it needs divides "
           f"{divisor}") if divisor > 1 and batch_size % divisor else ""
    add_note(exc, f"autobatch: traces at {sizes} ran before batch {batch_size}: the step may refuse some batch sizes (a "
                  "batch split in pairs or groups). Pass multiple_of (to find_max_batch or plan(), or in a Runner's "
                  f"plan_options) so that only sizes it takes are tried{why}.")


#: Matrix products whose real kernels refuse matrices of two dtypes and whose fake ones do not
#: (torch 2.13): the operand positions compared.
_SAME_DTYPE = {
    torch.ops.aten.mm.default: (0, 1), torch.ops.aten.addmm.default: (1, 2), torch.ops.aten.mv.default: (0, 1),
    torch.ops.aten.addmv.default: (1, 2), torch.ops.aten._addmm_activation.default: (1, 2),
    torch.ops.aten._grouped_mm.default: (0, 1),
}


def check_operands(func, args: tuple) -> None:
    """Raise the real kernel's error where a matrix product's fake kernel takes what the real one
    refuses: matrices of two dtypes (a float64 batch from NumPy into a float32 model, a float32 input
    to a half model without autocast, which casts before this is seen). Without it the estimate
    answered a batch size for a step that cannot run. Raised here, outside autobatch's tracing
    machinery, it is the step's own error (:func:`step_error`)."""
    places = _SAME_DTYPE.get(func)
    if places is None:
        return
    first, second = (args[i] for i in places)
    if isinstance(first, torch.Tensor) and isinstance(second, torch.Tensor) and first.dtype != second.dtype:
        raise RuntimeError(f"expected m1 and m2 to have the same dtype, but got: {first.dtype} != {second.dtype} "
                           f"({func.__name__}; the real kernel refuses it)")


GROUPED_MM = torch.ops.aten._grouped_mm.default


def grouped_mm(args: tuple, kwargs: dict) -> torch.Tensor:
    """``aten._grouped_mm`` (a mixture of experts' batched expert matrices, transformers' Mixtral
    and Qwen-MoE) as the real kernel allocates it. PyTorch's meta kernel takes only bfloat16 (the
    CUDA fast path's type), where the kernel falls back to a loop for float32 and float16 on every
    device: a float32 Mixtral, which trains, was refused as the step's own error ("Expected inputs
    of BF16 type"). Its result's rows are padded to 16 bytes on every device, by the meta kernel
    only in CUDA builds (a CPU bfloat16 result 15 % short at 20 columns)."""
    mat_a, mat_b, offs = (list(args) + [None])[:3]
    options = {**dict(zip(("bias", "out_dtype"), args[3:])), **kwargs}
    if mat_a.dtype not in (torch.float32, torch.float16) or options.get("bias") is not None \
            or options.get("out_dtype") not in (None, mat_a.dtype):
        size = GROUPED_MM(*args, **kwargs).shape  # its checks and errors, as the kernel's
    else:  # the meta kernel's checks and result size, less its dtype check (same dtypes: check_operands)
        size = _grouped_size(mat_a, mat_b, offs)
    dtype = options.get("out_dtype") or mat_a.dtype
    alignment = 16 // dtype.itemsize
    padded = -(-size[-1] // alignment) * alignment
    stride = (size[1] * padded, padded, 1) if len(size) == 3 else (padded, 1)
    return torch.empty_strided(size, stride, dtype=dtype, device=mat_a.device)


def _grouped_size(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor | None) -> tuple[int, ...]:
    """The size of ``_grouped_mm``'s result, checked as PyTorch's meta kernel checks it."""
    a_2d, b_2d = mat_a.dim() == 2, mat_b.dim() == 2
    torch._check(mat_a.dim() in (2, 3) and mat_b.dim() in (2, 3), lambda: "Multiplicands must be 2D or 3D")
    torch._check((a_2d and b_2d) or mat_a.size(-1) == mat_b.size(-2),
                 lambda: "contraction dimension of mat_a and mat_b must match")
    torch._check((offs is not None) == (a_2d or b_2d), lambda: "Offsets tensor is needed for 2D multiplicands, and only for them")
    torch._check(offs is None or (offs.dim() == 1 and offs.dtype == torch.int32), lambda: "Offsets tensor must be 1D int32")
    for mat in (mat_a, mat_b):  # the kernel's: one of the last two strides 1, the other a multiple of 16 bytes
        rows, cols = mat.stride()[-2:]
        lead = rows if cols == 1 and rows >= max(1, mat.size(-1)) else cols if rows == 1 and cols >= max(1, mat.size(-2)) else 0
        torch._check(lead > 0 and lead * mat.element_size() % 16 == 0, lambda: "strides should be multiple of 16 bytes")
    if a_2d and b_2d:
        return (offs.size(0), mat_a.size(0), mat_b.size(1))
    if a_2d or b_2d:
        torch._check(offs.size(0) == (mat_b if a_2d else mat_a).size(0), lambda: "matrix batch sizes have to match")
        return (mat_a.size(0), mat_b.size(-1)) if a_2d else (mat_a.size(1), mat_b.size(1))
    torch._check(mat_a.size(0) == mat_b.size(0), lambda: "batched dimension has to match")
    return (mat_a.size(0), mat_a.size(1), mat_b.size(-1))


#: Operators that build a sparse tensor from index and value tensors the step gave: its memory is theirs,
#: which the trace counts (every other operator's sparse result has no nonzeros in a fake trace).
_SPARSE_FROM_PARTS = (torch.ops.aten._sparse_coo_tensor_with_dims_and_tensors.default,
                      torch.ops.aten._sparse_compressed_tensor_unsafe.default)


class SparseTraceError(RuntimeError):
    """An operator in the trace returned a sparse tensor, whose size a fake tensor does not know:
    the estimate's limit (an :class:`~autobatch.probe.tracing.estimate.EstimateError` from it, being autobatch's)."""


def check_sparse(func, out) -> None:
    """Raise :class:`SparseTraceError` where ``func`` (not one building a sparse tensor from the
    step's own indices and values) returned a sparse tensor: PyTorch's fake sparse results have no
    nonzeros (torch 2.13: ``coalesce``, ``t``, ``a + b``, even ``a * 2``), so their memory would be
    counted as none. A GCN's ``torch.sparse.mm`` of a coalesced adjacency (its transpose in
    backward) was estimated 30 % above the batch ``binary`` found, then 22 trials."""
    if func not in _SPARSE_FROM_PARTS and any(
            isinstance(t, torch.Tensor) and t.layout in _COMPONENTS for t in tree_leaves(out)):  # a sparse layout
        raise SparseTraceError(
            f"{func} returns a sparse tensor, whose number of nonzeros (and so its memory) depends on the data, and "
            "PyTorch's fake version of it has none (a coalesced adjacency matrix, its transpose in backward, a sum of two)")


def from_the_step(exc: BaseException) -> bool:
    """Whether ``exc`` is a step's own error that a trace re-raised (:func:`step_error`)."""
    return any(isinstance(note, str) and note.startswith(NOTE) for note in getattr(exc, "__notes__", None) or ())


def untraceable_memory(step, loss: torch.nn.Module | None = None) -> str | None:
    """Why fake tensors would count the step's memory short, or None, for its model and ``loss``, the
    module the loss is (``loss_fn=criterion``, traced as the model is). Measured against
    :func:`~autobatch.simulated_memory` (torch 2.13, CPU): an ``nn.LSTM`` on the CPU runs
    oneDNN's kernel, whose fake version reports no workspace (estimated 0.63 MB of a 3.12 MB
    peak at batch 32; ``GRU``, ``RNN``, ``LSTMCell`` and an LSTM with ``proj_size``, which oneDNN
    does not take, within 4 %; one in the loss module was estimated at 0.27 of the peak, unrefused);
    sparse gradients (``sparse=True`` embeddings, ``SparseAdam``) have as many rows as the batch
    happens to touch, which a fake tensor cannot know (estimated 3.98 MB of 8.03 MB)."""
    for prefix, owner in (("", step.model), ("loss_fn.", loss)):
        for name, module in owner.named_modules() if owner is not None else ():
            if isinstance(module, torch.nn.LSTM) and not module.proj_size and step.device.type == "cpu":
                where = prefix + name if name else ("the loss module" if prefix else "the model")
                return f"{where} is an LSTM on the CPU, whose kernel's workspace fake tensors do not see"
    reason = sparse_gradients(step.model, (step.optimizer,))
    if reason is None and loss is not None and sparse_gradients(loss) is not None:
        reason = f"the loss module: {sparse_gradients(loss)}"
    return reason


def sparse_embeddings(model: torch.nn.Module | None) -> Iterator[tuple[str, torch.nn.Module]]:
    """``(name, module)`` of each ``nn.Embedding`` / ``nn.EmbeddingBag`` in ``model`` built with
    ``sparse=True`` (its weight's gradient is a sparse tensor)."""
    for name, module in model.named_modules() if model is not None else ():
        if isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and module.sparse:
            yield name, module


def sparse_gradients(model: torch.nn.Module | None, optimizers: tuple = ()) -> str | None:
    """Why the step's gradients are sparse (a ``sparse=True`` embedding in ``model``, a
    ``SparseAdam`` among ``optimizers``), or None: their memory depends on how many rows the
    batch touches, which neither a fake tensor nor one trial's batches can know."""
    for name, _ in sparse_embeddings(model):
        return f"{name or 'the model'} has sparse gradients, whose size depends on the data"
    if any(isinstance(optimizer, torch.optim.SparseAdam) for optimizer in optimizers):
        return "SparseAdam steps on sparse gradients, whose size depends on the data"
    return None


#: What a batch's leaves may be besides tensors, for :class:`RealBatches` to see every tensor in it.
_PLAIN = (int, float, complex, bool, str, bytes, type(None))


class RealBatches:
    """The fake step's ``make_batch``: the user's, traced with fake tensors, or, where that reads the
    data's values (:data:`_CANNOT`: graph sizes summed with ``int(sizes.sum())``, ``repeat_interleave``
    by them, ``EmbeddingBag`` offsets from lengths), built for real with the trace's modes off and
    given to the step as fakes. Its real storages (seen by an accountant of its own, as
    :func:`~autobatch.simulated_memory` sees them) are counted as the trace's allocations, its
    temporaries as a transient; a tensor that existed before it (a slice of a preloaded dataset) is
    ``world``'s, resident. A variable-size batch of graphs was refused before: a GNN's peak is now
    within 0.01 % of the measured one. A batch whose tensors a container hides from ``tree_leaves``
    (an object of the user's) raises the trace's error, as before."""

    def __init__(self, make_batch: Callable[[int], Any], accountant: StorageAccountant, world: Any) -> None:
        self.make_batch, self.accountant, self.world = make_batch, accountant, world
        # once the fake batch failed, every later one is built for real; a batch read from stored samples
        # (DatasetBatches) is built so at once: traced, its per-sample reads spent the trace's operator budget
        self.real = bool(getattr(make_batch, "reads_stored_samples", False))

    def __call__(self, batch_size: int) -> Any:  # noqa: D102
        if not self.real:
            try:
                return self.make_batch(batch_size)
            except (DataDependentOutputException, DynamicOutputShapeException):
                return self._real(batch_size, first=True)  # may re-raise this error: it must run inside the clause
        return self._real(batch_size, first=False)

    def _real(self, batch_size: int, first: bool) -> Any:
        device_type = self.world.device_type
        own = StorageAccountant(lambda t: t.device.type == device_type and not isinstance(t, FakeTensor))
        with _disable_current_modes(), own:
            batch = self.make_batch(batch_size)
        if first and any(not isinstance(leaf, (torch.Tensor, *_PLAIN)) for leaf in tree_leaves(batch)):
            raise  # noqa: PLE0704 - tensors hidden in an object of the user's: the fake batch's error, as before
        self.real = True  # every later batch is built for real too
        made, fresh = set(own._live), []

        def fake(leaf: Any) -> Any:
            if not isinstance(leaf, torch.Tensor) or isinstance(leaf, FakeTensor):
                return leaf
            if leaf.untyped_storage()._cdata not in made:
                self.world.counts(leaf if leaf._base is None else leaf._base)  # existed before: resident
                return self.world.mode.from_tensor(leaf)
            faked = self.world.mode.from_tensor(leaf)
            if faked.device.type == device_type:
                fresh.append(faked.untyped_storage())
            return faked

        fakes = tree_map(fake, batch)
        self.accountant.adopt(fresh, own.peak_bytes)
        return fakes
