import pytest
import torch
import torch.nn.functional as F
from helpers import check_op, non_contiguous, randn, row_strided

import liger_lab
from liger_lab import reference, runtime
from liger_lab.nn import CrossEntropyLoss
from liger_lab.ops.cross_entropy import count_targets
from liger_lab.workbook.checks import relative_l2_error

OPTIONS = [
    {},
    {"label_smoothing": 0.1},
    {"softcap": 4.0},
    {"z_loss_scale": 1e-2},
    {"label_smoothing": 0.2, "softcap": 3.0, "z_loss_scale": 1e-3, "ignore_index": 5},
]


def targets(shape, vocab, ignored_every=4, ignore_index=-100):
    """Random class indices with every ``ignored_every``-th one set to ``ignore_index`` (0: none ignored)."""
    t = torch.randint(0, vocab, shape, device=runtime.DEVICE)
    if ignored_every:
        t.view(-1)[::ignored_every] = ignore_index
    return t


def reference_grad(fn, x, *args):
    """d fn(x, *args) / dx in float64."""
    x = x.detach().double().requires_grad_()
    return torch.autograd.grad(fn(x, *args), x)[0]


def indices(values):
    return torch.tensor(values, device=runtime.DEVICE)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("options", OPTIONS)
def test_matches_float64_fp32(options, reduction):
    z = randn(33, 1000, scale=3.0)
    t = targets((33,), 1000, ignore_index=options.get("ignore_index", -100))
    # clone(): the usual case, logits that are an intermediate result (written over in place).
    assert check_op("cross_entropy", z, t, prepare=lambda z: z.clone(), reduction=reduction, **options)


@pytest.mark.parametrize("shape", [(1, 37), (5, 4099), (3, 7, 333), (70, 130), (2, 1, 5000)])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_shapes(shape, reduction):
    target = targets(shape[:-1], shape[-1], ignored_every=3)
    assert check_op("cross_entropy", randn(*shape, scale=2.0), target, reduction=reduction)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_fp16(reduction):
    z = randn(33, 1000, scale=2.0, dtype=torch.float16)
    assert check_op("cross_entropy", z, targets((33,), 1000), reduction=reduction, label_smoothing=0.1)


@pytest.mark.parametrize("layout", [non_contiguous, row_strided, lambda z: z.t().contiguous().t()])
def test_non_contiguous_logits(layout):
    z, t = randn(24, 300), targets((24,), 300)
    assert not layout(z).is_contiguous()
    assert check_op("cross_entropy", z, t, prepare=layout, label_smoothing=0.1)


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_confident_tokens_keep_their_digits_at_large_logits(label_smoothing):
    """Logits near 100, the target 12 above the rest: a token's loss is about 1e-2. Written lse - z_target it
    carries lse's rounding at 100 (about 4e-6 here); as (max - z_target) + log(sum) it stays within 2e-6 (PyTorch's
    fp32 log_softmax: about 5e-7; label smoothing's mean of the row adds its own rounding)."""
    target = torch.randint(0, 500, (64,), device=runtime.DEVICE)
    z = randn(64, 500) + 100.0
    z[torch.arange(64), target] += 12.0
    loss = liger_lab.cross_entropy(z, target, reduction="none", label_smoothing=label_smoothing)
    expected = reference.cross_entropy(z.double(), target, reduction="none", label_smoothing=label_smoothing)
    assert (loss.double() - expected).abs().max().item() < 2e-6


def test_huge_logits_stay_finite_and_exact():
    z = randn(16, 1000, scale=1e4)
    t = targets((16,), 1000)
    assert check_op("cross_entropy", z, t)
    assert check_op("cross_entropy", z, t, reduction="none", z_loss_scale=1e-4)


def test_ignored_rows_have_zero_loss_and_zero_gradient():
    z = randn(12, 500).requires_grad_()
    t = targets((12,), 500, ignored_every=3)
    loss = liger_lab.cross_entropy(z.clone(), t, reduction="none")
    loss.backward(torch.ones_like(loss))
    ignored = t == -100
    assert (loss[ignored] == 0).all() and (loss[~ignored] > 0).all()
    assert (z.grad[ignored] == 0).all() and (z.grad[~ignored] != 0).any(dim=-1).all()


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_targets_ignored_gives_zero_not_nan(reduction):
    z = randn(6, 300).requires_grad_()
    t = torch.full((6,), -100, device=runtime.DEVICE)
    loss = liger_lab.cross_entropy(z.clone(), t, reduction=reduction, z_loss_scale=1e-2)
    loss.sum().backward()
    assert torch.isfinite(loss).all() and (loss == 0).all()
    assert torch.equal(z.grad, torch.zeros_like(z))


def test_default_never_modifies_the_logits():
    """A z-loss, a logged loss or a second loss computed after the call must see the logits unchanged."""
    z = randn(10, 200).requires_grad_()
    t = targets((10,), 200)
    logits = z * 1.0
    before = logits.detach().clone()
    loss = liger_lab.cross_entropy(logits, t)
    assert torch.equal(logits.detach(), before)
    second = liger_lab.cross_entropy(logits, t, label_smoothing=0.1)  # reads the same logits again
    z_loss = torch.logsumexp(logits, -1).pow(2).mean()
    (loss + second + 1e-3 * z_loss).backward()
    expected = reference_grad(
        lambda z, t: reference.cross_entropy(z, t) + reference.cross_entropy(z, t, label_smoothing=0.1)
        + 1e-3 * torch.logsumexp(z, -1).pow(2).mean(), z, t
    )  # fmt: skip
    assert relative_l2_error(z.grad, expected) < 1e-5
    fp32 = randn(6, 50).requires_grad_()
    liger_lab.cross_entropy(fp32.float(), targets((6,), 50)).backward()  # .float() of fp32 is fp32 itself
    assert fp32.grad is not None and not torch.equal(fp32.detach(), fp32.grad)


def test_in_place_backward_writes_the_gradient_over_intermediate_logits():
    z = randn(10, 200).requires_grad_()
    t = targets((10,), 200)
    logits = z * 1.0  # an intermediate result, like lm_head's output
    loss = liger_lab.cross_entropy(logits, t, in_place_backward=True)
    expected = reference_grad(reference.cross_entropy, z, t)
    assert relative_l2_error(logits.detach(), expected) < 1e-5  # the buffer now holds d loss / d logits
    loss.backward()
    assert relative_l2_error(z.grad, expected) < 1e-5


def test_logits_are_untouched_without_grad_and_for_parameters():
    z, t = randn(10, 200), targets((10,), 200)
    original = z.clone()
    liger_lab.cross_entropy(z, t, in_place_backward=True)
    parameter = torch.nn.Parameter(z.clone())
    loss = liger_lab.cross_entropy(parameter, t, in_place_backward=True)
    with torch.no_grad():
        liger_lab.cross_entropy(z.clone().requires_grad_(), t, in_place_backward=True)
    assert torch.equal(z, original) and torch.equal(parameter.detach(), original)
    loss.backward()
    assert relative_l2_error(parameter.grad, reference_grad(reference.cross_entropy, z, t)) < 1e-5


def test_a_producer_that_saved_the_logits_is_refused():
    """exp saves its output for its own backward; overwriting it must fail loudly, not silently."""
    z = randn(6, 50).requires_grad_()
    loss = liger_lab.cross_entropy(torch.exp(z), targets((6,), 50), in_place_backward=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_plain_backward_and_scaled_upstream_gradient():
    z, t = randn(9, 300), targets((9,), 300)
    expected = reference_grad(reference.cross_entropy, z, t)
    for in_place in (False, True):
        for upstream in (1.0, -2.5):  # 1.0: the backward skips its scaling pass
            leaf = z.clone().requires_grad_()
            (liger_lab.cross_entropy(leaf.clone(), t, in_place_backward=in_place) * upstream).backward()
            assert relative_l2_error(leaf.grad, upstream * expected) < 1e-5


@pytest.mark.parametrize("in_place", [False, True])
def test_second_backward_is_an_error(in_place):
    z = randn(4, 50).requires_grad_()
    loss = liger_lab.cross_entropy(z.clone(), targets((4,), 50), in_place_backward=in_place)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_int32_targets_and_custom_ignore_index():
    z = randn(20, 100)
    t = targets((20,), 100, ignore_index=0).to(torch.int32)
    assert check_op("cross_entropy", z, t, ignore_index=0)


def test_rows_of_several_blocks():
    # 40000 columns span several column blocks on the GPU and in the interpreter (pass 2 walks them back).
    z = randn(3, 40000, scale=3.0)
    target = targets((3,), 40000, ignored_every=0)
    assert check_op("cross_entropy", z, target, prepare=lambda z: z.clone(), label_smoothing=0.1)


def test_target_counts_span_several_blocks():
    t = targets((70001,), 50, ignored_every=7)  # more than one 65536-target block in the interpreter
    t[-1] = 50
    kept = t[t != -100]
    counts = count_targets(t, 50, -100).tolist()
    assert counts == [kept.numel(), 1, kept.min().item(), 50]


@pytest.mark.parametrize("in_place", [False, True])
def test_out_of_range_target_is_a_value_error_that_leaves_the_logits_untouched(in_place):
    z = randn(4, 10).requires_grad_()
    for target, reduction, example in (([0, 1, 10**9, 2], "mean", "1000000000"), ([0, -7, 3, 2], "sum", "-7")):
        logits = z * 1.0
        before = logits.detach().clone()
        with pytest.raises(ValueError, match=rf"e.g. {example}"):
            liger_lab.cross_entropy(logits, indices(target), reduction=reduction, in_place_backward=in_place)
        assert torch.equal(logits.detach(), before)


@pytest.mark.parametrize("ignore_index", [2**63, -(2**63) - 1, 1.5, True])
def test_ignore_index_outside_int64_is_a_value_error(ignore_index):
    with pytest.raises(ValueError, match="ignore_index"):
        liger_lab.cross_entropy(randn(4, 10), indices([0, 1, 2, 3]), ignore_index=ignore_index)


def test_reference_matches_torch():
    z, t = randn(20, 100, dtype=torch.float64), targets((20,), 100)
    for options in ({}, {"label_smoothing": 0.3}, {"reduction": "sum"}, {"reduction": "none"}):
        torch.testing.assert_close(reference.cross_entropy(z, t, **options), F.cross_entropy(z, t, **options))
    capped = 2.0 * torch.tanh(z / 2.0)
    torch.testing.assert_close(reference.cross_entropy(z, t, softcap=2.0), F.cross_entropy(capped, t))
    lse = torch.logsumexp(z, -1)[t != -100]
    torch.testing.assert_close(
        reference.cross_entropy(z, t, z_loss_scale=0.1), F.cross_entropy(z, t) + 0.1 * lse.pow(2).mean()
    )


def test_module_matches_torch_module():
    z, t = randn(15, 64), targets((15,), 64)
    ours = CrossEntropyLoss(label_smoothing=0.05, ignore_index=-100)
    theirs = torch.nn.CrossEntropyLoss(label_smoothing=0.05, ignore_index=-100)
    torch.testing.assert_close(ours(z, t), theirs(z, t))


@pytest.mark.parametrize(
    "logits,target,kwargs,message",
    [
        (lambda: randn(4, 10), lambda: indices([0, 1, 10, 2]), {}, r"out of range \(e.g. 10\).*\[0, 10\)"),
        (lambda: randn(4, 10), lambda: indices([0, -1, 3, 2]), {}, "out of range"),
        (lambda: randn(4, 10), lambda: indices([0, -100, 3, 2]), {"ignore_index": 3}, "ignore_index=3"),
        (lambda: randn(4, 10), lambda: indices([0] * 5), {}, r"target has shape \(5,\)"),
        (lambda: randn(4, 10), lambda: indices([[0] * 10] * 4), {}, "target has shape"),
        (lambda: randn(4, 10), lambda: indices([0] * 4).float(), {}, "integer tensor"),
        (lambda: randn(4, 10), lambda: indices([0] * 4).bool(), {}, "integer tensor"),
        (lambda: randn(4, 10), lambda: [0, 1, 2, 3], {}, "torch.Tensor"),
        (lambda: randn(4, 10).double(), lambda: indices([0] * 4), {}, "torch.float64"),
        (lambda: indices(list(range(40))).reshape(4, 10), lambda: indices([0] * 4), {}, "dtype"),
        (lambda: randn(4, 0), lambda: indices([0] * 4), {}, "V >= 1"),
        (lambda: randn(1)[0], lambda: indices(0), {}, r"expected \(\.\.\., V\)"),
        (lambda: randn(4, 10), lambda: indices([0] * 4), {"reduction": "avg"}, "reduction"),
        (lambda: randn(4, 10), lambda: indices([0] * 4), {"label_smoothing": 1.5}, "label_smoothing"),
        (lambda: randn(4, 10), lambda: indices([0] * 4), {"softcap": 0.0}, "softcap"),
        (lambda: randn(4, 10), lambda: indices([0] * 4), {"z_loss_scale": -1.0}, "z_loss_scale"),
        (lambda: randn(4, 10), lambda: indices([0] * 4), {"ignore_index": 1.5}, "ignore_index"),
    ],
)
def test_bad_input_is_a_value_error(logits, target, kwargs, message):
    with pytest.raises(ValueError, match=message):
        liger_lab.cross_entropy(logits(), target(), **kwargs)


@pytest.mark.skipif(not runtime.INTERPRET, reason="only in the interpreter are CUDA tensors the wrong device")
def test_interpreter_rejects_non_cpu_tensors():
    with pytest.raises(ValueError, match="expected a CPU tensor"):
        liger_lab.cross_entropy(torch.empty(4, 8, device="meta"), indices([0] * 4))


@pytest.mark.cuda
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("options", OPTIONS)
def test_bf16_128k_vocabulary(options, reduction):
    z = randn(64, 128256, scale=2.0, dtype=torch.bfloat16)
    t = targets((64,), 128256, ignore_index=options.get("ignore_index", -100))
    assert check_op("cross_entropy", z, t, prepare=lambda z: z.clone(), reduction=reduction, **options)


@pytest.mark.cuda
def test_bf16_3d_and_fp16_on_gpu():
    assert check_op("cross_entropy", randn(4, 33, 32000, dtype=torch.bfloat16), targets((4, 33), 32000))
    assert check_op("cross_entropy", randn(64, 50257, dtype=torch.float16), targets((64,), 50257), reduction="sum")


@pytest.mark.cuda
def test_offsets_past_two_to_the_31():
    # 8200 rows x 262144 columns = 2.1e9 elements: row offsets overflow int32 in the last rows.
    n, vocab = 8200, 262144
    z = randn(n, vocab, dtype=torch.bfloat16)
    t = targets((n,), vocab, ignored_every=0)
    tail = z[-3:].double().requires_grad_()
    expected = reference.cross_entropy(tail, t[-3:], reduction="none")
    (expected_grad,) = torch.autograd.grad(expected.sum(), tail)
    loss = liger_lab.cross_entropy(z.requires_grad_(), t, reduction="none")
    (grad,) = torch.autograd.grad(loss.sum(), z)
    assert relative_l2_error(loss[-3:], expected) < 1e-2
    assert relative_l2_error(grad[-3:], expected_grad) < 1e-2
