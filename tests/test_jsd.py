import math

import pytest
import torch
import torch.nn.functional as F
from helpers import check_op, non_contiguous, randn, row_strided

import liger_lab
from liger_lab import reference, runtime
from liger_lab.nn import JSD
from liger_lab.workbook.checks import relative_l2_error

BETAS = [0.0, 0.5, 1.0, 0.3]
TEMPERATURES = [1.0, 2.0, 0.7]


def targets(shape, ignored_every=3, ignore_index=-100):
    """Labels with every ``ignored_every``-th one set to ``ignore_index`` (0: none ignored)."""
    t = torch.randint(0, 1000, shape, device=runtime.DEVICE)
    if ignored_every:
        t.view(-1)[::ignored_every] = ignore_index
    return t


@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize("beta", BETAS)
def test_matches_float64_fp32(beta, temperature):
    s, t = randn(33, 1000, scale=2.0), randn(33, 1000, scale=2.0)
    assert check_op("jsd", s, t, targets((33,)), prepare=lambda z: z.clone(), beta=beta, temperature=temperature)


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("shape", [(1, 37), (3, 40001), (2, 5, 333), (70, 130)])
def test_shapes(shape, beta):
    """One row; 40001 columns span several vocabulary blocks (on the GPU and in the interpreter); 3-D."""
    s, t = randn(*shape, scale=3.0), randn(*shape, scale=3.0)
    assert check_op("jsd", s, t, targets(shape[:-1], ignored_every=4), beta=beta, temperature=0.7)


def _check_fp16(s, t, target, **kwargs):
    """The fp32 loss against float64; the fp16 gradient within twice what rounding the exact gradient to fp16
    costs (its entries are small: (Q - P) / T / rows, many of them below fp16's normal range)."""
    leaf, leaf64 = s.clone().requires_grad_(), s.double().requires_grad_()
    loss = liger_lab.jsd(leaf, t, target, **kwargs)
    expected = reference.jsd(leaf64, t.double(), target, **kwargs)
    loss.backward()
    expected.backward()
    assert loss.dtype == torch.float32 and leaf.grad.dtype == torch.float16
    assert relative_l2_error(loss, expected) < 1e-5
    floor = relative_l2_error(leaf64.grad.half(), leaf64.grad)
    assert relative_l2_error(leaf.grad, leaf64.grad) < max(2 * floor, 1e-3)


@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("beta", BETAS)
def test_fp16(beta, temperature):
    s, t = randn(33, 1000, scale=2.0, dtype=torch.float16), randn(33, 1000, scale=2.0, dtype=torch.float16)
    _check_fp16(s, t, targets((33,)), beta=beta, temperature=temperature)


def test_teacher_in_another_dtype():
    s, t = randn(20, 300, scale=2.0), randn(20, 300, scale=2.0, dtype=torch.float16)
    assert check_op("jsd", s, t, targets((20,)))


@pytest.mark.parametrize("layout", [non_contiguous, row_strided, lambda z: z.t().contiguous().t()])
def test_non_contiguous_inputs(layout):
    s, t = randn(24, 300, scale=2.0), randn(24, 300, scale=2.0)
    assert not layout(s).is_contiguous()
    assert check_op("jsd", s, layout(t), targets((24,)), prepare=layout, beta=0.3)
    target = targets((24, 2))[:, 0]  # a strided target
    assert not target.is_contiguous()
    assert check_op("jsd", s, layout(t), target, prepare=layout, beta=1.0)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_without_target_every_row_counts(beta):
    s, t = randn(2, 7, 150, scale=2.0), randn(2, 7, 150, scale=2.0)
    assert check_op("jsd", s, t, None, beta=beta, temperature=2.0)
    keep_all = targets((2, 7), ignored_every=0)
    torch.testing.assert_close(liger_lab.jsd(s, t, beta=beta), liger_lab.jsd(s, t, keep_all, beta=beta))


def test_ignored_rows_have_zero_gradient_and_do_not_count():
    s, t = randn(12, 500).requires_grad_(), randn(12, 500)
    target = targets((12,), ignored_every=3, ignore_index=7).to(torch.int32)  # a custom index, int32 labels
    loss = liger_lab.jsd(s.clone(), t, target, ignore_index=7)
    loss.backward()
    ignored = target == 7
    assert (s.grad[ignored] == 0).all() and (s.grad[~ignored] != 0).any(dim=-1).all()
    kept_only = liger_lab.jsd(s.detach()[~ignored], t[~ignored])
    torch.testing.assert_close(loss, kept_only)
    assert check_op("jsd", s.detach(), t, target, ignore_index=7)


@pytest.mark.parametrize("beta", BETAS)
def test_all_rows_ignored_gives_zero_loss_and_zero_gradient(beta):
    s, t = randn(6, 300).requires_grad_(), randn(6, 300)
    target = torch.full((6,), -100, device=runtime.DEVICE)
    loss = liger_lab.jsd(s.clone(), t, target, beta=beta)
    loss.backward()
    assert loss.dtype == torch.float32 and loss.item() == 0.0
    assert torch.equal(s.grad, torch.zeros_like(s))
    assert reference.jsd(s.double(), t.double(), target, beta=beta).item() == 0.0  # the reference says so too


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_huge_logits_stay_finite_and_exact(beta, temperature):
    """Logits of 1e4: softmaxes saturate to one-hot, and the reverse KL's gradient must be the zero it is."""
    s, t = randn(16, 1000, scale=1e4), randn(16, 1000, scale=1e4)
    assert check_op("jsd", s, t, targets((16,)), beta=beta, temperature=temperature)


def test_teacher_gets_no_gradient():
    s, t = randn(8, 100).requires_grad_(), randn(8, 100).requires_grad_()
    liger_lab.jsd(s, t * 1.0).backward()
    assert s.grad is not None and t.grad is None
    # Only the teacher requires grad: the loss is a constant.
    assert not liger_lab.jsd(s.detach(), t).requires_grad


def test_caller_tensors_are_never_modified():
    s, t, target = randn(10, 200).requires_grad_(), randn(10, 200), targets((10,))
    logits = s * 1.0  # an intermediate result, like lm_head's output
    before = [logits.detach().clone(), t.clone(), target.clone()]
    for beta in (0.0, 0.5, 1.0):
        loss = liger_lab.jsd(logits, t, target, beta=beta, temperature=2.0)
        loss.backward(retain_graph=True)
    for after, original in zip([logits.detach(), t, target], before, strict=True):
        assert torch.equal(after, original)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_plain_backward_and_scaled_upstream_gradient(dtype):
    """fp16 stores the unscaled gradient and the backward applies 1/n; fp32 folds 1/n into the forward."""
    s, t, target = randn(9, 300, dtype=dtype), randn(9, 300, dtype=dtype), targets((9,))
    leaf64 = s.double().requires_grad_()
    (expected,) = torch.autograd.grad(reference.jsd(leaf64, t.double(), target), leaf64)
    for upstream in (1.0, -2.5):  # 1.0: the backward skips its scaling pass
        leaf = s.clone().requires_grad_()
        (liger_lab.jsd(leaf, t, target) * upstream).backward()
        assert leaf.grad.dtype == dtype
        assert relative_l2_error(leaf.grad, upstream * expected) < (1e-5 if dtype == torch.float32 else 5e-3)


def test_second_backward_is_an_error():
    s = randn(4, 50).requires_grad_()
    loss = liger_lab.jsd(s, randn(4, 50))
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_loss_is_float32_and_the_same_without_grad():
    s, t = randn(5, 64, dtype=torch.float16), randn(5, 64, dtype=torch.float16)
    with torch.no_grad():
        plain = liger_lab.jsd(s, t, beta=0.3)
    with_grad = liger_lab.jsd(s.clone().requires_grad_(), t, beta=0.3)
    assert plain.dtype == with_grad.dtype == torch.float32 and plain.shape == ()
    torch.testing.assert_close(plain, with_grad.detach())


def test_reference_matches_kl_div_definitions():
    """The reference against TRL's way of writing it: F.kl_div on log-probabilities, a masked batch mean."""
    s, t = randn(4, 6, 50, scale=2.0, dtype=torch.float64), randn(4, 6, 50, scale=2.0, dtype=torch.float64)
    target = targets((4, 6), ignored_every=5)
    temperature, mask = 1.5, target != -100
    log_q, log_p = F.log_softmax(s / temperature, -1), F.log_softmax(t / temperature, -1)

    def masked_mean(pointwise):
        return pointwise.sum(-1)[mask].sum() / mask.sum()

    forward_kl = masked_mean(F.kl_div(log_q, log_p, reduction="none", log_target=True))
    reverse_kl = masked_mean(F.kl_div(log_p, log_q, reduction="none", log_target=True))
    m = 0.3 * log_p.exp() + 0.7 * log_q.exp()
    mixture = masked_mean(0.3 * F.kl_div(m.log(), log_p, reduction="none", log_target=True)) + masked_mean(
        0.7 * F.kl_div(m.log(), log_q, reduction="none", log_target=True)
    )
    for beta, expected in ((0.0, forward_kl), (1.0, reverse_kl), (0.3, mixture)):
        got = reference.jsd(s, t, target, beta=beta, temperature=temperature)
        torch.testing.assert_close(got, expected)
    # beta = 1/2 is the symmetric Jensen-Shannon divergence, bounded by log 2.
    p, q = log_p.exp(), log_q.exp()
    m = (p + q) / 2
    classic = (0.5 * (p * (p / m).log()).sum(-1) + 0.5 * (q * (q / m).log()).sum(-1)).mean()
    torch.testing.assert_close(reference.jsd(s, t, beta=0.5, temperature=temperature), classic)
    assert 0 < classic < math.log(2)


def test_module_matches_function():
    s, t, target = randn(15, 64), randn(15, 64), targets((15,), ignore_index=3)
    module = JSD(beta=0.3, temperature=2.0, ignore_index=3)
    assert "beta=0.3" in repr(module)
    torch.testing.assert_close(
        module(s, t, target), liger_lab.jsd(s, t, target, beta=0.3, temperature=2.0, ignore_index=3)
    )


def _ints(*shape):
    return torch.zeros(shape, dtype=torch.int64, device=runtime.DEVICE)


@pytest.mark.parametrize(
    "make,kwargs,message",
    [
        (lambda: (randn(4, 10), randn(4, 11), None), {}, r"teacher_logits has shape \(4, 11\).*\(4, 10\)"),
        (lambda: (randn(4, 10), randn(5, 10), None), {}, r"teacher_logits has shape \(5, 10\)"),
        (lambda: (randn(2, 2, 10), randn(4, 10), None), {}, "the student's shape"),
        (lambda: (randn(4, 10), randn(4, 10), None), {"beta": -0.1}, r"beta is -0.1.*\[0, 1\]"),
        (lambda: (randn(4, 10), randn(4, 10), None), {"beta": 1.5}, "beta is 1.5"),
        (lambda: (randn(4, 10), randn(4, 10), None), {"beta": math.nan}, "beta is nan"),
        (lambda: (randn(4, 10), randn(4, 10), None), {"beta": "0.5"}, "beta is '0.5': expected a number"),
        (lambda: (randn(4, 10), randn(4, 10), None), {"temperature": 0.0}, "temperature is 0.0"),
        (lambda: (randn(4, 10), randn(4, 10), None), {"temperature": -1.0}, "positive"),
        (lambda: (randn(4, 10), randn(4, 10), None), {"temperature": math.inf}, "finite"),
        (lambda: (randn(4, 10), randn(4, 10), None), {"ignore_index": 1.5}, "ignore_index"),
        (lambda: (randn(4, 10), randn(4, 10), None), {"ignore_index": 2**63}, "int64 range"),
        (lambda: (randn(4, 10), randn(4, 10), _ints(5)), {}, r"target has shape \(5,\): expected \(4,\)"),
        (lambda: (randn(2, 3, 10), randn(2, 3, 10), _ints(6)), {}, r"expected \(2, 3\)"),
        (lambda: (randn(4, 10), randn(4, 10), _ints(4).float()), {}, "integer tensor"),
        (lambda: (randn(4, 10), randn(4, 10), _ints(4).bool()), {}, "integer tensor"),
        (lambda: (randn(4, 10), randn(4, 10), [0, 1, 2, 3]), {}, "torch.Tensor or None"),
        (lambda: (randn(4, 10).double(), randn(4, 10), None), {}, "student_logits has dtype torch.float64"),
        (lambda: (randn(4, 10), randn(4, 10).double(), None), {}, "teacher_logits has dtype torch.float64"),
        (lambda: (_ints(4, 10), randn(4, 10), None), {}, "student_logits has dtype torch.int64"),
        (lambda: (randn(4, 10), "logits", None), {}, "teacher_logits must be a torch.Tensor"),
        (lambda: (randn(4, 0), randn(4, 0), None), {}, "V >= 1"),
        (lambda: (randn(1)[0], randn(1)[0], None), {}, r"expected \(\.\.\., V\)"),
    ],
)
def test_bad_input_is_a_value_error_before_anything_is_written(make, kwargs, message):
    inputs = make()
    before = [v.clone() if isinstance(v, torch.Tensor) else v for v in inputs]
    with pytest.raises(ValueError, match=message):
        liger_lab.jsd(*inputs, **kwargs)
    for after, original in zip(inputs, before, strict=True):
        assert not isinstance(after, torch.Tensor) or torch.equal(after, original)


@pytest.mark.skipif(not runtime.INTERPRET, reason="only in the interpreter are CUDA tensors the wrong device")
def test_interpreter_rejects_non_cpu_tensors():
    with pytest.raises(ValueError, match="expected a CPU tensor"):
        liger_lab.jsd(torch.empty(4, 8, device="meta"), randn(4, 8))
    with pytest.raises(ValueError, match="target is on meta"):
        liger_lab.jsd(randn(4, 8), randn(4, 8), torch.zeros(4, dtype=torch.int64, device="meta"))


@pytest.mark.cuda
@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_bf16_128k_vocabulary(beta, temperature):
    s = randn(64, 128256, scale=2.0, dtype=torch.bfloat16)
    t = randn(64, 128256, scale=2.0, dtype=torch.bfloat16)
    assert check_op("jsd", s, t, targets((64,)), prepare=lambda z: z.clone(), beta=beta, temperature=temperature)


@pytest.mark.cuda
def test_bf16_3d_fp16_and_huge_logits_on_gpu():
    s, t = randn(4, 33, 32000, dtype=torch.bfloat16), randn(4, 33, 32000, dtype=torch.bfloat16)
    assert check_op("jsd", s, t, targets((4, 33)), beta=0.3)
    _check_fp16(randn(64, 50257, dtype=torch.float16), randn(64, 50257, dtype=torch.float16), None, beta=1.0)
    _check_saturated(randn(32, 32000, scale=1e4), randn(32, 32000, scale=1e4), targets((32,)), temperature=0.7)


def _check_saturated(student, teacher, target, temperature):
    """Logits of 1e4 saturate both softmaxes to one-hot, and the gradient is zero up to entries of about
    exp(-70) = 1e-31 / rows, fp32 subnormals that the GPU flushes to zero: a relative error of that all-but-zero
    vector means nothing. The loss must match, and the gradient to far below its natural scale 1 / (T rows)."""
    student.requires_grad_()
    loss = liger_lab.jsd(student, teacher, target, temperature=temperature)
    (grad,) = torch.autograd.grad(loss, student)
    s64 = student.detach().double().requires_grad_()
    expected = reference.jsd(s64, teacher.double(), target, temperature=temperature)
    (expected_grad,) = torch.autograd.grad(expected, s64)
    assert math.isclose(loss.item(), expected.item(), rel_tol=1e-5)
    kept = int((target != -100).sum())
    assert torch.isfinite(grad).all()
    assert (grad.double() - expected_grad).abs().max().item() <= 1e-6 / (temperature * kept)


@pytest.mark.cuda
def test_offsets_past_two_to_the_31():
    # 8200 rows x 262144 columns = 2.1e9 elements: row offsets overflow int32 in the last rows.
    n, vocab = 8200, 262144
    s, t = randn(n, vocab, dtype=torch.bfloat16), randn(n, vocab, dtype=torch.bfloat16)
    keep_last = torch.full((n,), -100, device=runtime.DEVICE)
    keep_last[-3:] = 0
    tail = s[-3:].double().requires_grad_()
    expected = reference.jsd(tail, t[-3:].double())
    (expected_grad,) = torch.autograd.grad(expected, tail)
    s.requires_grad_()
    loss = liger_lab.jsd(s, t, keep_last)
    (grad,) = torch.autograd.grad(loss, s)
    assert relative_l2_error(loss, expected) < 1e-2
    assert relative_l2_error(grad[-3:], expected_grad) < 1e-2
    assert (grad[:-3] == 0).all()
