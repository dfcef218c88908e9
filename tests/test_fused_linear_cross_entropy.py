import pytest
import torch
import torch.nn.functional as F
from helpers import check_op, randn

import liger_lab
from liger_lab import reference, runtime
from liger_lab.nn import FusedLinearCrossEntropyLoss
from liger_lab.ops import fused_linear_cross_entropy as flce_module
from liger_lab.workbook.checks import check_against_reference, relative_l2_error

N, H, V = 40, 32, 1000
CHUNK = 16  # 40 tokens: chunks of 16, 16 and 8


def reference_grad(fn, x, *args):
    """d fn(x, *args) / dx in float64."""
    x = x.detach().double().requires_grad_()
    return torch.autograd.grad(fn(x, *args), x)[0]


def targets(shape, vocab, ignored_every=5, ignore_index=-100):
    t = torch.randint(0, vocab, shape, device=runtime.DEVICE)
    if ignored_every:
        t.view(-1)[::ignored_every] = ignore_index
    return t


def inputs(n=N, hidden=H, vocab=V, dtype=torch.float32, bias=False, scale=1.0):
    made = [
        randn(n, hidden, dtype=dtype, scale=scale),
        randn(vocab, hidden, dtype=dtype, scale=hidden**-0.5),
        targets((n,), vocab),
    ]
    return made + ([randn(vocab, dtype=dtype, scale=0.1)] if bias else [])


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize(
    "options",
    [{}, {"label_smoothing": 0.1}, {"softcap": 3.0}, {"label_smoothing": 0.2, "softcap": 5.0, "ignore_index": 7}],
)
def test_matches_float64_fp32_over_several_chunks(options, reduction):
    tensors = inputs(bias=True)
    tensors[2] = targets((N,), V, ignore_index=options.get("ignore_index", -100))
    assert check_op("fused_linear_cross_entropy", *tensors, chunk_tokens=CHUNK, reduction=reduction, **options)


@pytest.mark.parametrize("chunk_tokens", [1, 5, 12, None])
def test_any_chunk_size_gives_the_same_result(chunk_tokens):
    assert check_op("fused_linear_cross_entropy", *inputs(n=12), chunk_tokens=chunk_tokens)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_fp32_loss_of_fp16_inputs_is_not_rounded(reduction):
    """The default loss is fp32 (a half loss rounds 12.16 to 12.19); loss_dtype asks for another."""
    hidden, weight, target = inputs(dtype=torch.float16)
    rounded = liger_lab.fused_linear_cross_entropy(
        hidden, weight, target, chunk_tokens=CHUNK, reduction=reduction, loss_dtype=torch.float16
    )
    exact = liger_lab.fused_linear_cross_entropy(hidden, weight, target, chunk_tokens=CHUNK, reduction=reduction)
    assert rounded.dtype == torch.float16 and exact.dtype == torch.float32
    expected = reference.fused_linear_cross_entropy(hidden.double(), weight.double(), target, reduction=reduction)
    assert relative_l2_error(exact, expected) < 1e-3
    torch.testing.assert_close(exact.half(), rounded)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = liger_lab.fused_linear_cross_entropy(h, w, target, chunk_tokens=CHUNK)
    assert (
        check_op("fused_linear_cross_entropy", hidden, weight, target, chunk_tokens=CHUNK)
        and loss.dtype == torch.float32
    )
    loss.backward()
    assert h.grad.dtype == torch.float16 and w.grad.dtype == torch.float16


def test_3d_hidden_and_target():
    hidden, weight, _ = inputs()
    assert check_op(
        "fused_linear_cross_entropy", randn(2, 9, H), weight, targets((2, 9), V), chunk_tokens=5, reduction="none"
    )


def test_huge_activations_stay_finite():
    assert check_op("fused_linear_cross_entropy", *inputs(scale=300.0), chunk_tokens=CHUNK)


@pytest.mark.parametrize("accumulation", ["fp32", "weight_dtype"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_fp16(accumulation, reduction):
    tensors = inputs(dtype=torch.float16, bias=True)
    assert check_op(
        "fused_linear_cross_entropy", *tensors, chunk_tokens=CHUNK, accumulation=accumulation, reduction=reduction
    )


def test_tied_weight_accumulates_embedding_and_head_gradients():
    ids, labels = targets((3, 11), V, ignored_every=0), targets((3, 11), V)
    table, proj = randn(V, H, scale=0.5), randn(H, H, scale=H**-0.5)

    def grads(dtype, head_loss):
        leaves = table.to(dtype).clone().requires_grad_(), proj.to(dtype).clone().requires_grad_()
        hidden = torch.tanh(F.embedding(ids, leaves[0]) @ leaves[1])  # the embedding table is also the head
        head_loss(hidden, leaves[0], labels).backward()
        return [leaf.grad for leaf in leaves]

    ours = grads(torch.float32, lambda h, w, t: liger_lab.fused_linear_cross_entropy(h, w, t, chunk_tokens=8))
    expected = grads(torch.float64, reference.fused_linear_cross_entropy)
    assert relative_l2_error(ours[0], expected[0]) < 1e-5
    assert relative_l2_error(ours[1], expected[1]) < 1e-5
    # Both uses of the table contribute: the head's share alone is far from the total.
    hidden = torch.tanh(F.embedding(ids, table.double()) @ proj.double())
    head_only = reference_grad(lambda w: reference.fused_linear_cross_entropy(hidden, w, labels), table)
    assert relative_l2_error(head_only, expected[0]) > 1e-2


@pytest.mark.parametrize("trainable", ["hidden", "weight", "bias"])
def test_only_requested_gradients(trainable):
    hidden, weight, target, bias = inputs(bias=True)
    leaves = {"hidden": hidden, "weight": weight, "bias": bias}
    leaves[trainable].requires_grad_()
    loss = liger_lab.fused_linear_cross_entropy(hidden, weight, target, bias, chunk_tokens=CHUNK)
    (grad,) = torch.autograd.grad(loss, leaves[trainable])
    doubles = {name: leaf.detach().double() for name, leaf in leaves.items()}

    def reference_loss(x):
        args = {**doubles, trainable: x}
        return reference.fused_linear_cross_entropy(args["hidden"], args["weight"], target, args["bias"])

    expected = reference_grad(reference_loss, doubles[trainable])
    assert relative_l2_error(grad, expected) < 1e-5


def test_no_grad_forward_leaves_inputs_alone():
    hidden, weight, target = inputs()
    copies = hidden.clone(), weight.clone()
    with torch.no_grad():
        loss = liger_lab.fused_linear_cross_entropy(hidden.requires_grad_(), weight, target, chunk_tokens=CHUNK)
    assert (
        relative_l2_error(loss, reference.fused_linear_cross_entropy(hidden.double(), weight.double(), target)) < 1e-6
    )
    assert torch.equal(hidden, copies[0]) and torch.equal(weight, copies[1])


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_targets_ignored(reduction):
    hidden, weight, _ = inputs(n=10)
    hidden.requires_grad_(), weight.requires_grad_()
    target = torch.full((10,), -100, device=runtime.DEVICE)
    loss = liger_lab.fused_linear_cross_entropy(hidden, weight, target, reduction=reduction, chunk_tokens=4)
    loss.sum().backward()
    assert (loss == 0).all()
    assert torch.equal(hidden.grad, torch.zeros_like(hidden)) and torch.equal(weight.grad, torch.zeros_like(weight))


def test_plain_backward_and_second_backward():
    hidden, weight, target = inputs()
    hidden.requires_grad_()
    loss = liger_lab.fused_linear_cross_entropy(hidden, weight, target, chunk_tokens=CHUNK)
    loss.backward(retain_graph=True)  # upstream gradient exactly 1: the scaling pass is skipped
    expected = reference_grad(reference.fused_linear_cross_entropy, hidden, weight.double(), target)
    assert relative_l2_error(hidden.grad, expected) < 1e-5
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_in_place_backward_matches_float64(reduction):
    options = {"reduction": reduction, "label_smoothing": 0.1}
    assert check_against_reference(
        "fused_linear_cross_entropy in place",
        lambda h, *rest: liger_lab.fused_linear_cross_entropy(
            h * 1.0, *rest, chunk_tokens=CHUNK, in_place_backward=True, **options
        ),
        lambda *a: reference.fused_linear_cross_entropy(*a, **options),
        inputs(bias=True),
        input_names=["hidden", "weight", "target", "bias"],
    )


def test_in_place_backward_writes_the_gradient_over_hidden():
    x, w, t = inputs()
    x.requires_grad_()
    hidden = x * 1.0  # an intermediate, like a final norm's output
    loss = liger_lab.fused_linear_cross_entropy(hidden, w, t, chunk_tokens=CHUNK, in_place_backward=True)
    expected = reference_grad(lambda h: reference.fused_linear_cross_entropy(h, w.double(), t), x)
    assert relative_l2_error(hidden.detach(), expected) < 1e-5
    loss.backward()
    assert relative_l2_error(x.grad, expected) < 1e-5


def test_in_place_backward_leaves_parameters_and_reduction_none_alone():
    x, w, t = inputs()
    parameter = torch.nn.Parameter(x.clone())
    liger_lab.fused_linear_cross_entropy(parameter, w, t, chunk_tokens=CHUNK, in_place_backward=True).backward()
    hidden = x.clone().requires_grad_()
    loss = liger_lab.fused_linear_cross_entropy(hidden, w, t, reduction="none", in_place_backward=True)
    loss.sum().backward()
    assert torch.equal(parameter.detach(), x) and torch.equal(hidden.detach(), x)
    assert relative_l2_error(parameter.grad * (t != -100).sum(), hidden.grad) < 1e-5


def test_reduction_none_summed_backward():
    """loss.sum().backward() hands the backward an expanded (stride 0) gradient, one value per token."""
    x, w, t = inputs()
    hidden = x.clone().requires_grad_()
    liger_lab.fused_linear_cross_entropy(hidden, w, t, reduction="none").sum().backward()
    expected = reference_grad(lambda h: reference.fused_linear_cross_entropy(h, w.double(), t, reduction="sum"), x)
    assert relative_l2_error(hidden.grad, expected) < 1e-5


def test_in_place_backward_refuses_a_producer_that_saved_its_output():
    """exp saves its output for its own backward; overwriting it must fail loudly, not silently."""
    x, w, t = inputs(scale=0.1)
    x.requires_grad_()
    loss = liger_lab.fused_linear_cross_entropy(torch.exp(x), w, t, in_place_backward=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_chunk_size_follows_the_memory_budget():
    # The design shape: 256 MiB / (128256 x 2 bytes) = 1046 tokens -> 1024, a multiple of 64; with the 64 MiB
    # hidden gradient paid from the budget, 192 MiB -> 784 -> 768.
    assert flce_module.chunk_tokens_for(8192, 128256, torch.bfloat16) == 1024
    assert flce_module.chunk_tokens_for(8192, 128256, torch.bfloat16, other_bytes=64 * 2**20) == 768
    assert flce_module.chunk_tokens_for(8192, 128256, torch.float32) == 512
    assert flce_module.chunk_tokens_for(8192, 128256, torch.bfloat16, budget=2**20) == 64  # never below 64
    assert flce_module.chunk_tokens_for(8192, 128256, torch.bfloat16, other_bytes=2**40) == 64
    assert flce_module.chunk_tokens_for(100, 32000, torch.bfloat16) == 100  # never above the token count
    assert flce_module.chunk_tokens_for(900, 151936, torch.bfloat16) == 768  # 832 fits: 768, a multiple of 256
    assert flce_module.chunk_tokens_for(800, 151936, torch.bfloat16) == 800  # every token fits: one chunk


def test_a_models_chunk_is_bounded_by_two_hidden_states():
    # 8 x 2048 tokens, H = 2048, V = 151936, bf16: two hidden states are 128 MiB -> 441 tokens -> 384.
    assert flce_module.chunk_tokens_in_model(16384, 2048, 151936, torch.bfloat16) == 384
    # Many tokens: the op's own budget is the smaller bound (256 MiB -> 883 -> 832 -> 768, a multiple of 256).
    assert flce_module.chunk_tokens_in_model(65536, 2048, 151936, torch.bfloat16) == 768
    assert flce_module.chunk_tokens_in_model(8, 64, 1000, torch.float32) == 8  # never above the token count


def test_auto_accumulation_picks_fp32_when_it_fits():
    small = torch.empty(1000, 64, dtype=torch.bfloat16, device="meta")
    llama3_head = torch.empty(128256, 4096, dtype=torch.bfloat16, device="meta")
    assert flce_module.accumulation_dtype(small, "auto") == torch.float32
    assert flce_module.accumulation_dtype(llama3_head, "auto") == torch.bfloat16  # 2 GiB of fp32: too much
    assert flce_module.accumulation_dtype(llama3_head, "fp32") == torch.float32
    assert flce_module.accumulation_dtype(llama3_head.float(), "auto") == torch.float32
    assert flce_module.accumulation_dtype(small, "weight_dtype") == torch.bfloat16


def test_module_takes_liger_argument_order():
    hidden, weight, target, bias = inputs(bias=True)
    loss = FusedLinearCrossEntropyLoss(reduction="sum", chunk_tokens=CHUNK)(weight, hidden, target, bias)
    expected = reference.fused_linear_cross_entropy(
        hidden.double(), weight.double(), target, bias.double(), reduction="sum"
    )
    assert relative_l2_error(loss, expected) < 1e-6
    hidden.requires_grad_()
    intermediate = hidden * 1.0
    FusedLinearCrossEntropyLoss(chunk_tokens=CHUNK, in_place_backward=True)(weight, intermediate, target).backward()
    assert torch.equal(intermediate.detach(), hidden.grad)  # the gradient went over the intermediate


def test_module_options_are_its_attributes_and_its_repr():
    """The module holds the function's options, as attributes a trainer may change and as its repr lists them."""
    hidden, weight, target = inputs()
    module = FusedLinearCrossEntropyLoss(chunk_tokens=CHUNK)
    assert repr(module) == (
        "FusedLinearCrossEntropyLoss(ignore_index=-100, label_smoothing=0.0, reduction='mean', softcap=None, "
        f"chunk_tokens={CHUNK}, accumulation=None, in_place_backward=False)"
    )
    module.reduction = "sum"
    expected = liger_lab.fused_linear_cross_entropy(hidden, weight, target, reduction="sum", chunk_tokens=CHUNK)
    assert torch.equal(module(weight, hidden, target), expected)


@pytest.mark.parametrize(
    "make,kwargs,message",
    [
        (lambda h, w, t: (h, w[:, :-1], t), {}, "weight has shape"),
        (lambda h, w, t: (h, w[0], t), {}, "weight has shape"),
        (lambda h, w, t: (h, w, t[:-1]), {}, "target has shape"),
        (lambda h, w, t: (h, w, t.float()), {}, "integer tensor"),
        (lambda h, w, t: (h, w, torch.full_like(t, V)), {}, "out of range"),
        (lambda h, w, t: (h, w.half(), t), {}, "expected one dtype"),
        (lambda h, w, t: (h, w, t, torch.zeros(V + 1, device=h.device)), {}, "bias has shape"),
        (lambda h, w, t: (h, w, t, torch.zeros(V, device=h.device).half()), {}, "expected one dtype"),
        (lambda h, w, t: (h.double(), w.double(), t), {}, "torch.float64"),
        (lambda h, w, t: (h, w, t), {"chunk_tokens": 0}, "chunk_tokens"),
        (lambda h, w, t: (h, w, t), {"accumulation": "bf16"}, "accumulation"),
        (lambda h, w, t: (h, w, t), {"reduction": "mean_per_token"}, "reduction"),
        (lambda h, w, t: (h, w, t), {"softcap": -1.0}, "softcap"),
    ],
)
def test_bad_input_is_a_value_error(make, kwargs, message):
    hidden, weight, target = inputs()
    with pytest.raises(ValueError, match=message):
        liger_lab.fused_linear_cross_entropy(*make(hidden, weight, target), **kwargs)


@pytest.mark.cuda
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("accumulation", ["fp32", "weight_dtype"])
def test_bf16_128k_vocabulary(reduction, accumulation):
    tensors = inputs(n=64, hidden=256, vocab=128256, dtype=torch.bfloat16, bias=True)
    assert check_op(
        "fused_linear_cross_entropy",
        *tensors,
        chunk_tokens=24,
        reduction=reduction,
        accumulation=accumulation,
        label_smoothing=0.1,
    )


@pytest.mark.cuda
def test_bf16_3d_softcap_default_chunks():
    hidden = randn(4, 700, 512, dtype=torch.bfloat16)
    weight = randn(50257, 512, dtype=torch.bfloat16, scale=512**-0.5)
    assert check_op("fused_linear_cross_entropy", hidden, weight, targets((4, 700), 50257), softcap=30.0)


@pytest.mark.cuda
def test_peak_memory_at_the_design_shape():
    n, hidden_size, vocab = 8192, 4096, 128256
    hidden = randn(n, hidden_size, dtype=torch.bfloat16).requires_grad_()
    weight = randn(vocab, hidden_size, dtype=torch.bfloat16, scale=hidden_size**-0.5).requires_grad_()
    target = targets((n,), vocab)

    def step(in_place=False):
        loss = liger_lab.fused_linear_cross_entropy(hidden, weight, target, in_place_backward=in_place)
        torch.autograd.grad(loss, [hidden, weight])

    step()  # cuBLAS workspaces are allocated once, before the measurement
    peak = runtime.peak_memory_bytes(step)
    assert peak <= 1.25 * 2**30, f"peak {peak / 2**30:.2f} GiB above the inputs"
    in_place_peak = runtime.peak_memory_bytes(lambda: step(in_place=True))
    chunk = flce_module.chunk_tokens_for(n, vocab, torch.bfloat16)
    # Beside dW and one chunk's logits: per-row losses, log-sum-exps and counts (under 4 MiB); a dh buffer is 64 MiB.
    assert in_place_peak <= (vocab * hidden_size + chunk * vocab) * 2 + 4 * 2**20, "dW and one chunk, no dh buffer"


@pytest.mark.parametrize(
    "options, message",
    [
        ({"loss_dtype": torch.int64}, "loss_dtype"),
        ({"loss_dtype": "float32"}, "loss_dtype"),
        ({"ignore_index": 2**63}, "ignore_index"),
        ({"ignore_index": 0.5}, "ignore_index"),
        ({"accumulation": "fp64"}, "accumulation"),
    ],
)
def test_bad_options_are_value_errors(options, message):
    hidden, weight, target = inputs()
    with pytest.raises(ValueError, match=message):
        liger_lab.fused_linear_cross_entropy(hidden, weight, target, **options)


@pytest.mark.parametrize("in_place", [False, True])
def test_out_of_range_target_leaves_hidden_untouched(in_place):
    hidden, weight, target = inputs()
    target[3] = weight.shape[0]
    leaf = hidden.clone().requires_grad_()
    h = leaf * 1.0
    before = h.detach().clone()
    with pytest.raises(ValueError, match="out of range"):
        liger_lab.fused_linear_cross_entropy(h, weight, target, chunk_tokens=CHUNK, in_place_backward=in_place)
    assert torch.equal(h.detach(), before)


def test_a_small_models_chunk_still_does_enough_work_to_hide_its_launches():
    # The small preset's loss (4 x 1024 tokens, H = 768, V = 32000, bf16): two hidden states would be 192 tokens,
    # 21 chunks a step whose launches cost the host more than their matmuls cost the GPU; the work floor gives
    # ceil(160e9 / (6 H V)) = 1086 tokens -> 1024 (4 chunks).
    assert flce_module.chunk_tokens_in_model(4096, 768, 32000, torch.bfloat16) == 1024
    assert flce_module.chunk_tokens_in_model(512, 768, 32000, torch.bfloat16) == 512  # never above the tokens
