"""DPO, ORPO and SimPO on the fused linear head, against float64 references (themselves checked against an
independent transcription of TRL's formulas, and in tests/test_kto_cpo.py against TRL 1.16's own code): DPO's loss
types and precomputed reference, ORPO's NLL positions, and the sequence scores returned for the metrics."""

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import LargestNewTensor, OpCalls, check_op, randn, row_strided

import liger_lab
from liger_lab import formulas, reference, runtime
from liger_lab.nn import FusedLinearDPOLoss, FusedLinearORPOLoss, FusedLinearSimPOLoss
from liger_lab.ops import operators, preference
from liger_lab.workbook.checks import check_against_reference

B, T, H, V = 3, 7, 16, 1000
LOSSES = ("dpo", "orpo", "simpo")


def targets(n_pairs=B, seq_len=T, vocab=V, prompt=2, empty=(), ignore_index=-100):
    """(2B, T) targets: the first ``prompt`` positions of each sequence ignored, ragged padding at the end of
    every third sequence, and the sequences listed in ``empty`` ignored entirely."""
    t = torch.randint(0, vocab, (2 * n_pairs, seq_len), device=runtime.DEVICE)
    t[:, :prompt] = ignore_index
    t[::3, seq_len - 1 :] = ignore_index
    for row in empty:
        t[row] = ignore_index
    return t


def inputs(loss, n_pairs=B, seq_len=T, hidden=H, vocab=V, dtype=torch.float32, scale=1.0, ref_hidden=None, **kw):
    """Positional inputs of ``liger_lab.fused_linear_<loss>`` (DPO: a reference head of another hidden size)."""
    made = [
        randn(2 * n_pairs, seq_len, hidden, dtype=dtype, scale=scale),
        randn(vocab, hidden, dtype=dtype, scale=hidden**-0.5),
        targets(n_pairs, seq_len, vocab, **kw),
    ]
    if loss == "dpo":
        ref_hidden = ref_hidden or hidden + 4
        made += [
            randn(2 * n_pairs, seq_len, ref_hidden, dtype=dtype, scale=scale),
            randn(vocab, ref_hidden, dtype=dtype, scale=ref_hidden**-0.5),
        ]
    return made


def ours(loss):
    return getattr(liger_lab, f"fused_linear_{loss}")


def theirs(loss):
    return getattr(reference, f"fused_linear_{loss}")


# --------------------------------------------------------------------------------------------------
# Against float64


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize(
    "n_pairs, chunk_pairs, empty",
    [
        (3, 2, (1,)),  # chunks of 2 and 1 pairs; the chosen sequence of pair 1 has no kept position
        (3, None, (4,)),  # one chunk (from the byte budget); a rejected sequence with none kept
        (1, None, ()),  # one pair: pair order is the caller's order, no gather
        (3, 1, (0, 1, 2)),  # every chosen sequence empty: ORPO's NLL has no token to average
    ],
)
def test_matches_float64(loss, n_pairs, chunk_pairs, empty):
    assert check_op(f"fused_linear_{loss}", *inputs(loss, n_pairs, empty=empty), chunk_pairs=chunk_pairs)


@pytest.mark.parametrize(
    "loss, options",
    [
        ("dpo", {"beta": 0.0}),
        ("dpo", {"beta": 1e-4}),
        ("dpo", {"beta": 20.0}),
        ("orpo", {"beta": 0.0}),
        ("orpo", {"beta": 1e-4}),
        ("orpo", {"beta": 20.0}),
        ("simpo", {"beta": 0.0, "gamma": 0.5}),
        ("simpo", {"beta": 1e-4, "gamma": 0.0}),
        ("simpo", {"beta": 30.0, "gamma": -1.0}),
        ("simpo", {"beta": 2.0, "gamma": 10.0}),
        ("dpo", {"ignore_index": 3}),
    ],
)
def test_parameter_edge_values(loss, options):
    tensors = inputs(loss, empty=(2,), ignore_index=options.get("ignore_index", -100))
    # The loss depends on beta * logp: its relative error grows with beta times the fp32 error of a logp.
    tol = 1e-5 * max(1.0, options.get("beta", 0.0))
    assert check_op(f"fused_linear_{loss}", *tensors, tol=tol, chunk_pairs=2, **options)


@pytest.mark.parametrize("loss", LOSSES)
def test_vocabulary_larger_than_one_block_odd_sizes(loss):
    # 16411 columns: more than one 16384-column block in the interpreter; T = 5, H = 24 (powers of 2 nowhere).
    assert check_op(f"fused_linear_{loss}", *inputs(loss, n_pairs=1, seq_len=5, hidden=24, vocab=16411, prompt=1))


@pytest.mark.parametrize("loss", LOSSES)
def test_huge_logits(loss):
    # Logits in the thousands: log-softmax saturates (kept targets are near-certain or hopeless), the margins
    # of the pair losses are in the thousands and ORPO's avg of a saturated sequence reaches its cap.
    # Pair 1 is pair 0 with chosen and rejected swapped: one of the two margins is hugely negative, so the loss
    # is large (a loss of exp(-1000), which float32 cannot hold, would say nothing about the kernels).
    tensors = inputs(loss, scale=300.0)
    for i, t in enumerate(tensors):
        if t.dim() == 3 or i == 2:
            t[[1, B + 1]] = t[[B, 0]]
    # Logits of a few hundred carry an fp32 matmul error of about 1e-4 (the float64 reference has none), which
    # the saturated softmax and beta times the margins pass on: a looser tolerance than fp32's 1e-5.
    assert check_op(f"fused_linear_{loss}", *tensors, tol=3e-4, chunk_pairs=2)


@pytest.mark.parametrize("loss", LOSSES)
def test_fp16(loss):
    assert check_op(f"fused_linear_{loss}", *inputs(loss, dtype=torch.float16, empty=(3,)), chunk_pairs=2)


@pytest.mark.parametrize("loss", LOSSES)
def test_strided_inputs_and_upstream_gradient(loss):
    tensors = inputs(loss)
    tensors[0] = row_strided(tensors[0])
    hidden, weight = (t.detach().clone().requires_grad_() for t in tensors[:2])
    (3.0 * ours(loss)(hidden, weight, *tensors[2:])).backward()
    assert check_op(f"fused_linear_{loss}", *tensors, chunk_pairs=2)
    hidden64, weight64 = (t.detach().double().requires_grad_() for t in tensors[:2])
    rest = [t.double() if t.is_floating_point() else t for t in tensors[2:]]
    (3.0 * theirs(loss)(hidden64, weight64, *rest)).backward()
    torch.testing.assert_close(hidden.grad.double(), hidden64.grad, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(weight.grad.double(), weight64.grad, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("loss", LOSSES)
def test_no_positions_at_all(loss):
    """T = 0: every sequence scores logp = avg = 0, the loss is the pair loss at 0 and no gradient flows."""
    tensors = [t.requires_grad_() if t.is_floating_point() else t for t in inputs(loss, seq_len=0)]
    got = ours(loss)(*tensors)
    expected = theirs(loss)(*tensors)
    assert got.dtype == torch.float32 and torch.allclose(got.double(), expected.double())
    at_zero = {"dpo": math.log(2), "orpo": 0.1 * math.log(2), "simpo": math.log1p(math.exp(0.5))}[loss]
    assert math.isclose(got.item(), at_zero, rel_tol=1e-6)
    grads = torch.autograd.grad(got, tensors[:2])
    assert all(g.shape == t.shape and not g.any() for g, t in zip(grads, tensors[:2], strict=True))


@pytest.mark.parametrize(
    "loss_type, label_smoothing, empty",
    [("hinge", 0.0, (1,)), ("ipo", 0.0, (4,)), ("robust", 0.0, ()), ("robust", 0.3, (0, 3))],
)
def test_dpo_loss_types_match_float64(loss_type, label_smoothing, empty):
    tensors = inputs("dpo", empty=empty)
    assert check_op("fused_linear_dpo", *tensors, loss_type=loss_type, label_smoothing=label_smoothing, chunk_pairs=2)


def _reference_logps(ref_hidden, ref_weight, target):
    """The reference head's per-sequence logp, as ``precompute_ref_log_probs`` would have stored it (fp32)."""
    return reference.sequence_logps(ref_hidden.double(), ref_weight.double(), target)[0].float()


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_dpo_precomputed_reference_logps(loss_type):
    hidden, weight, target, ref_hidden, ref_weight = inputs("dpo", empty=(4,))
    ref_logps = _reference_logps(ref_hidden, ref_weight, target)
    assert check_against_reference(
        "fused_linear_dpo",
        lambda h, w, r: liger_lab.fused_linear_dpo(h, w, target, ref_logps=r, loss_type=loss_type, chunk_pairs=2),
        lambda h, w, r: reference.fused_linear_dpo(h, w, target, ref_logps=r, loss_type=loss_type),
        [hidden, weight, ref_logps],
        input_names=["hidden", "weight", "ref_logps"],
    )
    # The same loss as from the reference head; no gradient reaches the given log-probabilities.
    hidden.requires_grad_()
    ref_logps.requires_grad_()
    given = liger_lab.fused_linear_dpo(hidden, weight, target, ref_logps=ref_logps, loss_type=loss_type)
    from_head = liger_lab.fused_linear_dpo(hidden, weight, target, ref_hidden, ref_weight, loss_type=loss_type)
    torch.testing.assert_close(given, from_head, rtol=1e-5, atol=1e-6)
    given.backward()
    assert ref_logps.grad is None and hidden.grad is not None


def nll_targets(target, n_pairs=B, vocab=V, prompt=2):
    """ORPO's NLL targets as TRL's ORPOTrainer takes them: the chosen rows' targets with the prompt's positions
    kept too (tokens of their own), padding still ignored."""
    nll = target[:n_pairs].clone()
    nll[:, :prompt] = torch.randint(0, vocab, (n_pairs, prompt), device=target.device)
    return nll


@pytest.mark.parametrize("chunk_pairs, empty", [(2, ()), (1, (1,)), (None, (0, 1, 2))])
def test_orpo_nll_over_more_positions_than_the_odds(chunk_pairs, empty):
    tensors = inputs("orpo", empty=empty)
    nll_target = nll_targets(tensors[2])
    assert check_op("fused_linear_orpo", *tensors, nll_target=nll_target, chunk_pairs=chunk_pairs)
    # nll_target equal to the chosen rows' targets is the default NLL.
    with torch.no_grad():
        same = liger_lab.fused_linear_orpo(*tensors, nll_target=tensors[2][:B].clone())
        torch.testing.assert_close(same, liger_lab.fused_linear_orpo(*tensors), rtol=1e-6, atol=1e-7)


def test_orpo_nll_target_disagreeing_with_target():
    """A position both keep must name one token: a ValueError where the check is free, NaN loss and gradients on the
    GPU's path (which reads nothing back)."""
    hidden, weight, target = inputs("orpo")
    nll_target = nll_targets(target)
    nll_target[1, 4] = (target[1, 4] + 1) % V
    with pytest.raises(ValueError, match="differs from target at 1 position"):
        liger_lab.fused_linear_orpo(hidden, weight, target, nll_target=nll_target)
    leaf = hidden.requires_grad_()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(runtime, "HOST_READS_WAIT", True)
        loss = liger_lab.fused_linear_orpo(leaf, weight, target, nll_target=nll_target)
        loss.backward()
    assert torch.isnan(loss) and torch.isnan(leaf.grad).all()


@pytest.mark.parametrize("loss", LOSSES)
def test_return_logps_gives_the_trainers_sequence_scores(loss):
    """(loss, chosen_logps, rejected_logps[, ref_chosen, ref_rejected]): the summed log-probabilities for DPO, the
    means for ORPO and SimPO (what each TRL trainer logs), float32, not differentiable; the loss is unchanged."""
    tensors = inputs(loss, empty=(1,))
    hidden, weight = (t.requires_grad_() for t in tensors[:2])
    loss_value, *logps = ours(loss)(*tensors, return_logps=True, chunk_pairs=2)
    assert torch.equal(loss_value, ours(loss)(*tensors, chunk_pairs=2))
    assert len(logps) == (4 if loss == "dpo" else 2)
    assert all(t.shape == (B,) and t.dtype == torch.float32 and not t.requires_grad for t in logps)
    logp, count = reference.sequence_logps(hidden.detach().double(), weight.detach().double(), tensors[2])
    expected = logp if loss == "dpo" else logp / count.clamp(min=1)
    torch.testing.assert_close(torch.cat(logps[:2]).double(), expected, rtol=1e-5, atol=1e-5)
    if loss == "dpo":
        expected_ref = _reference_logps(*tensors[3:], tensors[2]).double()
        torch.testing.assert_close(torch.cat(logps[2:]).double(), expected_ref, rtol=1e-5, atol=1e-5)
    loss_value.backward()
    assert hidden.grad is not None and weight.grad is not None


@pytest.mark.parametrize("n_pairs", [3, 1])
def test_token_outputs_come_from_the_loss_s_own_pass(n_pairs):
    """The per-token values a TRL trainer logs (``token_outputs``), in the caller's row order whether the pairs are
    gathered into pair order (3 pairs, chunks of 2) or not (1 pair): fused_linear_logprobs' values on the same head,
    without gradient. The loss, the scores and the gradients are the default call's to rounding (the tokens are
    then scored by the RL head's kernels), and the operator passes opcheck with its per-token outputs."""
    tensors = inputs("dpo", n_pairs=n_pairs, empty=(1,) if n_pairs > 1 else ())
    hidden, weight, target = tensors[:3]
    hidden.requires_grad_(), weight.requires_grad_()
    names = ("is_top1", "log_probs", "mean_logits", "entropy", "log_sum_sq_probs")
    with OpCalls(keep_args=True) as calls:
        loss, *results = ours("dpo")(*tensors, return_logps=True, chunk_pairs=2, token_outputs=names)
    expected_loss, *expected_scores = ours("dpo")(*tensors, return_logps=True, chunk_pairs=2)
    grads, expected_grads = (torch.autograd.grad(value, (hidden, weight)) for value in (loss, expected_loss))
    for mine, expected in zip((loss, *results[:4], *grads), (expected_loss, *expected_scores, *expected_grads),
                              strict=True):  # fmt: skip
        torch.testing.assert_close(mine, expected, rtol=1e-5, atol=1e-6)
    others = (*names[2:], "is_top1")
    logp, *extras = liger_lab.fused_linear_logprobs(hidden.detach(), weight.detach(), target, outputs=others)
    head = {"log_probs": logp, **dict(zip(others, extras, strict=True))}
    for name, values in zip(names, results[4:], strict=True):
        assert values.shape == target.shape and not values.requires_grad, name
        torch.testing.assert_close(values, head[name], rtol=0, atol=0)
    if n_pairs == 1:  # the schema and the fake do not depend on the rows' order: one opcheck is enough
        (call,) = [call for call in calls.recorded if call.name == "fused_linear_preference"]
        torch.library.opcheck(call.op, call.args, call.kwargs)


# --------------------------------------------------------------------------------------------------
# The references against TRL's definitions (an independent transcription, float64, no empty sequence).


def _trl_logps(logits, labels, average):
    """TRL's batch log-probabilities of already-shifted labels: sum (or mean) over non-ignored positions."""
    mask = labels != -100
    labels = labels.masked_fill(~mask, 0)
    per_token = torch.gather(logits.log_softmax(-1), 2, labels.unsqueeze(2)).squeeze(2)
    total = (per_token * mask).sum(-1)
    return total / mask.sum(-1) if average else total


def _trl_loss(loss, hidden, weight, labels, ref_hidden=None, ref_weight=None, beta=0.1, gamma=0.5):
    logits = hidden @ weight.T
    n = hidden.shape[0] // 2
    if loss == "dpo":  # DPOTrainer, loss_type="sigmoid", no label smoothing
        policy = _trl_logps(logits, labels, average=False)
        ref = _trl_logps(ref_hidden @ ref_weight.T, labels, average=False)
        pi_logratios = policy[:n] - policy[n:]
        ref_logratios = ref[:n] - ref[n:]
        return (-F.logsigmoid(beta * (pi_logratios - ref_logratios))).mean()
    avg = _trl_logps(logits, labels, average=True)
    chosen, rejected = avg[:n], avg[n:]
    if loss == "orpo":  # ORPOTrainer: odds ratio term plus the chosen responses' cross-entropy
        log_odds = (chosen - rejected) - (torch.log1p(-torch.exp(chosen)) - torch.log1p(-torch.exp(rejected)))
        nll = F.cross_entropy(logits[:n].flatten(0, 1), labels[:n].flatten(), ignore_index=-100)
        return nll - (beta * F.logsigmoid(log_odds)).mean()
    # CPOTrainer with loss_type="simpo" and cpo_alpha=0: the margin enters as gamma / beta inside the logits
    logits_diff = (chosen - rejected) - gamma / beta
    return (-F.logsigmoid(beta * logits_diff)).mean()


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("beta, gamma", [(0.1, 0.5), (2.5, 1.0), (0.01, 0.0)])
def test_reference_matches_trl_definitions(loss, beta, gamma):
    generator = torch.Generator().manual_seed(7)
    hidden = torch.randn(2 * B, T, H, dtype=torch.float64, generator=generator).requires_grad_()
    weight = torch.randn(V, H, dtype=torch.float64, generator=generator).requires_grad_()
    labels = torch.randint(0, V, (2 * B, T), generator=generator)
    labels[:, :2] = -100
    labels[1, 5:] = -100
    ref_h, ref_w = torch.randn(2 * B, T, 9, dtype=torch.float64), torch.randn(V, 9, dtype=torch.float64)
    kwargs = {"beta": beta} | ({"gamma": gamma} if loss == "simpo" else {})
    refs = (ref_h, ref_w) if loss == "dpo" else ()
    ours_ = theirs(loss)(hidden, weight, labels, *refs, **kwargs)
    trl = _trl_loss(loss, hidden, weight, labels, *refs, beta=beta, gamma=gamma)
    torch.testing.assert_close(ours_, trl, rtol=1e-12, atol=1e-12)
    for a, b in zip(
        torch.autograd.grad(ours_, [hidden, weight]), torch.autograd.grad(trl, [hidden, weight]), strict=True
    ):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_reference_empty_sequence_and_orpo_cap():
    """A sequence with no kept position scores logp = avg = 0; ORPO's odds are then taken at the cap."""
    hidden = torch.randn(2, 3, 4, dtype=torch.float64)
    weight = torch.randn(11, 4, dtype=torch.float64)
    target = torch.tensor([[-100, -100, -100], [-100, 2, 5]])
    logp, count = reference.sequence_logps(hidden, weight, target)
    assert logp[0] == 0 and count.tolist() == [0, 2]
    odds = lambda a: a - math.log(-math.expm1(a))  # noqa: E731
    expected = -0.1 * F.logsigmoid(torch.tensor(odds(reference.ORPO_MAX_AVG_LOGP) - odds(logp[1].item() / 2)))
    torch.testing.assert_close(reference.fused_linear_orpo(hidden, weight, target), expected.double())
    assert reference.ORPO_MAX_AVG_LOGP is preference.ORPO_MAX_AVG_LOGP is formulas.ORPO_MAX_AVG_LOGP  # stated once


# --------------------------------------------------------------------------------------------------
# Behaviour


@pytest.mark.parametrize("loss", LOSSES)
def test_caller_tensors_unmodified_and_float32_scalar(loss):
    tensors = [t.requires_grad_() if i < 2 else t for i, t in enumerate(inputs(loss, dtype=torch.float16))]
    before = [t.detach().clone() for t in tensors]
    out = ours(loss)(*tensors, chunk_pairs=2)
    out.backward()
    assert out.dtype == torch.float32 and out.shape == ()
    for t, b in zip(tensors, before, strict=True):
        assert torch.equal(t.detach(), b)
    if loss == "dpo":
        assert tensors[3].grad is None and tensors[4].grad is None


@pytest.mark.parametrize("loss", LOSSES)
def test_without_grad_and_modules(loss):
    tensors = inputs(loss)
    with torch.no_grad():
        plain = ours(loss)(*tensors)
    module = {"dpo": FusedLinearDPOLoss, "orpo": FusedLinearORPOLoss, "simpo": FusedLinearSimPOLoss}[loss]()
    hidden, weight, target, *refs = tensors
    assert torch.equal(module(weight, hidden, target, *refs), plain)
    assert "beta" in repr(module)


@pytest.mark.parametrize("loss", LOSSES)
def test_no_tensor_holds_the_logits_of_every_pair(loss):
    """Policy and reference logits exist one chunk of pairs at a time: nothing the op allocates is bigger
    than one chunk of logits, dW or dh."""
    n_pairs, seq_len, vocab = 5, 6, 300
    hidden, weight, target, *refs = inputs(loss, n_pairs=n_pairs, seq_len=seq_len, hidden=8, vocab=vocab)
    refs = refs or [None, None]
    options = formulas.PreferenceOptions(loss, beta=0.1, gamma=0.5, nll_weight=float(loss == "orpo"))
    args = (hidden, weight, target, *refs, None, None, None, None, *options.arguments(), -100, 2, False, [False] * 4,
            "fp32", [True, True, False])  # fmt: skip
    outputs = operators.allocate_outputs(preference._forward, preference.FUSED_LINEAR_PREFERENCE_OUTPUTS, args)
    with LargestNewTensor() as mode:  # the operator's work itself (a mode sees an operator's call, not inside it)
        preference._forward(*args, *outputs)
    chunk_logits = 2 * 2 * seq_len * vocab  # two pairs per chunk
    assert mode.largest <= max(chunk_logits, weight.numel(), hidden.numel()) < 2 * n_pairs * seq_len * vocab


def test_pairs_per_chunk_follow_the_byte_budget():
    per_pair = 2 * 1024 * 128256 * 2
    assert preference.chunk_pairs_for(4, 1024, 128256, torch.bfloat16) == 1  # one pair exceeds the budget
    assert preference.chunk_pairs_for(8, 1024, 128256, torch.bfloat16, budget=3 * per_pair + 1) == 3
    assert preference.chunk_pairs_for(2, 1024, 128256, torch.bfloat16, budget=3 * per_pair) == 2
    assert preference.chunk_pairs_for(0, 0, 10, torch.float32) == 1


def _zeros(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype, device=runtime.DEVICE)


@pytest.mark.parametrize(
    "loss, make, options, message",
    [
        ("orpo", lambda h, w, t: (h[:5], w, t[:5]), {}, "even"),
        ("simpo", lambda h, w, t: (h[0], w, t[0]), {}, r"\(2B, T, H\)"),
        ("simpo", lambda h, w, t: (h, w[:, :-1], t), {}, "weight has shape"),
        ("orpo", lambda h, w, t: (h, w.half(), t), {}, "one dtype"),
        ("orpo", lambda h, w, t: (h.double(), w.double(), t), {}, "dtype"),
        ("simpo", lambda h, w, t: (h, w, t[:, :-1]), {}, "target has shape"),
        ("simpo", lambda h, w, t: (h, w, t.float()), {}, "integer"),
        ("orpo", lambda h, w, t: (h, w, t.masked_fill(t == t.max(), V)), {}, "out of range"),
        ("simpo", lambda h, w, t: (h, w, t), {"beta": -1.0}, "beta"),
        ("simpo", lambda h, w, t: (h, w, t), {"beta": float("nan")}, "beta"),
        ("simpo", lambda h, w, t: (h, w, t), {"gamma": float("inf")}, "gamma"),
        ("orpo", lambda h, w, t: (h, w, t), {"ignore_index": 0.5}, "ignore_index"),
        ("orpo", lambda h, w, t: (h, w, t), {"chunk_pairs": 0}, "chunk_pairs"),
        ("orpo", lambda h, w, t: (h, w, t), {"accumulation": "fp64"}, "accumulation"),
        ("dpo", lambda h, w, t, rh, rw: (h, w, t, rh[:, :-1], rw), {}, "ref_hidden has shape"),
        ("dpo", lambda h, w, t, rh, rw: (h, w, t, rh, rw[:-1]), {}, "vocabulary"),
        ("dpo", lambda h, w, t, rh, rw: (h, w, t, rh, rw[:, :-1]), {}, "ref_weight has shape"),
        ("dpo", lambda h, w, t, rh, rw: (h, w, t, rh.half(), rw), {}, "one dtype"),
        ("dpo", lambda h, w, t, rh, rw: (h, w, t), {}, "needs a reference model"),
        ("dpo", lambda h, w, t, rh, rw: (h, w, t, rh), {}, "needs a reference model"),
        ("dpo", lambda h, w, t, rh, rw: (h, w, t, rh, rw), {"ref_logps": _zeros(2 * B)}, "not both"),
        ("dpo", lambda h, w, t, rh, rw: (h, w, t), {"ref_logps": _zeros(B)}, "ref_logps has shape"),
        ("dpo", lambda h, w, t, rh, rw: (h, w, t), {"ref_logps": _zeros(2 * B, dtype=torch.long)}, "floating"),
        ("dpo", lambda h, w, t, rh, rw: (h, w, t, rh, rw), {"loss_type": "exo_pair"}, "loss_type"),
        ("dpo", lambda h, w, t, rh, rw: (h, w, t, rh, rw), {"label_smoothing": 0.1}, "takes none"),
        ("dpo", lambda h, w, t, rh, rw: (h, w, t, rh, rw), {"loss_type": "robust", "label_smoothing": 0.5}, "it in"),
        ("dpo", lambda h, w, t, rh, rw: (h, w, t, rh, rw), {"loss_type": "robust", "label_smoothing": -0.1}, ">= 0"),
        ("dpo", lambda h, w, t, rh, rw: (h, w, t, rh, rw), {"loss_type": "ipo", "beta": 0.0}, "beta > 0"),
        ("orpo", lambda h, w, t: (h, w, t), {"nll_target": _zeros(B, T + 1, dtype=torch.long)}, "nll_target has"),
        ("orpo", lambda h, w, t: (h, w, t), {"nll_target": _zeros(B, T)}, "nll_target has dtype"),
        ("orpo", lambda h, w, t: (h, w, t), {"nll_target": _zeros(B, T, dtype=torch.long) + V}, "out of range"),
        ("simpo", lambda h, w, t: (h, w, t), {"token_outputs": ("logits",)}, "token_outputs names 'logits'"),
        ("simpo", lambda h, w, t: (h, w, t), {"token_outputs": "entropy"}, "expected a tuple"),
    ],
)
def test_bad_input_is_a_value_error(loss, make, options, message):
    tensors = inputs(loss)
    before = [t.clone() for t in tensors]
    with pytest.raises(ValueError, match=message):
        ours(loss)(*make(*tensors), **options)
    assert all(torch.equal(t, b) for t, b in zip(tensors, before, strict=True))


# --------------------------------------------------------------------------------------------------
# GPU


@pytest.mark.cuda
@pytest.mark.parametrize("loss", LOSSES)
def test_bf16_128k_vocabulary(loss):
    tensors = inputs(loss, n_pairs=3, seq_len=100, hidden=256, vocab=128256, dtype=torch.bfloat16, prompt=30,
                     empty=(4,))  # fmt: skip
    assert check_op(f"fused_linear_{loss}", *tensors, chunk_pairs=2)


@pytest.mark.cuda
@pytest.mark.parametrize("loss", LOSSES)
def test_bf16_default_chunks(loss):
    # DPO's margin sums bf16-rounded logits over whole sequences: a few hundred positions keep that sum's
    # rounding (about 2e-3 per position, times beta) inside bf16's tolerance.
    tensors = inputs(loss, n_pairs=3, seq_len=300, hidden=512, vocab=50257, dtype=torch.bfloat16, prompt=60)
    assert check_op(f"fused_linear_{loss}", *tensors)


@pytest.mark.cuda
def test_dpo_peak_memory_at_the_design_shape():
    """4 pairs x 1024 positions, H = 4096, V = 128256, bf16, with the reference head: below Liger-Kernel's
    measured peak (2602 MiB above the inputs, issue 13)."""
    hidden, weight, target, ref_hidden, ref_weight = inputs(
        "dpo", n_pairs=4, seq_len=1024, hidden=4096, vocab=128256, dtype=torch.bfloat16, prompt=256, ref_hidden=4096
    )
    hidden.requires_grad_()
    weight.requires_grad_()

    def step():
        loss = liger_lab.fused_linear_dpo(hidden, weight, target, ref_hidden, ref_weight)
        torch.autograd.grad(loss, [hidden, weight])

    step()
    peak = runtime.peak_memory_bytes(step)
    assert peak <= 2602 * 2**20, f"peak {peak / 2**20:.0f} MiB above the inputs"
