import linecache
import traceback

import pytest
import torch
import triton
import triton.language as tl
from IPython.core.interactiveshell import InteractiveShell
from traitlets.config import Config

import liger_lab
from liger_lab import runtime
from liger_lab.workbook import checks, exercises

interpreter_only = pytest.mark.skipif(not runtime.INTERPRET, reason="the access watch is the interpreter's")


def test_check_close_reports_pass_fail_and_collects_the_error(capsys):
    errors = []
    expected = torch.tensor([1.0, 2.0, 2.0])
    assert checks.check_close("same", expected.clone(), expected, errors=errors)
    assert not checks.check_close("off", expected + 1.0, expected, tol=1e-5, errors=errors)
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("PASS same") and out[1].startswith("FAIL off")
    assert errors[0] == 0.0 and abs(errors[1] - 3**0.5 / 3) < 1e-12


def test_a_check_line_prints_the_tested_metric_beside_its_tolerance(capsys):
    # The tolerance is on the relative L2 error; the largest absolute error is context, and says so.
    expected = torch.tensor([100.0, 200.0], dtype=torch.float64)
    checks.check_close("scaled", expected * (1 + 1e-6), expected, tol=1e-5)
    line = capsys.readouterr().out.strip()
    assert line == "PASS scaled  rel L2 1.0e-06 (tol 1e-05)  context: max |err| 2.0e-04"


def test_check_close_with_a_dtype_fails_an_output_of_another_dtype(capsys):
    # An fp16 kernel that returns its fp32 accumulator is close to the reference, and still wrong.
    expected = torch.tensor([1.0, 2.0], dtype=torch.float64)
    assert checks.check_close("fp16 out", expected.half(), expected, dtype=torch.float16)
    assert not checks.check_close("fp32 out", expected.float(), expected, dtype=torch.float16)
    line = capsys.readouterr().out.splitlines()[-1]
    assert line == "FAIL fp32 out  dtype float32, expected float16"


def test_check_against_reference_collects_output_and_gradient_errors():
    errors = []
    x = torch.randn(5, 7)
    assert checks.check_against_reference("tanh", torch.tanh, torch.tanh, [x], input_names=["x"], errors=errors)
    assert len(errors) == 2 and max(errors) < 1e-6
    assert not checks.check_against_reference("wrong", torch.tanh, torch.sin, [x], input_names=["x"])


def test_a_reference_below_the_dtype_counts_as_its_zeros(capsys):
    # A one-hot softmax leaves gradients of about 1e-86: float32's zeros. Anything float32 can hold still counts.
    zeros = torch.zeros(8)
    assert checks.check_close("underflow", zeros, torch.full((8,), 1e-86, dtype=torch.float64))
    assert "below the smallest normal" in capsys.readouterr().out
    assert not checks.check_close("too large", torch.full((8,), 1e-30), torch.full((8,), 1e-86, dtype=torch.float64))
    assert not checks.check_close("representable", zeros, torch.full((8,), 1e-30, dtype=torch.float64))


class _IgnoresUpstream(torch.autograd.Function):
    # x.sum() whose backward assumes loss.backward() was called with a gradient of 1.
    @staticmethod
    def forward(ctx, x):
        return x.sum()

    @staticmethod
    def backward(ctx, grad):
        return torch.ones(1).expand(3)


def test_a_backward_that_ignores_its_upstream_gradient_fails_every_time(capsys):
    x = torch.randn(3)
    for _ in range(50):
        assert not checks.check_against_reference("ignores", _IgnoresUpstream.apply, torch.sum, [x])


def test_the_upstream_gradient_keeps_half_precision_gradients_normal():
    # A scalar loss of 8 x 500 fp16 logits has gradients near 1/4000; a standard normal upstream of 0.01 (one
    # draw in a hundred) would put them all below fp16's smallest normal number, 6.1e-5.
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        upstream = torch.stack([checks._upstream_gradient_like(torch.zeros((), dtype=dtype)) for _ in range(2000)])
        assert upstream.dtype == dtype
        assert upstream.abs().min() >= 1.25 and upstream.abs().max() <= 2.0
        assert (upstream > 0).any() and (upstream < 0).any()


# --------------------------------------------------------------------------------------------------
# Guarded exercise checks


@triton.jit
def _copy_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, MASK_LOAD: tl.constexpr, MASK_STORE: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(x_ptr + offsets, mask=mask if MASK_LOAD else None)
    tl.store(out_ptr + offsets, x, mask=mask if MASK_STORE else None)


def _copy(x, out, mask_load=True, mask_store=True, block=8):
    _copy_kernel[(triton.cdiv(x.numel(), block),)](
        x, out, x.numel(), BLOCK=block, MASK_LOAD=mask_load, MASK_STORE=mask_store
    )
    return out


def test_a_failed_check_inside_a_guard_stops_with_a_short_error(capsys):
    with pytest.raises(checks.CheckFailed, match=r"^exercise 9\.1: `off` failed"):
        with checks.guarded("exercise 9.1"):
            checks.check_close("fine", torch.ones(3), torch.ones(3))
            checks.check_close("off", torch.zeros(3), torch.ones(3))
            checks.check_close("never reached", torch.ones(3), torch.ones(3))
    assert [line.split()[0] for line in capsys.readouterr().out.splitlines()] == ["PASS", "FAIL"]
    # show_bug is meant to fail: it never stops, guarded or not.
    with checks.guarded("exercise 9.1"):
        assert checks.show_bug("buggy", torch.zeros(3), torch.ones(3))


@interpreter_only
def test_an_unmasked_load_is_reported_with_its_program_and_tensor(capsys):
    with pytest.raises(checks.CheckFailed):
        with checks.guarded("exercise 9.2") as guard:
            x = guard.band(torch.randn(21), "x")
            checks.check_close("copy", _copy(x, torch.empty(21), mask_load=False), x)
    line = capsys.readouterr().out.strip()
    assert line == "FAIL copy  out of bounds: program 2 read 3 elements past the end of `x`"


@interpreter_only
def test_an_unmasked_store_is_reported_and_never_reaches_memory(capsys):
    storage = torch.full((40,), -1.0)
    out = storage[:21]  # the store's last 3 lanes would land on storage[21:24]
    with pytest.raises(checks.CheckFailed):
        with checks.guarded("exercise 9.3"):
            _copy(torch.randn(21), out, mask_store=False)
    assert "program 2 wrote 3 elements past the end of `out`" in capsys.readouterr().out
    assert (storage[21:] == -1).all()


@interpreter_only
def test_a_strided_view_reports_accesses_between_its_elements(capsys):
    x = torch.randn(4, 8)[:, :5]  # rows of 5 in a stride of 8: 3 columns of each row are not x's
    with checks.guarded("exercise 9.4", bug=True):
        _copy_kernel[(1,)](x, torch.empty(32), 32, BLOCK=32, MASK_LOAD=False, MASK_STORE=True)
    out = capsys.readouterr().out
    assert out.startswith("BUG SHOWN exercise 9.4  out of bounds: ")
    assert "program 0 read 9 elements between the elements of `x`" in out
    assert "program 0 read 3 elements past the end of `x`" in out


@triton.jit
def _scale_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, WIDE: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64) if WIDE else tl.program_id(0)
    offsets = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(out_ptr + offsets, 2 * tl.load(x_ptr + offsets, mask=mask), mask=mask)


@interpreter_only
@pytest.mark.parametrize("wide", [True, False])
def test_the_tail_of_a_launch_past_2_31_catches_32_bit_offsets(wide, capsys):
    x, out = torch.randn(20), torch.zeros(20)
    with checks.guarded("exercise 9.5", bug=True) as guard:
        with guard.tail(2**31, 8):
            _scale_kernel[(3,)](x, out, 2**31 + 20, BLOCK=8, WIDE=wide)
    printed = capsys.readouterr().out
    if wide:
        assert torch.equal(out, 2 * x) and printed.startswith("BUG HIDDEN")
    else:
        assert (out == 0).all()
        assert printed.startswith(
            "BUG SHOWN exercise 9.5  out of bounds: program 268435456 read 8 elements far outside"
        )


def test_a_guard_band_catches_a_write_past_the_end(capsys):
    # What the bands alone show (on a GPU the kernels' accesses are not watched): a write outside the tensor.
    with pytest.raises(checks.CheckFailed):
        with checks.guarded("exercise 9.6") as guard:
            out = guard.band(torch.zeros(5), "out")
            assert torch.isnan(out.as_strided((2,), (1,), out.storage_offset() + 5)).all()  # the band
            out.as_strided((2,), (1,), out.storage_offset() + 5).fill_(1.0)
            checks.check_close("zeros", out, torch.zeros(5))
    assert capsys.readouterr().out.strip() == "FAIL zeros  out of bounds: wrote 2 elements past the end of `out`"


def test_inside_a_guard_check_against_reference_runs_on_banded_inputs():
    def square(x):
        beyond = x.detach().as_strided((1,), (1,), x.storage_offset() + x.numel())
        assert torch.isnan(beyond).all(), "the element after x is not a guard band"
        return x * x  # saves x for the backward: the guard's checks between forward and backward must not write

    with checks.guarded("exercise 9.7"):
        assert checks.check_against_reference("square", square, lambda x: x * x, [torch.randn(6)])


@pytest.fixture
def ipython():
    config = Config()
    config.HistoryManager.enabled = False  # no history database written by the test
    yield InteractiveShell.instance(config=config)
    InteractiveShell.clear_instance()


def test_exercise_errors_show_one_line_in_jupyter_and_a_traceback_elsewhere(ipython, capsys):
    ipython.run_cell('from liger_lab.workbook.exercises import todo\ntodo("9.8", "write it")')
    ipython.run_cell('from liger_lab.workbook.checks import CheckFailed\nraise CheckFailed("exercise 9.8: `x` failed")')
    shown = capsys.readouterr().out.strip().splitlines()
    assert shown == ["ExerciseNotDone: Exercise 9.8 is not done yet: write it", "CheckFailed: exercise 9.8: `x` failed"]
    try:
        exercises.todo("9.8", "write it")
    except exercises.ExerciseNotDone as error:
        plain = "".join(traceback.format_exception(error))
    assert plain.startswith("Traceback (most recent call last):") and "in todo" in plain


def test_a_todo_left_above_written_code_says_which_line_to_delete():
    source = (
        "def solve():\n"
        "    # EXERCISE 9.9: return one\n"
        '    liger_lab.workbook.exercises.todo("9.9", "return one")\n'
        "    return 1\n"
        "    # END EXERCISE 9.9\n"
    )
    namespace = {"liger_lab": liger_lab}
    exec(compile(source, "<cell 9.9>", "exec"), namespace)
    # Where Jupyter keeps a cell's source for tracebacks (and todo finds it).
    linecache.cache["<cell 9.9>"] = (len(source), None, source.splitlines(keepends=True), "<cell 9.9>")
    with pytest.raises(exercises.ExerciseNotDone, match=r"still in `solve`: delete line 3 of its cell, `liger_lab"):
        namespace["solve"]()


def test_a_kernel_marker_left_in_written_code_says_which_line_to_delete():
    @exercises.jit("9.9", "write the body")
    def written(x_ptr):
        # EXERCISE 9.9: write the body
        pass  # your code here
        tl.store(x_ptr, 1.0)
        # END EXERCISE 9.9

    with pytest.raises(exercises.ExerciseNotDone, match=r"still in `written`: delete line \d+ of its cell, `pass  #"):
        written[(1,)](torch.zeros(1, device=runtime.DEVICE))


@triton.jit
def _column_sum_kernel(x_ptr, out_ptr, n_rows, n_cols, ATOMIC: tl.constexpr, BLOCK: tl.constexpr):
    # Program p adds row p of x into out: a sum across programs, by atomics or by load + add + store.
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    row = tl.load(x_ptr + tl.program_id(0) * n_cols + cols, mask=mask, other=0.0)
    if ATOMIC:
        tl.atomic_add(out_ptr + cols, row, mask=mask)
    else:
        total = tl.load(out_ptr + cols, mask=mask, other=0.0)
        tl.store(out_ptr + cols, total + row, mask=mask)


@interpreter_only
def test_a_sum_across_programs_without_atomics_is_a_race(capsys):
    # The interpreter runs programs one at a time, so the plain sum is right there; on a GPU it loses updates.
    x = torch.randn(4, 6)
    with pytest.raises(checks.CheckFailed, match=r"^exercise 9\.7: `column sums` failed"):
        with checks.guarded("exercise 9.7") as guard:
            out = guard.band(torch.zeros(6), "out")
            _column_sum_kernel[(4,)](x, out, 4, 6, ATOMIC=False, BLOCK=8)
            checks.check_close("column sums", out, x.sum(0))
    assert capsys.readouterr().out.strip() == (
        "FAIL column sums  race: program 0 loaded and stored back 6 elements of `out` that program 1 stored too: "
        "lost updates: use tl.atomic_add"
    )
    with checks.guarded("exercise 9.7") as guard:
        out = guard.band(torch.zeros(6), "out")
        _column_sum_kernel[(4,)](x, out, 4, 6, ATOMIC=True, BLOCK=8)
        assert checks.check_close("column sums", out, x.sum(0))


@triton.jit
def _first_program_writes_kernel(out_ptr, n, BLOCK: tl.constexpr):
    # Program 0 clears out; every other program adds 1: right only if program 0 runs first.
    offsets = tl.arange(0, BLOCK)
    mask = offsets < n
    if tl.program_id(0) == 0:
        tl.store(out_ptr + offsets, tl.zeros([BLOCK], tl.float32), mask=mask)
    else:
        tl.atomic_add(out_ptr + offsets, tl.full([BLOCK], 1.0, tl.float32), mask=mask)


@interpreter_only
def test_programs_run_in_a_shuffled_order_inside_a_guard():
    out = torch.full((4,), 7.0)
    _first_program_writes_kernel[(8,)](out, 4, BLOCK=4)
    assert (out == 7).all()  # in order, program 0 clears first, then seven programs add 1 each
    with checks.guarded("exercise 9.8"):
        _first_program_writes_kernel[(8,)](out, 4, BLOCK=4)
    assert not (out == 7).all()  # program 0 ran after some of the others


def test_an_index_out_of_range_in_the_learners_code_is_one_located_line():
    # A gather at an ignored target (-100) raises inside PyTorch; the learner gets where and what, in one line.
    def logp_of(logits, target):
        return logits.log_softmax(-1).gather(-1, target[:, None])[:, 0]

    target = torch.tensor([1, -100, 2])
    with pytest.raises(checks.CheckFailed) as caught:
        with checks.guarded("exercise 9.9"):
            logp_of(torch.randn(3, 5), target)
    message = str(caught.value)
    assert "\n" not in message
    line = logp_of.__code__.co_firstlineno + 1  # the gather
    assert message.startswith(f"exercise 9.9: RuntimeError at line {line} of `logp_of`: index -100 is out of bounds")
    assert "ignore_index" in message
    with pytest.raises(ZeroDivisionError):  # any other error keeps its traceback
        with checks.guarded("exercise 9.9"):
            1 / 0  # noqa: B018


def test_output_names_and_dtypes_of_check_against_reference(capsys):
    # A float32 output promised from fp16 input: returned in fp16 it fails, and its line names it.
    x = torch.randn(4, 6).half()

    def fp16_softmax(x):
        return x.softmax(-1), x.float().sum(-1)

    def promised(x):
        return x.float().softmax(-1), x.float().sum(-1)

    def reference_fn(x):
        return x.softmax(-1), x.sum(-1)

    names, dtypes = ["probs", "total"], [torch.float32, torch.float32]
    assert checks.check_against_reference(
        "promised", promised, reference_fn, [x], input_names=["x"], output_names=names, output_dtypes=dtypes
    )
    assert not checks.check_against_reference(
        "fp16", fp16_softmax, reference_fn, [x], input_names=["x"], output_names=names, output_dtypes=dtypes
    )
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("PASS promised: probs  rel L2") and "(tol 1e-05)" in lines[0]
    assert [line for line in lines if line.startswith("FAIL")] == ["FAIL fp16: probs  dtype float16, expected float32"]
