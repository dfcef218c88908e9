import math

import pytest
import torch
import torch.nn.functional as F
from helpers import LargestNewTensor, check_op, non_contiguous, randn

import liger_lab
from liger_lab import reference, runtime
from liger_lab.nn import FusedLinearJSD
from liger_lab.ops import fused_linear_jsd as fljsd_module
from liger_lab.ops.chunked import grad_outputs
from liger_lab.ops.operators import allocate_outputs
from liger_lab.workbook.checks import check_against_reference, relative_l2_error

N, HS, HT, V = 37, 24, 40, 1300  # the teacher wider than the student; V not a power of 2
CHUNK = 16  # 37 rows: chunks of 16, 16 and 5
BETAS = [0.0, 0.5, 1.0, 0.25]
TEMPERATURES = [1.0, 2.0, 0.5]
NAMES = ["student_hidden", "student_weight", "teacher_hidden", "teacher_weight"]


def targets(shape, ignored_every=3, ignore_index=-100):
    t = torch.randint(0, V, shape, device=runtime.DEVICE)
    if ignored_every:
        t.view(-1)[::ignored_every] = ignore_index
    return t


def heads(n=N, student_size=HS, teacher_size=HT, vocab=V, dtype=torch.float32, scale=1.0, lead=None):
    """Student and teacher hidden states and heads; logits of about ``2 * scale`` standard deviation."""
    lead = (n,) if lead is None else lead
    return [
        randn(*lead, student_size, dtype=dtype, scale=scale),
        randn(vocab, student_size, dtype=dtype, scale=2 * student_size**-0.5),
        randn(*lead, teacher_size, dtype=dtype, scale=scale),
        randn(vocab, teacher_size, dtype=dtype, scale=2 * teacher_size**-0.5),
    ]


def _check_bf16_like_pytorch(tensors, target, **kwargs):
    """bf16 logits carry a relative rounding of 2**-9, and the JSD's gradient (a difference of two nearby
    distributions, with no one-hot term to dominate it as in cross-entropy) passes it on at about 1e-2. So each
    figure is compared with float64 and may be up to twice the error of the same loss in plain PyTorch on the
    same bf16 tensors (bf16 logits from F.linear, fp32 math after), or 1e-2, whichever is larger."""
    options = {k: v for k, v in kwargs.items() if k not in ("chunk_tokens", "accumulation")}
    pytorch_errors, our_errors = [], []
    check_against_reference(
        "PyTorch in bf16",
        lambda *a: reference.fused_linear_jsd(*a, target, **options),
        lambda *a: reference.fused_linear_jsd(*a, target, **options),
        tensors, input_names=NAMES, tol=1.0, errors=pytorch_errors,
    )  # fmt: skip
    check_op("fused_linear_jsd", *tensors, target, tol=1.0, errors=our_errors, **kwargs)
    assert len(our_errors) == len(pytorch_errors) == 3  # the loss and two gradients
    for ours, pytorch in zip(our_errors, pytorch_errors, strict=True):
        assert ours <= max(1e-2, 2 * pytorch), (our_errors, pytorch_errors)


@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize("beta", BETAS)
def test_matches_float64_over_chunks_that_do_not_divide_the_rows(beta, temperature):
    assert check_op("fused_linear_jsd", *heads(), targets((N,)), chunk_tokens=CHUNK, beta=beta, temperature=temperature)


def test_same_loss_as_jsd_of_the_two_products():
    """The definition: liger_lab.jsd of the materialised logits, in fp32."""
    sh, sw, th, tw = heads()
    target = targets((N,))
    for beta in BETAS:
        fused = liger_lab.fused_linear_jsd(sh, sw, th, tw, target, beta=beta, temperature=2.0, chunk_tokens=CHUNK)
        plain = liger_lab.jsd(sh @ sw.t(), th @ tw.t(), target, beta=beta, temperature=2.0)
        torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("chunk_tokens", [1, 7, 64, None])
def test_any_chunk_size_gives_the_same_result(chunk_tokens):
    assert check_op("fused_linear_jsd", *heads(n=12), targets((12,)), chunk_tokens=chunk_tokens, beta=0.25)


@pytest.mark.parametrize("beta", [0.0, 0.25, 1.0])
def test_vocabulary_of_several_blocks(beta):
    """20001 columns: more than one vocabulary block of the row kernel, in the interpreter and on the GPU."""
    tensors = heads(n=9, vocab=20001)
    assert check_op("fused_linear_jsd", *tensors, targets((9,)), chunk_tokens=4, beta=beta, temperature=0.5)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_3d_inputs_with_a_sequence_entirely_ignored(beta):
    target = targets((3, 9), ignored_every=4)
    target[1] = -100  # a whole sequence of padding
    assert check_op("fused_linear_jsd", *heads(lead=(3, 9)), target, chunk_tokens=CHUNK, beta=beta, temperature=0.5)


@pytest.mark.parametrize("beta", [0.0, 0.25, 1.0])
def test_without_target_every_row_counts(beta):
    tensors = heads(lead=(2, 7))
    assert check_op("fused_linear_jsd", *tensors, None, chunk_tokens=5, beta=beta, temperature=2.0)
    keep_all = targets((2, 7), ignored_every=0)
    torch.testing.assert_close(
        liger_lab.fused_linear_jsd(*tensors, beta=beta), liger_lab.fused_linear_jsd(*tensors, keep_all, beta=beta)
    )


def test_ignored_rows_have_zero_gradient_and_do_not_count():
    sh, sw, th, tw = heads()
    target = targets((N,), ignored_every=3, ignore_index=7).to(torch.int32)  # a custom index, int32 labels
    leaf = sh.clone().requires_grad_()
    loss = liger_lab.fused_linear_jsd(leaf, sw, th, tw, target, ignore_index=7, chunk_tokens=CHUNK)
    loss.backward()
    ignored = target == 7
    assert (leaf.grad[ignored] == 0).all() and (leaf.grad[~ignored] != 0).any(dim=-1).all()
    kept_only = liger_lab.fused_linear_jsd(sh[~ignored], sw, th[~ignored], tw)
    torch.testing.assert_close(loss, kept_only)
    assert check_op("fused_linear_jsd", sh, sw, th, tw, target, ignore_index=7, chunk_tokens=CHUNK)


@pytest.mark.parametrize("beta", BETAS)
def test_all_rows_ignored_gives_zero_loss_and_zero_gradients(beta):
    sh, sw, th, tw = heads(n=10)
    sh.requires_grad_(), sw.requires_grad_()
    target = torch.full((10,), -100, device=runtime.DEVICE)
    loss = liger_lab.fused_linear_jsd(sh, sw, th, tw, target, beta=beta, chunk_tokens=4)
    loss.backward()
    assert loss.dtype == torch.float32 and loss.item() == 0.0
    assert torch.equal(sh.grad, torch.zeros_like(sh)) and torch.equal(sw.grad, torch.zeros_like(sw))
    assert reference.fused_linear_jsd(sh.double(), sw.double(), th.double(), tw.double(), target).item() == 0.0


@pytest.mark.parametrize("accumulation", ["fp32", "weight_dtype"])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_fp16(beta, accumulation):
    tensors = heads(dtype=torch.float16)
    assert check_op(
        "fused_linear_jsd",
        *tensors,
        targets((N,)),
        chunk_tokens=CHUNK,
        accumulation=accumulation,
        beta=beta,
        temperature=2.0,
    )
    sh, sw = (t.clone().requires_grad_() for t in tensors[:2])
    loss = liger_lab.fused_linear_jsd(sh, sw, *tensors[2:], accumulation=accumulation)
    loss.backward()
    assert loss.dtype == torch.float32 and sh.grad.dtype == sw.grad.dtype == torch.float16


def test_teacher_in_another_dtype_than_the_student():
    """An fp16 teacher: its logits are rounded to fp16 (about 5e-4 relative), which moves the student's
    gradient by about as much; the float64 reference gets the same fp16 inputs, exactly."""
    sh, sw, th, tw = heads()
    assert check_op(
        "fused_linear_jsd", sh, sw, th.half(), tw.half(), targets((N,)), tol=2e-3, chunk_tokens=CHUNK, beta=0.25
    )


@pytest.mark.parametrize("scale", [8.0, 5e3])
@pytest.mark.parametrize("beta", BETAS)
def test_huge_logits_stay_finite_and_exact(beta, scale):
    """Logits of about 16 (over T = 0.5, some pass 88, where exp overflows fp32 without the max shift) and of
    about 1e4 (both softmaxes one-hot: the reverse KL's and the mixture's gradients are the zeros they are)."""
    assert check_op(
        "fused_linear_jsd", *heads(scale=scale), targets((N,)), chunk_tokens=CHUNK, beta=beta, temperature=0.5
    )


def test_non_contiguous_student_hidden():
    tensors = heads()
    assert not non_contiguous(tensors[0]).is_contiguous()
    assert check_op(
        "fused_linear_jsd",
        *tensors,
        targets((N,)),
        prepare=lambda t: non_contiguous(t) if t.shape[0] == N else t,
        chunk_tokens=CHUNK,
        beta=0.5,
    )


def test_teacher_gets_no_gradient():
    sh, sw, th, tw = (t.requires_grad_() for t in heads(n=8))
    liger_lab.fused_linear_jsd(sh, sw, th * 1.0, tw * 1.0).backward()
    assert sh.grad is not None and sw.grad is not None and th.grad is None and tw.grad is None
    # Only the teacher requires grad: the loss is a constant.
    assert not liger_lab.fused_linear_jsd(sh.detach(), sw.detach(), th, tw).requires_grad


@pytest.mark.parametrize("trainable", ["student_hidden", "student_weight"])
def test_only_requested_gradients(trainable):
    tensors = dict(zip(NAMES, heads(), strict=True))
    target = targets((N,))
    tensors[trainable].requires_grad_()
    (grad,) = torch.autograd.grad(liger_lab.fused_linear_jsd(*tensors.values(), target, chunk_tokens=CHUNK),
                                  tensors[trainable])  # fmt: skip
    doubles = {name: t.detach().double() for name, t in tensors.items()}
    leaf = doubles[trainable].requires_grad_()
    (expected,) = torch.autograd.grad(reference.fused_linear_jsd(*doubles.values(), target), leaf)
    assert relative_l2_error(grad, expected) < 1e-5


def test_caller_tensors_are_never_modified():
    tensors, target = heads(), targets((N,))
    student = [t.clone().requires_grad_() for t in tensors[:2]]
    hidden = student[0] * 1.0  # an intermediate, like a final norm's output
    before = [hidden.detach().clone(), *(t.clone() for t in tensors), target.clone()]
    for beta in (0.0, 0.5, 1.0):
        loss = liger_lab.fused_linear_jsd(hidden, student[1], *tensors[2:], target, beta=beta, chunk_tokens=CHUNK)
        loss.backward(retain_graph=True)
    for after, original in zip([hidden.detach(), *tensors, target], before, strict=True):
        assert torch.equal(after, original)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_plain_backward_scaled_upstream_and_second_backward(dtype):
    tensors, target = heads(dtype=dtype), targets((N,))
    doubles = [t.double() for t in tensors]
    leaf64 = doubles[0].requires_grad_()
    (expected,) = torch.autograd.grad(reference.fused_linear_jsd(*doubles, target), leaf64)
    for upstream in (1.0, -2.5):  # 1.0: the backward skips its scaling pass
        leaf = tensors[0].clone().requires_grad_()
        (liger_lab.fused_linear_jsd(leaf, *tensors[1:], target, chunk_tokens=CHUNK) * upstream).backward()
        assert leaf.grad.dtype == dtype
        assert relative_l2_error(leaf.grad, upstream * expected) < (1e-5 if dtype == torch.float32 else 5e-3)
    loss = liger_lab.fused_linear_jsd(tensors[0].clone().requires_grad_(), *tensors[1:], target)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_no_grad_forward_matches_and_is_float32():
    tensors, target = heads(dtype=torch.float16), targets((N,))
    with torch.no_grad():
        plain = liger_lab.fused_linear_jsd(tensors[0].requires_grad_(), *tensors[1:], target, beta=0.25)
    with_grad = liger_lab.fused_linear_jsd(*tensors, target, beta=0.25)
    assert plain.dtype == with_grad.dtype == torch.float32 and plain.shape == () and not plain.requires_grad
    torch.testing.assert_close(plain, with_grad.detach())


def test_reference_matches_trl_style_definition():
    """The reference against the generalized JSD written out on explicit float64 logits (kl_div on
    log-probabilities and a masked mean, as TRL's GKD trainer writes it)."""
    sh, sw, th, tw = (t.double() for t in heads(lead=(2, 6)))
    target = targets((2, 6), ignored_every=5)
    temperature, mask = 1.5, target != -100
    log_q = F.log_softmax(torch.einsum("bth,vh->btv", sh, sw) / temperature, -1)
    log_p = F.log_softmax(torch.einsum("bth,vh->btv", th, tw) / temperature, -1)

    def masked_mean(pointwise):
        return pointwise.sum(-1)[mask].sum() / mask.sum()

    for beta in BETAS:
        if beta == 0:
            expected = masked_mean(F.kl_div(log_q, log_p, reduction="none", log_target=True))
        elif beta == 1:
            expected = masked_mean(F.kl_div(log_p, log_q, reduction="none", log_target=True))
        else:
            log_m = (beta * log_p.exp() + (1 - beta) * log_q.exp()).log()
            expected = masked_mean(
                beta * F.kl_div(log_m, log_p, reduction="none", log_target=True)
                + (1 - beta) * F.kl_div(log_m, log_q, reduction="none", log_target=True)
            )
        got = reference.fused_linear_jsd(sh, sw, th, tw, target, beta=beta, temperature=temperature)
        torch.testing.assert_close(got, expected)
    assert 0 < reference.fused_linear_jsd(sh, sw, th, tw, beta=0.5) < math.log(2)  # the symmetric JSD's bound


def test_chunk_size_follows_the_memory_budget():
    bf16, fp32 = torch.bfloat16, torch.float32
    # The design shape: 832 MiB less the 64 MiB hidden gradient, over 2 x 128256 x 2 bytes per row: 1569 -> 1536.
    assert fljsd_module.chunk_rows_for(8192, 128256, bf16, bf16, other_bytes=64 * 2**20) == 1536
    assert fljsd_module.chunk_rows_for(8192, 128256, bf16, bf16) == 1664
    assert fljsd_module.chunk_rows_for(8192, 128256, bf16, fp32) == 1088  # an fp32 teacher's row costs 1.5x
    assert fljsd_module.chunk_rows_for(8192, 128256, bf16, bf16, budget=2**20) == 64  # never below 64
    assert fljsd_module.chunk_rows_for(100, 32000, bf16, bf16) == 100  # never above the row count


STUDENT_GRADS = grad_outputs(hidden="student_hidden", weight="student_weight")


@pytest.mark.parametrize("beta", [0.0, 0.5])
def test_no_tensor_holds_the_logits_of_every_row(beta):
    """The op's work under a dispatch mode: nothing it allocates is bigger than a chunk of logits, dW or dh."""
    n, chunk, vocab = 64, 10, 300
    sh, sw, th, tw = heads(n=n, student_size=8, teacher_size=12, vocab=vocab)
    args = (sh, sw, th, tw, targets((n,)), None, beta, 2.0, -100, chunk, "fp32", True, [True, True, False])
    loss_and_entropy = [sh.new_empty((), dtype=torch.float32), sh.new_empty(n, dtype=torch.float32)]
    outputs = [*loss_and_entropy, *allocate_outputs(fljsd_module._forward, STUDENT_GRADS, args)]
    with LargestNewTensor() as mode:  # the operator's work itself (a mode sees an operator's call, not inside it)
        fljsd_module._forward(*args, *outputs)
    assert mode.largest <= max(chunk * vocab, sw.numel(), sh.numel()) < n * vocab


def test_module_matches_function():
    tensors, target = heads(), targets((N,), ignore_index=3)
    module = FusedLinearJSD(beta=0.25, temperature=2.0, ignore_index=3, chunk_tokens=CHUNK)
    assert "beta=0.25" in repr(module) and not list(module.parameters())
    torch.testing.assert_close(
        module(*tensors, target),
        liger_lab.fused_linear_jsd(*tensors, target, beta=0.25, temperature=2.0, ignore_index=3),
    )


def _ints(*shape):
    return torch.zeros(shape, dtype=torch.int64, device=runtime.DEVICE)


@pytest.mark.parametrize(
    "make,kwargs,message",
    [
        (lambda h: (h[0][:-1], *h[1:]), {}, r"teacher_hidden has shape \(37, 40\): expected \(36,\) rows"),
        (lambda h: (h[0], h[1][:, :-1], *h[2:]), {}, r"student_weight has shape \(1300, 23\): expected \(V, 24\)"),
        (lambda h: (*h[:3], h[3][:, :-1]), {}, r"teacher_weight has shape \(1300, 39\): expected \(V, 40\)"),
        (lambda h: (*h[:3], h[3][:-1]), {}, r"teacher_weight has shape \(1299, 40\).*vocabulary V = 1300"),
        (lambda h: (h[0], h[1][:0], *h[2:]), {}, "V >= 1"),
        (lambda h: (h[0], h[1][0], *h[2:]), {}, "student_weight has shape"),
        (lambda h: (h[0], h[1].half(), *h[2:]), {}, "student_weight has dtype torch.float16: expected"),
        (lambda h: (*h[:3], h[3].half()), {}, "teacher_weight has dtype torch.float16"),
        (lambda h: (h[0].double(), h[1].double(), *h[2:]), {}, "torch.float64"),
        (lambda h: (h[0][0, 0], *h[1:]), {}, "at least one dimension"),
        (lambda h: (*h, _ints(N + 1)), {}, r"target has shape \(38,\): expected \(37,\)"),
        (lambda h: (*h, _ints(N).float()), {}, "integer tensor"),
        (lambda h: (*h, list(range(N))), {}, "torch.Tensor or None"),
        (lambda h: h, {"beta": 1.5}, r"beta is 1.5.*\[0, 1\]"),
        (lambda h: h, {"beta": -0.1}, "beta is -0.1"),
        (lambda h: h, {"temperature": 0.0}, "temperature is 0.0"),
        (lambda h: h, {"temperature": math.inf}, "finite"),
        (lambda h: h, {"ignore_index": 0.5}, "ignore_index"),
        (lambda h: h, {"chunk_tokens": 0}, "chunk_tokens"),
        (lambda h: h, {"chunk_tokens": True}, "chunk_tokens"),
        (lambda h: h, {"accumulation": "bf16"}, "accumulation"),
    ],
)
def test_bad_input_is_a_value_error_before_anything_is_written(make, kwargs, message):
    inputs = make(heads())
    before = [v.clone() if isinstance(v, torch.Tensor) else v for v in inputs]
    with pytest.raises(ValueError, match=message):
        liger_lab.fused_linear_jsd(*inputs, **kwargs)
    for after, original in zip(inputs, before, strict=True):
        assert not isinstance(after, torch.Tensor) or torch.equal(after, original)


@pytest.mark.skipif(not runtime.INTERPRET, reason="only in the interpreter are CUDA tensors the wrong device")
def test_interpreter_rejects_other_devices():
    sh, sw, th, tw = heads()
    with pytest.raises(ValueError, match="expected a CPU tensor"):
        liger_lab.fused_linear_jsd(sh, sw, th.to("meta"), tw)
    with pytest.raises(ValueError, match="target is on meta"):
        liger_lab.fused_linear_jsd(sh, sw, th, tw, _ints(N).to("meta"))


@pytest.mark.cuda
@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_bf16_128k_vocabulary(beta, temperature):
    tensors = heads(n=64, student_size=256, teacher_size=384, vocab=128256, dtype=torch.bfloat16)
    target = targets((64,))
    _check_bf16_like_pytorch(tensors, target, chunk_tokens=24, beta=beta, temperature=temperature)


@pytest.mark.cuda
def test_bf16_3d_default_chunks_and_fp16():
    tensors = heads(student_size=512, teacher_size=768, vocab=50257, dtype=torch.bfloat16, lead=(4, 700))
    assert check_op("fused_linear_jsd", *tensors, targets((4, 700)), beta=0.25, temperature=2.0)
    assert check_op(
        "fused_linear_jsd", *heads(n=300, vocab=32000, dtype=torch.float16), None, chunk_tokens=128, beta=1.0
    )


@pytest.mark.cuda
def test_peak_memory_at_the_design_shape():
    """dW (bf16: its fp32 accumulator would be 2 GiB), the hidden gradient and two chunks of logits."""
    n, size, vocab = 8192, 4096, 128256
    sh, sw, th, tw = heads(n=n, student_size=size, teacher_size=size, vocab=vocab, dtype=torch.bfloat16)
    sh.requires_grad_(), sw.requires_grad_()
    target = targets((n,))

    def step():
        torch.autograd.grad(liger_lab.fused_linear_jsd(sh, sw, th, tw, target), [sh, sw])

    step()  # cuBLAS workspaces are allocated once, before the measurement
    peak = runtime.peak_memory_bytes(step)
    bound = 2 * vocab * size + fljsd_module.CHUNK_BUDGET_BYTES + 64 * 2**20
    assert peak <= bound, f"peak {peak / 2**20:.0f} MiB above the inputs, bound {bound / 2**20:.0f} MiB"


@pytest.mark.parametrize("beta", [0.0, 0.25, 1.0])
def test_entropy_of_the_student_comes_with_the_loss(beta):
    """``entropy=True``: the entropy of softmax(student / T) per row, 0 on an ignored row and without gradient, beside
    a loss and gradients unchanged by asking for it."""
    sh, sw, th, tw = heads(lead=(3, 9))
    target, temperature = targets((3, 9)), 0.7
    student = [sh.clone().requires_grad_(), sw.clone().requires_grad_()]
    loss, entropy = liger_lab.fused_linear_jsd(
        *student, th, tw, target, beta=beta, temperature=temperature, chunk_tokens=CHUNK, entropy=True
    )
    assert entropy.shape == target.shape and entropy.dtype == torch.float32 and not entropy.requires_grad
    log_q = F.log_softmax(torch.einsum("bth,vh->btv", sh.double(), sw.double()) / temperature, -1)
    expected = -(log_q.exp() * log_q).sum(-1) * (target != -100)
    assert relative_l2_error(entropy, expected) < 1e-6 and bool((entropy[target == -100] == 0).all())
    grads = torch.autograd.grad(loss, student)
    plain = [sh.clone().requires_grad_(), sw.clone().requires_grad_()]
    plain_loss = liger_lab.fused_linear_jsd(*plain, th, tw, target, beta=beta, temperature=temperature,
                                            chunk_tokens=CHUNK)  # fmt: skip
    assert torch.equal(loss.detach(), plain_loss.detach())
    for ours, without in zip(grads, torch.autograd.grad(plain_loss, plain), strict=True):
        assert torch.equal(ours, without)
    with torch.no_grad():
        _, no_grad_entropy = liger_lab.fused_linear_jsd(sh, sw, th, tw, target, beta=beta, temperature=temperature,
                                                        entropy=True)  # fmt: skip
    torch.testing.assert_close(no_grad_entropy, entropy)
    with pytest.raises(ValueError, match="entropy is 1"):
        liger_lab.fused_linear_jsd(sh, sw, th, tw, entropy=1)
