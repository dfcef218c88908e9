"""The RL head (per-token log-probabilities and entropies of hidden @ weight.T) against float64, TRL's fused head,
opcheck and torch.compile with dynamic shapes."""

import pytest
import torch
import torch._dynamo.testing
from helpers import LargestNewTensor, check_op, randn, row_strided
from test_compile_dynamic import CompileCounter

import liger_lab
from liger_lab import reference, runtime
from liger_lab.ops import fused_linear_cross_entropy, logprobs

B, T, H, V = 2, 7, 16, 40


def targets(shape=(B, T), vocab=V, ignore_index=-100):
    t = torch.randint(0, vocab, shape, device=runtime.DEVICE)
    t.view(-1)[::4] = ignore_index
    return t


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"entropy": True, "chunk_tokens": 5},  # chunks of 5 rows: the last one short
        {"entropy": True, "temperature": 0.6, "bias": True},
        {"temperature": 1.7, "bias": True, "chunk_tokens": 9, "ignore_index": 3},
    ],
)
def test_matches_float64(options):
    options = dict(options)
    bias = randn(V, scale=0.5) if options.pop("bias", False) else None
    target = targets(ignore_index=options.get("ignore_index", -100))
    assert check_op("fused_linear_logprobs", randn(B, T, H), randn(V, H, scale=2 * H**-0.5), target, bias, **options)


def test_vocabulary_over_blocks_with_the_max_in_a_later_block():
    # 16411 columns: two 16384-column blocks in the interpreter. The bias raises the last columns, so a row's running
    # max moves in the second block and the entropy's running sum u is moved with it (exp(d) (u + d s)).
    vocab = 16411
    bias = torch.zeros(vocab, device=runtime.DEVICE)
    bias[16384:] = 4.0
    target = targets((5,), vocab)
    target[1] = vocab - 1
    assert check_op(
        "fused_linear_logprobs", randn(5, 8), randn(vocab, 8, scale=0.5), target, bias, entropy=True, temperature=0.8
    )


def test_huge_logits_and_fp16():
    # Logits in the thousands: logp and H are differences of numbers of order log V, never of the raw logits.
    assert check_op(
        "fused_linear_logprobs",
        randn(B, T, H, scale=300.0),
        randn(V, H, scale=H**-0.5),
        targets(),
        entropy=True,
        tol=1e-4,
    )
    hidden, weight = randn(B, T, H, dtype=torch.float16), randn(V, H, dtype=torch.float16, scale=2 * H**-0.5)
    assert check_op("fused_linear_logprobs", hidden, weight, targets(), entropy=True, chunk_tokens=8)


def test_a_near_certain_row_keeps_the_digits_of_its_entropy():
    """A logit 25 above the others: s = 1 + 5e-10, below fp32's resolution of 1, so a plain log s is 0 and the
    entropy (1.5e-8) would be 4% off; s kept as ties + rest gives it to fp32 precision (module docstring)."""
    bias = torch.zeros(V, device=runtime.DEVICE)
    bias[3] = 25.0
    target = targets((12,))
    target[::2] = 3
    assert check_op(
        "fused_linear_logprobs", randn(12, H, scale=0.1), randn(V, H, scale=0.1), target, bias, entropy=True
    )


def test_only_one_output_used_and_strided_hidden():
    """A loss of the entropy alone (logp's gradient is None in the backward) and of logp alone (no entropy term)."""
    hidden, weight, target = row_strided(randn(B * T, H)), randn(V, H, scale=0.5), targets((B * T,))
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    h64, w64 = (x.detach().double().requires_grad_() for x in (hidden, weight))
    for output in (0, 1):
        ours = liger_lab.fused_linear_logprobs(h, w, target, entropy=True, chunk_tokens=6)[output]
        theirs = reference.fused_linear_logprobs(h64, w64, target, entropy=True)[output]
        scale = torch.linspace(-1, 2, B * T, device=runtime.DEVICE)
        grads = torch.autograd.grad((ours * scale).sum(), [h, w])
        expected = torch.autograd.grad((theirs * scale.double()).sum(), [h64, w64])
        for got, exp in zip(grads, expected, strict=True):
            torch.testing.assert_close(got.double(), exp, rtol=1e-5, atol=1e-6)


def test_ignored_rows_are_zero_with_zero_gradient():
    hidden, weight = randn(B, T, H).requires_grad_(), randn(V, H).requires_grad_()
    target = torch.full((B, T), -100, device=runtime.DEVICE)
    target[0, 3] = 5
    logp, entropy = liger_lab.fused_linear_logprobs(hidden, weight, target, entropy=True)
    assert logp.dtype == entropy.dtype == torch.float32 and logp.shape == entropy.shape == (B, T)
    assert logp.count_nonzero() == 1 and entropy.count_nonzero() == 1
    (grad,) = torch.autograd.grad((logp + entropy).sum(), hidden)
    assert grad.count_nonzero(dim=-1).count_nonzero() == 1  # only the kept row's hidden state


def test_matches_trls_fused_head():
    """TRL 1.16's ChunkedLogProbFunction (the kernel behind add_fused_lm_head; torch ops on CPU) gives the same
    log-probabilities and entropies."""
    trl_kernels = pytest.importorskip("trl.kernels")
    hidden, weight, bias, target = randn(B * T, H), randn(V, H, scale=0.5), randn(V, scale=0.3), targets((B * T,))
    kept = target != -100
    theirs = trl_kernels.ChunkedLogProbFunction.apply(
        hidden[kept], weight, bias, target[kept], 0.7, 16, None, 1.0, ("entropy",)
    )
    ours = liger_lab.fused_linear_logprobs(hidden, weight, target, bias, temperature=0.7, entropy=True)
    for got, expected in zip(ours, theirs[:2], strict=True):
        torch.testing.assert_close(got[kept], expected, rtol=1e-5, atol=1e-5)


def test_no_tensor_holds_the_logits_of_every_token():
    n_tokens, vocab = 40, 300
    hidden, weight = randn(n_tokens, 8).requires_grad_(), randn(vocab, 8).requires_grad_()
    target = targets((n_tokens,), vocab)
    with LargestNewTensor() as mode:
        logp, entropy = liger_lab.fused_linear_logprobs(hidden, weight, target, entropy=True, chunk_tokens=8)
        torch.autograd.grad((logp - entropy).sum(), [hidden, weight])
    assert mode.largest <= max(8 * vocab, weight.numel(), hidden.numel()) < n_tokens * vocab


def test_operators_with_bias_and_entropy_pass_opcheck():
    """The table's row has no bias; this covers the bias and both outputs' gradients (the forward op carries its
    autograd formula, which opcheck checks too). test_schema runs in the table's opcheck: under its mode every
    aten call of the interpreted kernels is checked (seconds here), and the bias changes nothing it checks."""
    hidden, weight, bias = (t.requires_grad_() for t in (randn(9, H), randn(V, H), randn(V)))
    target = targets((9,))
    args = (hidden, weight, target, bias, 0.8, -100, [True, True, False, False], 3.0, 0.5, None, "fp32")
    tests = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.liger_lab.fused_linear_logprobs, args, test_utils=tests)
    _, entropy, lssp, _, _, stats = torch.ops.liger_lab.fused_linear_logprobs(*args)
    backward_args = (hidden.detach(), weight.detach(), target, bias.detach(), stats.detach(), entropy.detach(),
                     lssp.detach(), randn(9), randn(9), randn(9), 0.8, -100, 3.0, 0.5, None, "fp32",
                     [True, True, True])  # fmt: skip
    torch.library.opcheck(torch.ops.liger_lab.fused_linear_logprobs_backward, backward_args, test_utils=tests)


def test_compiled_with_dynamic_shapes_matches_eager():
    """One graph for every number of tokens (dynamic=True, fullgraph=True): no recompilation when N changes. (Compiles
    are counted, not backend calls: Dynamo may call the backend twice within one compile, see CompileCounter.)"""
    counter = CompileCounter("aot_eager")
    torch._dynamo.reset()

    def loss(h, w, t):
        logp, entropy = liger_lab.fused_linear_logprobs(h, w, t, temperature=0.9, entropy=True, chunk_tokens=8)
        return (logp * 2.0 + 0.1 * entropy).sum()

    compiled = torch.compile(loss, backend=counter, dynamic=True, fullgraph=True)
    weight = randn(V, H)
    for n_tokens in (9, 13):
        hidden, target = randn(n_tokens, H), targets((n_tokens,))
        results = []
        for fn in (loss, compiled):
            h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
            value = fn(h, w, target)
            results.append((value, *torch.autograd.grad(value, [h, w])))
        for got, expected in zip(*results, strict=True):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert len(counter.compiles) == 1, counter.compiles


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: {**a, "weight": a["weight"][:, :-1]}, "weight has shape"),
        (lambda a: {**a, "weight": a["weight"].half()}, "one dtype"),
        (lambda a: {**a, "hidden": a["hidden"].double()}, "dtype"),
        (lambda a: {**a, "bias": a["weight"][0]}, "bias has shape"),
        (lambda a: {**a, "target": a["target"][:, :-1]}, "target has shape"),
        (lambda a: {**a, "target": a["target"].float()}, "integer"),
        (lambda a: {**a, "target": a["target"].masked_fill(a["target"] == a["target"].max(), V)}, "out of range"),
        (lambda a: {**a, "temperature": 0.0}, "temperature"),
        (lambda a: {**a, "temperature": float("inf")}, "temperature"),
        (lambda a: {**a, "entropy": 1}, "entropy"),
        (lambda a: {**a, "outputs": ("entropy", "top1")}, "'top1'"),
        (lambda a: {**a, "outputs": "entropy"}, "a tuple of names"),
        (lambda a: {**a, "outputs": ("is_top1", "is_top1")}, "twice"),
        (lambda a: {**a, "entropy": True, "outputs": ("entropy",)}, "twice"),
        (lambda a: {**a, "softcap": 0.0}, "softcap"),
        (lambda a: {**a, "logit_scale": float("nan")}, "logit_scale"),
        (lambda a: {**a, "ignore_index": 0.5}, "ignore_index"),
        (lambda a: {**a, "chunk_tokens": 0}, "chunk_tokens"),
        (lambda a: {**a, "accumulation": "fp64"}, "accumulation"),
    ],
)
def test_bad_input_is_a_value_error(change, message):
    given = dict(hidden=randn(B, T, H), weight=randn(V, H), target=targets(), bias=randn(V))
    before = {k: v.clone() for k, v in given.items()}
    args = change(given)
    positional = [args.pop(k) for k in ("hidden", "weight", "target")]
    with pytest.raises(ValueError, match=message):
        liger_lab.fused_linear_logprobs(*positional, **args)
    assert all(torch.equal(given[k], before[k]) for k in given)


def test_a_target_out_of_range_on_the_gpu_path_gives_nan_outputs_and_gradients(monkeypatch):
    """The GPU's logic (no host read of the range check) on the interpreter's tensors: a bad target never yields
    plausible numbers, and no ignored row's zero gradient survives either."""
    monkeypatch.setattr(runtime, "HOST_READS_WAIT", True)
    hidden, weight, bias = (t.requires_grad_() for t in (randn(B, T, H), randn(V, H), randn(V)))
    target = targets()
    target[1, 2] = V
    outputs = liger_lab.fused_linear_logprobs(hidden, weight, target, bias, entropy=True, chunk_tokens=8)
    grads = torch.autograd.grad(outputs[0].sum() + outputs[1].sum(), [hidden, weight, bias])
    assert all(torch.isnan(t).all() for t in (*outputs, *grads))


def test_chunk_budget():
    rows = torch.empty(40_000, 1024, dtype=torch.bfloat16)  # 78 MiB of hidden gradient
    weight = torch.empty(128256, 1024, dtype=torch.bfloat16)
    assert logprobs.chunk_rows(rows, weight, 7, True) == 7
    # The budget less the hidden gradient's N x H bytes, in multiples of 64 rows.
    assert logprobs.chunk_rows(rows, weight, None, False) > logprobs.chunk_rows(rows, weight, None, True) >= 64


@pytest.mark.cuda
@pytest.mark.parametrize("entropy", [False, True])
def test_bf16_128k_vocabulary(entropy):
    hidden = randn(300, 256, dtype=torch.bfloat16)
    weight = randn(128256, 256, dtype=torch.bfloat16, scale=256**-0.5)
    assert check_op("fused_linear_logprobs", hidden, weight, targets((300,), 128256), entropy=entropy, chunk_tokens=128)


HEAD_OUTPUTS = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


def _head_call(fn, hidden, weight, target, bias, **options):
    outputs = fn(hidden, weight, target, bias, **options)
    return outputs if isinstance(outputs, tuple) else (outputs,)


@pytest.mark.parametrize(
    "options",
    [
        {"outputs": HEAD_OUTPUTS},
        {"outputs": ("is_top1", "log_sum_sq_probs"), "entropy": True, "softcap": 2.0, "logit_scale": 0.7},
        {"outputs": ("mean_logits", "log_sum_sq_probs"), "temperature": 1.3, "logit_scale": 3.0, "chunk_tokens": 5},
    ],
)
def test_every_output_and_its_gradients_match_float64(options):
    """logp, entropy and log_sum_sq_probs with their gradients (random upstream gradients on each), mean_logits and
    is_top1 (targets that are their row's argmax half of the time) against float64, in the order asked for."""
    hidden, weight, bias = randn(B * T, H), randn(V, H, scale=2 * H**-0.5), randn(V, scale=0.5)
    reference_options = {k: v for k, v in options.items() if k != "chunk_tokens"}
    z = reference.head_logits(torch.nn.functional.linear(hidden, weight, bias), **{
        k: v for k, v in options.items() if k in ("temperature", "softcap", "logit_scale")})  # fmt: skip
    target = targets((B * T,))
    target[1::2] = z.argmax(-1)[1::2]
    leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    exact = [t.double().requires_grad_() for t in (hidden, weight, bias)]
    ours = _head_call(liger_lab.fused_linear_logprobs, *leaves[:2], target, leaves[2], **options)
    theirs = _head_call(reference.fused_linear_logprobs, *exact[:2], target, exact[2], **reference_options)
    names = (("entropy",) if options.get("entropy") else ()) + options["outputs"]
    assert len(ours) == 1 + len(names)
    upstream = [randn(B * T) for _ in ours]
    differentiable = [i for i, name in enumerate(("logp", *names)) if name not in ("mean_logits", "is_top1")]
    for i, (got, expected) in enumerate(zip(ours, theirs, strict=True)):
        if got.dtype == torch.bool:
            assert torch.equal(got, expected) and got.sum() >= 3
        else:
            assert got.dtype == torch.float32 and got.shape == target.shape
            torch.testing.assert_close(got.double(), expected.detach(), rtol=1e-5, atol=1e-5)
            assert got.requires_grad == (i in differentiable)
    grads = torch.autograd.grad(sum((ours[i] * upstream[i]).sum() for i in differentiable), leaves)
    exact_grads = torch.autograd.grad(sum((theirs[i] * upstream[i].double()).sum() for i in differentiable), exact)
    for got, expected in zip(grads, exact_grads, strict=True):
        torch.testing.assert_close(got.double(), expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_tiles_that_split_the_vocabulary(monkeypatch, dtype):
    """A budget of a few KiB: the backward runs over tiles of 8 tokens by 256 of the 300 columns (the last tile 44
    wide), so dW is summed over token tiles, dh over column tiles (bf16: in an fp32 accumulator), and most targets
    lie outside most tiles."""
    vocab, n_rows = 300, 21
    hidden, weight = randn(n_rows, H, dtype=dtype), randn(vocab, H, dtype=dtype, scale=2 * H**-0.5)
    size = hidden.element_size()  # dh, its fp32 accumulator and the tile: just 256 columns
    monkeypatch.setattr(
        fused_linear_cross_entropy, "CHUNK_BUDGET_BYTES", size * n_rows * H + 4 * 8 * H + 8 * 256 * size
    )
    assert logprobs.backward_tiles(hidden, weight, 8, True) == (8, 256)
    target = targets((n_rows,), vocab)
    assert check_op("fused_linear_logprobs", hidden, weight, target, randn(vocab, dtype=dtype, scale=0.5),
                    chunk_tokens=8, outputs=("log_sum_sq_probs", "entropy"), softcap=3.0, logit_scale=0.8)  # fmt: skip


def test_is_top1_counts_the_first_of_tied_maxima_only_as_trl_does():
    weight = randn(V, H)
    weight[7] = weight[3]  # columns 3 and 7 tie in every row
    hidden = randn(2, H)
    target = torch.tensor([3, 7], device=runtime.DEVICE)
    weight[3] += hidden.sum(0) * 10  # make the tied pair the maximum of both rows
    weight[7] = weight[3]
    (_, top1) = liger_lab.fused_linear_logprobs(hidden, weight, target, outputs=("is_top1",))
    assert top1.tolist() == [True, False]


def test_every_output_matches_trls_fused_head_with_a_soft_cap():
    trl_kernels = pytest.importorskip("trl.kernels")
    hidden, weight, bias = randn(B * T, H), randn(V, H, scale=0.5), randn(V, scale=0.3)
    target = torch.randint(0, V, (B * T,), device=runtime.DEVICE)
    target[::2] = torch.nn.functional.linear(hidden, weight, bias).argmax(-1)[::2]
    theirs = trl_kernels.ChunkedLogProbFunction.apply(hidden, weight, bias, target, 0.7, 16, 3.0, 0.5, HEAD_OUTPUTS)
    ours = liger_lab.fused_linear_logprobs(
        hidden, weight, target, bias, temperature=0.7, outputs=HEAD_OUTPUTS, softcap=3.0, logit_scale=0.5
    )
    for got, expected in zip(ours, theirs, strict=True):
        if got.dtype == torch.bool:
            assert torch.equal(got, expected)
        else:
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
