"""KTO and CPO on the fused linear head (TRL 1.16's KTOTrainer and CPOTrainer), against float64 references; every
preference reference against TRL 1.16's own loss code; and ``num_items_in_batch`` on the distillation losses."""

from __future__ import annotations

import functools
import importlib
import warnings
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from helpers import check_op, randn
from test_host_sync import HostReads

import liger_lab
from liger_lab import reference, runtime
from liger_lab.ops import preference

B, T, H, V = 3, 7, 16, 500
N = 6
"""KTO's completions per batch."""


def targets(n, seq_len=T, vocab=V, prompt=2, empty=()):
    """(n, T) targets: the first ``prompt`` positions ignored, ragged padding at the end of every third sequence, the
    sequences listed in ``empty`` ignored entirely."""
    t = torch.randint(0, vocab, (n, seq_len), device=runtime.DEVICE)
    t[:, :prompt] = -100
    t[::3, seq_len - 1 :] = -100
    for row in empty:
        t[row] = -100
    return t


def head(n, seq_len=T, hidden=H, vocab=V, dtype=torch.float32):
    return [randn(n, seq_len, hidden, dtype=dtype), randn(vocab, hidden, dtype=dtype, scale=hidden**-0.5)]


def labels(*flags):
    return torch.tensor(flags or (True, False, True, True, False, False), device=runtime.DEVICE)


def kto_inputs(n=N, seq_len=T, dtype=torch.float32, empty=(), label=None):
    """hidden, weight, target, label, ref_hidden, ref_weight (a reference of another hidden size)."""
    policy, ref = head(n, seq_len, dtype=dtype), head(n, seq_len, hidden=H + 4, dtype=dtype)
    return [*policy, targets(n, seq_len, empty=empty), labels() if label is None else label, *ref]


def kl_options(kind, n=N):
    """The KL estimate as a number, a tensor, the KL completions' log-probabilities, or none."""
    if kind == "number":
        return {"kl": 0.7}
    if kind == "tensor":
        return {"kl": torch.tensor([1.3], device=runtime.DEVICE)}
    if kind == "logps":
        return {"kl_logps": randn(n) - 20, "ref_kl_logps": randn(n) - 21}
    return {}


def check_kto(tensors, ref_source="head", tol=None, **options):
    """The op table's float64 check; ``ref_source="logps"``: the reference's log-probabilities given instead of its
    head."""
    hidden, weight, target, label, ref_hidden, ref_weight = tensors
    if ref_source == "logps":
        ref_logps = reference.sequence_logps(ref_hidden.double(), ref_weight.double(), target)[0].float()
        return check_op("fused_linear_kto", hidden, weight, target, label, None, None, ref_logps=ref_logps, tol=tol,
                        **options)  # fmt: skip
    return check_op("fused_linear_kto", *tensors, tol=tol, **options)


def check_cpo(tensors, tol=None, **options):
    return check_op("fused_linear_cpo", *tensors, tol=tol, **options)


# --------------------------------------------------------------------------------------------------
# KTO against float64


@pytest.mark.parametrize(
    "loss_type, ref_source, kl, chunk, empty, weights",
    [
        ("kto", "head", "logps", 4, (1,), (1.0, 1.0)),  # chunks of 4 and 2 completions; a desirable one empty
        ("kto", "logps", "number", None, (4,), (1.33, 0.7)),  # one chunk; an undesirable one empty
        ("kto", "head", "tensor", 1, (), (0.0, 2.0)),
        ("kto", "head", None, 5, (0, 4), (1.0, 1.0)),  # no estimate: z0 = 0
        ("apo_zero_unpaired", "head", "number", 4, (2,), (1.0, 1.5)),  # the estimate is ignored
        ("apo_zero_unpaired", "logps", None, None, (), (1.0, 1.0)),
    ],
)
def test_kto_matches_float64(loss_type, ref_source, kl, chunk, empty, weights):
    options = dict(loss_type=loss_type, desirable_weight=weights[0], undesirable_weight=weights[1], **kl_options(kl))
    assert check_kto(kto_inputs(empty=empty), ref_source, chunk_completions=chunk, **options)


@pytest.mark.parametrize("flags", [(True,) * N, (False,) * N, (True,)])
def test_kto_one_class_only_and_one_completion(flags):
    assert check_kto(kto_inputs(n=len(flags), label=labels(*flags)), kl=0.2, chunk_completions=2)


@pytest.mark.parametrize("chunk", [None, 2])
def test_kto_drops_a_completion_whose_loss_is_nan_as_trls_nanmean_does(chunk):
    """A completion whose reference log-probability is NaN: TRL 1.16 averages with nanmean, so the loss is the mean
    of the others. Its gradients are the others' too, and that completion gets none (TRL's autograd, through the
    NaN, would make every weight gradient NaN)."""
    hidden, weight, target, label = kto_inputs()[:4]
    ref_logps = randn(N) - 20
    ref_logps[2] = float("nan")
    leaves = [hidden.clone().requires_grad_(), weight.clone().requires_grad_()]
    loss = liger_lab.fused_linear_kto(*leaves, target, label, ref_logps=ref_logps, kl=0.1, chunk_completions=chunk)
    with torch.no_grad():
        expected = reference.fused_linear_kto(hidden.double(), weight.double(), target, label,
                                              ref_logps=ref_logps.double(), kl=0.1)  # fmt: skip
    kept = [i for i in range(N) if i != 2]
    exact = [hidden[kept].double().requires_grad_(), weight.double().requires_grad_()]
    others = reference.fused_linear_kto(*exact, target[kept], label[kept], ref_logps=ref_logps[kept].double(), kl=0.1)
    torch.testing.assert_close(expected, others.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(loss.double(), others.detach(), rtol=1e-5, atol=1e-6)
    grad_hidden, grad_weight = torch.autograd.grad(loss, leaves)
    exact_hidden, exact_weight = torch.autograd.grad(others, exact)
    torch.testing.assert_close(grad_hidden[kept].double(), exact_hidden, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(grad_weight.double(), exact_weight, rtol=1e-4, atol=1e-6)
    assert torch.count_nonzero(grad_hidden[2]) == 0


@pytest.mark.parametrize("beta", [0.0, 1e-4, 20.0])
def test_kto_beta_edge_values(beta):
    # The loss depends on beta * logp: its relative error grows with beta times the fp32 error of a logp.
    assert check_kto(kto_inputs(empty=(3,)), tol=1e-5 * max(1.0, beta), beta=beta, kl=0.4)


def test_kto_fp16_and_label_as_integers():
    tensors = kto_inputs(dtype=torch.float16, empty=(1,))
    tensors[3] = tensors[3].to(torch.int64)
    assert check_kto(tensors, kl=0.3, chunk_completions=4)


# --------------------------------------------------------------------------------------------------
# CPO against float64


@pytest.mark.parametrize(
    "options, empty, chunk_pairs",
    [
        ({}, (1,), 2),  # TRL's defaults: sigmoid, cpo_alpha 1; chunks of 2 pairs and 1
        ({}, (4,), None),  # one chunk, from the byte budget
        ({"label_smoothing": 0.2, "cpo_alpha": 0.5}, (4,), 2),
        ({"loss_type": "hinge", "alpha": 0.5}, (), 1),
        ({"loss_type": "ipo", "cpo_alpha": 0.0}, (2,), 2),
        ({"loss_type": "simpo", "label_smoothing": 0.1, "simpo_gamma": 1.0, "cpo_alpha": 0.0, "beta": 2.0}, (3,), None),
        ({"loss_type": "alphapo", "alpha": 0.3, "beta": 2.0}, (), 2),
        ({"alpha": -0.2, "beta": 0.05}, (0,), 2),
        ({"cpo_alpha": 2.0}, (0, 1, 2), 1),  # every chosen sequence empty: the NLL has no token to average
    ],
)
def test_cpo_matches_float64(options, empty, chunk_pairs):
    assert check_cpo([*head(2 * B), targets(2 * B, empty=empty)], chunk_pairs=chunk_pairs, **options)


def test_cpo_fp16():
    assert check_cpo([*head(2 * B, dtype=torch.float16), targets(2 * B, empty=(2,))], loss_type="simpo", beta=2.0)


def test_cpo_simpo_without_nll_is_simpo():
    tensors = [*head(2 * B), targets(2 * B, empty=(4,))]
    with torch.no_grad():
        cpo = liger_lab.fused_linear_cpo(*tensors, loss_type="simpo", beta=2.5, simpo_gamma=0.7, cpo_alpha=0.0)
        simpo = liger_lab.fused_linear_simpo(*tensors, beta=2.5, gamma=0.7)
    torch.testing.assert_close(cpo, simpo, rtol=1e-6, atol=1e-7)


# --------------------------------------------------------------------------------------------------
# Behaviour


@pytest.mark.parametrize("loss", ["kto", "cpo"])
def test_no_positions_at_all(loss):
    """T = 0: every sequence scores logp = 0, the loss is the per-unit loss at 0 and no gradient flows."""
    tensors = kto_inputs(seq_len=0) if loss == "kto" else [*head(2 * B, seq_len=0), targets(2 * B, seq_len=0)]
    hidden, weight = (t.requires_grad_() for t in tensors[:2])
    got = getattr(liger_lab, f"fused_linear_{loss}")(*tensors)
    expected = getattr(reference, f"fused_linear_{loss}")(*tensors)
    assert got.dtype == torch.float32 and torch.allclose(got.double(), expected.double())
    grads = torch.autograd.grad(got, [hidden, weight])
    assert all(g.shape == t.shape and not g.any() for g, t in zip(grads, [hidden, weight], strict=True))


def test_kto_return_logps():
    """(loss, logps, ref_logps): each completion's summed log-probability in the rows' order, float32, not
    differentiable; the loss is unchanged."""
    tensors = kto_inputs(empty=(2,))
    hidden, weight = (t.requires_grad_() for t in tensors[:2])
    loss, logps, ref_logps = liger_lab.fused_linear_kto(*tensors, kl=0.1, return_logps=True, chunk_completions=4)
    assert torch.equal(loss, liger_lab.fused_linear_kto(*tensors, kl=0.1, chunk_completions=4))
    assert all(t.shape == (N,) and t.dtype == torch.float32 and not t.requires_grad for t in (logps, ref_logps))
    target = tensors[2]
    expected = reference.sequence_logps(hidden.detach().double(), weight.detach().double(), target)[0]
    expected_ref = reference.sequence_logps(tensors[4].double(), tensors[5].double(), target)[0]
    torch.testing.assert_close(logps.double(), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ref_logps.double(), expected_ref, rtol=1e-5, atol=1e-5)
    loss.backward()
    assert hidden.grad is not None


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_cpo_return_logps(loss_type):
    """The sum (sigmoid, hinge) or the mean (ipo, simpo) of each sequence's token log-probabilities: TRL's
    policy_chosen_logps."""
    hidden, weight, target = [*head(2 * B), targets(2 * B, empty=(1,))]
    loss, chosen, rejected = liger_lab.fused_linear_cpo(hidden, weight, target, loss_type=loss_type,
                                                        return_logps=True)  # fmt: skip
    logp, count = reference.sequence_logps(hidden.double(), weight.double(), target)
    expected = logp / count.clamp(min=1) if loss_type == "ipo" else logp
    torch.testing.assert_close(torch.cat([chosen, rejected]).double(), expected, rtol=1e-5, atol=1e-5)
    assert not chosen.requires_grad and loss.dtype == torch.float32


def test_table_rows_and_exports():
    from liger_lab.op_table import OPS

    for loss in ("kto", "cpo"):
        assert f"fused_linear_{loss}" in liger_lab.__all__ and f"fused_linear_{loss}" in OPS
    assert preference.LOSSES == ("dpo", "orpo", "simpo", "kto", "cpo")


def _zeros(*shape, dtype=torch.float32):
    return torch.zeros(shape, dtype=dtype, device=runtime.DEVICE)


@pytest.mark.parametrize(
    "make, options, message",
    [
        (lambda h, w, t, y, rh, rw: (h[0], w, t, y, rh, rw), {}, r"\(B, T, H\)"),
        (lambda h, w, t, y, rh, rw: (h, w, t, y[:-1], rh, rw), {}, "label has shape"),
        (lambda h, w, t, y, rh, rw: (h, w, t, y.float(), rh, rw), {}, "label has dtype"),
        (lambda h, w, t, y, rh, rw: (h, w, t, y), {}, "needs a reference model"),
        (lambda h, w, t, y, rh, rw: (h, w, t, y, rh, rw), {"ref_logps": _zeros(N)}, "not both"),
        (lambda h, w, t, y, rh, rw: (h, w, t, y), {"ref_logps": _zeros(N + 1)}, "ref_logps has shape"),
        (lambda h, w, t, y, rh, rw: (h, w, t, y, rh[:, :-1], rw), {}, "ref_hidden has shape"),
        (lambda h, w, t, y, rh, rw: (h, w, t[:, :-1], y, rh, rw), {}, "target has shape"),
        (lambda h, w, t, y, rh, rw: (h, w, t.masked_fill(t == t.max(), V), y, rh, rw), {}, "out of range"),
        (lambda *a: a, {"loss_type": "bco"}, "loss_type"),
        (lambda *a: a, {"beta": -0.1}, "beta"),
        (lambda *a: a, {"desirable_weight": float("inf")}, "desirable_weight"),
        (lambda *a: a, {"undesirable_weight": -1.0}, "undesirable_weight"),
        (lambda *a: a, {"kl": 0.1, "kl_logps": _zeros(N), "ref_kl_logps": _zeros(N)}, "not both"),
        (lambda *a: a, {"kl_logps": _zeros(N)}, "come together"),
        (lambda *a: a, {"kl_logps": _zeros(N), "ref_kl_logps": _zeros(N - 1)}, "ref_kl_logps has shape"),
        (lambda *a: a, {"kl_logps": _zeros(2, N), "ref_kl_logps": _zeros(2, N)}, "1-D"),
        (lambda *a: a, {"kl": _zeros(2)}, "one real number"),
        (lambda *a: a, {"kl": float("nan")}, "kl is"),
        (lambda *a: a, {"chunk_completions": 0}, "chunk_completions"),
    ],
)
def test_kto_bad_input_is_a_value_error(make, options, message):
    tensors = kto_inputs()
    before = [t.clone() for t in tensors]
    with pytest.raises(ValueError, match=message):
        liger_lab.fused_linear_kto(*make(*tensors), **options)
    assert all(torch.equal(t, b) for t, b in zip(tensors, before, strict=True))


@pytest.mark.parametrize(
    "make, options, message",
    [
        (lambda h, w, t: (h[:5], w, t[:5]), {}, "even"),
        (lambda h, w, t: (h, w.half(), t), {}, "one dtype"),
        (lambda h, w, t: (h, w, t.float()), {}, "integer"),
        (lambda h, w, t: (h, w, t), {"loss_type": "kto_pair"}, "loss_type"),
        (lambda h, w, t: (h, w, t), {"loss_type": "hinge", "label_smoothing": 0.1}, "takes none"),
        (lambda h, w, t: (h, w, t), {"label_smoothing": 1.5}, r"\[0, 1\]"),
        (lambda h, w, t: (h, w, t), {"loss_type": "ipo", "beta": 0.0}, "beta > 0"),
        (lambda h, w, t: (h, w, t), {"loss_type": "simpo", "beta": 0.0}, "beta > 0"),
        (lambda h, w, t: (h, w, t), {"cpo_alpha": -1.0}, "cpo_alpha"),
        (lambda h, w, t: (h, w, t), {"alpha": float("inf")}, "alpha"),
        (lambda h, w, t: (h, w, t), {"simpo_gamma": True}, "simpo_gamma"),
    ],
)
def test_cpo_bad_input_is_a_value_error(make, options, message):
    tensors = [*head(2 * B), targets(2 * B)]
    with pytest.raises(ValueError, match=message):
        liger_lab.fused_linear_cpo(*make(*tensors), **options)


@pytest.mark.parametrize(
    "loss, options, message",
    [
        ("cpo", {"loss_type": "hinge", "label_smoothing": 0.1}, "takes none"),
        ("cpo", {"loss_type": "ipo", "beta": 0.0}, "beta > 0"),
        ("dpo", {"loss_type": "robust", "label_smoothing": 0.5}, "it in"),
        ("kto", {"loss_type": "bco"}, "loss_type"),
    ],
)
def test_the_references_check_their_options_as_the_kernels_do(loss, options, message):
    """One check of each loss's options (preference.<loss>_options) for the kernel path and the float64 reference:
    the reference never computes a loss for options the kernel refuses."""
    hidden, weight = head(N if loss == "kto" else 2 * B)
    args = [hidden.double(), weight.double(), targets(hidden.shape[0]), *([labels()] if loss == "kto" else [])]
    extra = {"ref_logps": _zeros(hidden.shape[0]).double()} if loss in ("dpo", "kto") else {}
    with pytest.raises(ValueError, match=message):
        getattr(reference, f"fused_linear_{loss}")(*args, **extra, **options)


@pytest.fixture
def gpu_path(monkeypatch):
    """The GPU's logic on the interpreter's tensors: values may not be read on the host."""
    monkeypatch.setattr(runtime, "HOST_READS_WAIT", True)


def _new_options_calls():
    """Calls with every new option that takes a tensor, each with leaves requiring grad (the fused losses the
    host-sync and compile tests run)."""
    kto = kto_inputs(n=4, seq_len=5, label=labels(True, False, False, True))
    ref_logps = randn(4)
    pairs = [*head(4, seq_len=5), targets(4, seq_len=5)]
    nll_target = pairs[2][:2].clone()
    nll_target[:, :2] = 3
    student, teacher = head(10, seq_len=1), head(10, seq_len=1, hidden=H + 2)
    jsd_target = targets(10, seq_len=1, prompt=0).view(10)
    leaves = [t.requires_grad_() for t in (kto[0], kto[1], pairs[0], pairs[1], student[0], student[1])]

    def run():
        kto_loss, logps, _ = liger_lab.fused_linear_kto(
            kto[0], kto[1], kto[2], kto[3], ref_logps=ref_logps, kl_logps=ref_logps * 2, ref_kl_logps=ref_logps,
            return_logps=True, chunk_completions=3,
        )  # fmt: skip
        orpo_loss, chosen, _ = liger_lab.fused_linear_orpo(*pairs, nll_target=nll_target, return_logps=True)
        cpo_loss = liger_lab.fused_linear_cpo(*pairs, loss_type="simpo", beta=2.0, alpha=0.2)
        items = torch.tensor(7.5, device=runtime.DEVICE)
        distill = liger_lab.fused_linear_jsd(
            student[0].view(10, H), student[1], teacher[0].view(10, H + 2), teacher[1], jsd_target,
            num_items_in_batch=items, chunk_tokens=4,
        )  # fmt: skip
        return kto_loss + orpo_loss + cpo_loss + distill, logps, chosen

    return run, leaves


def test_new_options_read_nothing_back(gpu_path, monkeypatch):
    run, leaves = _new_options_calls()
    with HostReads(monkeypatch) as reads:
        run()[0].backward()
    assert reads.calls == []
    assert all(leaf.grad is not None and torch.isfinite(leaf.grad).all() for leaf in leaves)


def test_new_options_compile_fullgraph_as_eager():
    """The tensor options and the non-differentiable scores, traced whole by torch.compile (aot_eager)."""
    torch._dynamo.reset()
    results = []
    for compiled in (False, True):
        torch.manual_seed(0)
        run, leaves = _new_options_calls()
        outputs = (torch.compile(run, fullgraph=True, backend="aot_eager") if compiled else run)()
        results.append([*outputs, *torch.autograd.grad(outputs[0], leaves)])
    for ours, expected in zip(*results, strict=True):
        torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.cuda
def test_kto_bf16_128k_vocabulary():
    tensors = [*head(N, seq_len=100, hidden=256, vocab=128256, dtype=torch.bfloat16),
               targets(N, seq_len=100, vocab=128256, prompt=30, empty=(4,)), labels(),
               *head(N, seq_len=100, hidden=256, vocab=128256, dtype=torch.bfloat16)]  # fmt: skip
    assert check_kto(tensors, kl=0.5, chunk_completions=4)


@pytest.mark.cuda
@pytest.mark.parametrize("loss_type", ["sigmoid", "simpo"])
def test_cpo_bf16_128k_vocabulary(loss_type):
    tensors = [*head(2 * B, seq_len=100, hidden=256, vocab=128256, dtype=torch.bfloat16),
               targets(2 * B, seq_len=100, vocab=128256, prompt=30, empty=(4,))]  # fmt: skip
    assert check_cpo(tensors, loss_type=loss_type, beta=2.0 if loss_type == "simpo" else 0.1, chunk_pairs=2)


# --------------------------------------------------------------------------------------------------
# The references against TRL 1.16's own loss code (float64, no empty sequence: TRL's means over no token are NaN).
# A trainer is stood in for by a namespace with the attributes its loss code reads, the model by one that returns
# what TRL's fused LM head (log_probs) or a plain model (logits) would for fixed float64 hidden states.


def _trl(module: str):
    pytest.importorskip("trl", minversion="1.16")
    with warnings.catch_warnings():  # trl.experimental warns on import that its API may change
        warnings.simplefilter("ignore")
        return importlib.import_module(module)


def _trainer(cls, **fields):
    """A stand-in ``self`` on one process; the listed methods of ``cls`` bound to it."""
    accelerator = SimpleNamespace(device=torch.device("cpu"), gather=lambda x: x, gather_for_metrics=lambda x: x)
    trainer = SimpleNamespace(
        accelerator=accelerator, model=SimpleNamespace(training=False), aux_loss_enabled=False,
        is_encoder_decoder=False, _metrics=defaultdict(lambda: defaultdict(list)), _total_train_tokens=0, _tp_size=1,
        **fields,
    )  # fmt: skip
    for name in ("concatenated_forward", "cpo_loss", "odds_ratio_loss"):
        if hasattr(cls, name):
            setattr(trainer, name, functools.partial(getattr(cls, name), trainer))
    for name in ("concatenated_inputs", "get_batch_logps"):  # static methods
        if hasattr(cls, name):
            setattr(trainer, name, getattr(cls, name))
    return trainer


def _sequences(n, generator, prompt=3):
    """n tokenized sequences of L = T + 1 tokens as TRL's collators give them, the float64 hidden states at every
    position, a float64 head, and what the fused losses take: hidden[:, :-1], target = labels[:, 1:]."""
    input_ids = torch.randint(0, V, (n, T + 1), generator=generator)
    attention_mask = torch.ones(n, T + 1, dtype=torch.int64)
    attention_mask[1, -2:] = 0  # right padding
    completion_mask = attention_mask.clone()
    completion_mask[:, :prompt] = 0
    hidden = torch.randn(n, T + 1, H, dtype=torch.float64, generator=generator).requires_grad_()
    weight = torch.randn(V, H, dtype=torch.float64, generator=generator).requires_grad_()
    labels_ = input_ids.masked_fill(completion_mask == 0, -100)
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "completion_mask": completion_mask}
    return batch, hidden, weight, labels_[:, 1:]


def _fused_head(hidden, weight, target):
    """The model TRL's DPO and KTO trainers call with fused_lm_head=True: per-token log-probs (0 where ignored)."""
    logps = reference.fused_linear_logprobs(hidden[:, :-1], weight, target)
    zeros = torch.zeros_like(logps)
    outputs = SimpleNamespace(log_probs=logps, entropy=zeros, mean_logits=zeros, is_top1=zeros.bool())
    return lambda **kwargs: outputs


def _paired_batch(batch, n_pairs):
    """TRL's ORPO/CPO batch: chosen_* and rejected_* halves, labels with the prompt and padding at -100."""
    labels_ = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
    columns = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], "labels": labels_}
    return {f"{side}_{k}": v[rows] for k, v in columns.items()
            for side, rows in (("chosen", slice(0, n_pairs)), ("rejected", slice(n_pairs, None)))}  # fmt: skip


def _logits_model(hidden, weight):
    return lambda input_ids, **kwargs: SimpleNamespace(logits=hidden @ weight.T)


def _same_loss_and_grads(ours, trl, leaves, case, fp32_in_trl=False):
    """The same loss and gradients: to float64's rounding, or to fp32's where TRL's code casts to float32."""
    loss_tol, grad_tol = ((1e-5, 1e-8),) * 2 if fp32_in_trl else ((1e-12, 1e-12), (1e-10, 1e-12))
    torch.testing.assert_close(ours, trl, rtol=loss_tol[0], atol=loss_tol[1], msg=lambda m: f"{case}: {m}")
    for a, b in zip(torch.autograd.grad(ours, leaves), torch.autograd.grad(trl, leaves), strict=True):
        torch.testing.assert_close(a, b, rtol=grad_tol[0], atol=grad_tol[1], msg=lambda m: f"{case}: {m}")


def test_dpo_reference_matches_trl():
    trainer_cls = _trl("trl.trainer.dpo_trainer").DPOTrainer
    batch, hidden, weight, target = _sequences(2 * B, torch.Generator().manual_seed(1))
    ref_logps = torch.randn(2 * B, dtype=torch.float64) - 25
    for loss_type, beta, label_smoothing in [("sigmoid", 0.1, 0.0), ("hinge", 0.3, 0.0), ("ipo", 0.2, 0.0),
                                             ("robust", 0.1, 0.2)]:  # fmt: skip
        trainer = _trainer(
            trainer_cls, ld_alpha=None, precompute_ref_logps=True, f_divergence_type="reverse_kl",
            loss_types=[loss_type], loss_weights=[1.0], beta=beta, label_smoothing=label_smoothing,
            use_weighting=False,
        )  # fmt: skip
        inputs = {**batch, "ref_chosen_logps": ref_logps[:B], "ref_rejected_logps": ref_logps[B:]}
        trl = trainer_cls._compute_loss(trainer, _fused_head(hidden, weight, target), inputs, False)
        ours = reference.fused_linear_dpo(hidden[:, :-1], weight, target, ref_logps=ref_logps, beta=beta,
                                          loss_type=loss_type, label_smoothing=label_smoothing)  # fmt: skip
        _same_loss_and_grads(ours, trl, [hidden, weight], loss_type)


def test_kto_reference_matches_trl():
    trainer_cls = _trl("trl.trainer.kto_trainer").KTOTrainer
    batch, hidden, weight, target = _sequences(N, torch.Generator().manual_seed(2))
    label = torch.tensor([True, False, False, True, True, False])
    ref_logps = torch.randn(N, dtype=torch.float64) - 25
    kl_logps, ref_kl_logps = torch.randn(N, dtype=torch.float64) - 30, torch.randn(N, dtype=torch.float64) - 31
    for loss_type, beta, weights in [("kto", 0.1, (1.0, 1.0)), ("kto", 0.5, (1.33, 0.8)),
                                     ("apo_zero_unpaired", 0.2, (0.9, 1.2))]:  # fmt: skip
        trainer = _trainer(
            trainer_cls, calculate_KL=loss_type == "kto", precompute_ref_logps=True, loss_type=loss_type, beta=beta,
            desirable_weight=weights[0], undesirable_weight=weights[1],
            _compute_kl_logps=lambda model, batch: kl_logps if loss_type == "kto" else None,
        )  # fmt: skip
        inputs = {**batch, "label": label, "ref_logps": ref_logps, "ref_KL_logps": ref_kl_logps}
        trl = trainer_cls._compute_loss(trainer, _fused_head(hidden, weight, target), inputs, False)
        ours = reference.fused_linear_kto(
            hidden[:, :-1], weight, target, label, ref_logps=ref_logps, kl_logps=kl_logps, ref_kl_logps=ref_kl_logps,
            beta=beta, loss_type=loss_type, desirable_weight=weights[0], undesirable_weight=weights[1],
        )  # fmt: skip
        _same_loss_and_grads(ours, trl, [hidden, weight], (loss_type, beta))


def test_cpo_reference_matches_trl():
    trainer_cls = _trl("trl.experimental.cpo.cpo_trainer").CPOTrainer
    batch, hidden, weight, target = _sequences(2 * B, torch.Generator().manual_seed(3))
    paired = _paired_batch(batch, B)
    cases = [("sigmoid", 0.1, 0.0, 1.0, 0.0), ("sigmoid", 0.2, 0.3, 0.5, 0.0), ("hinge", 0.1, 0.0, 1.0, 0.4),
             ("ipo", 0.3, 0.0, 0.0, 0.0), ("simpo", 2.0, 0.1, 0.0, 0.0), ("simpo", 2.0, 0.0, 0.0, -0.3)]  # fmt: skip
    for loss_type, beta, label_smoothing, cpo_alpha, alpha in cases:
        trainer = _trainer(trainer_cls, loss_type=loss_type, beta=beta, label_smoothing=label_smoothing,
                           cpo_alpha=cpo_alpha, alpha=alpha, simpo_gamma=0.5, pad_token_id=0)  # fmt: skip
        trl, _ = trainer_cls.get_batch_loss_metrics(trainer, _logits_model(hidden, weight), paired)
        ours = reference.fused_linear_cpo(hidden[:, :-1], weight, target, beta=beta, loss_type=loss_type,
                                          label_smoothing=label_smoothing, cpo_alpha=cpo_alpha, simpo_gamma=0.5,
                                          alpha=alpha)  # fmt: skip
        _same_loss_and_grads(ours, trl, [hidden, weight], (loss_type, label_smoothing, cpo_alpha, alpha))
    # "alphapo" is CPOConfig's name for simpo without the NLL term.
    alphapo = reference.fused_linear_cpo(hidden[:, :-1], weight, target, beta=2.0, loss_type="alphapo", alpha=-0.3)
    torch.testing.assert_close(alphapo, ours)


def test_orpo_reference_with_nll_target_matches_trl():
    """TRL's ORPOTrainer takes its NLL over prompt and response: nll_target, the chosen input ids shifted."""
    trainer_cls = _trl("trl.experimental.orpo.orpo_trainer").ORPOTrainer
    batch, hidden, weight, target = _sequences(2 * B, torch.Generator().manual_seed(4))
    nll_target = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)[:B, 1:]
    for beta in (0.1, 1.5):
        trainer = _trainer(trainer_cls, beta=beta, padding_value=0)
        trl, _ = trainer_cls.get_batch_loss_metrics(trainer, _logits_model(hidden, weight), _paired_batch(batch, B))
        ours = reference.fused_linear_orpo(hidden[:, :-1], weight, target, beta=beta, nll_target=nll_target)
        # TRL's odds_ratio_loss casts the log-probabilities to float32 first: fp32's rounding, not float64's.
        _same_loss_and_grads(ours, trl, [hidden, weight], beta, fp32_in_trl=True)


# --------------------------------------------------------------------------------------------------
# num_items_in_batch on the distillation losses: the sum over kept rows divided by it.


def _distill(rows=11, vocab=130, dtype=torch.float32):
    student, teacher = randn(rows, vocab, dtype=dtype, scale=2.0), randn(rows, vocab, dtype=dtype, scale=2.0)
    target = torch.randint(0, vocab, (rows,), device=runtime.DEVICE)
    target[::3] = -100
    return student, teacher, target


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_items", [5.0, 0.375, "tensor"])
def test_jsd_num_items_in_batch(dtype, num_items):
    num_items = torch.tensor([13], device=runtime.DEVICE) if num_items == "tensor" else num_items
    student, teacher, target = _distill(dtype=dtype)
    assert check_op("jsd", student, teacher, target, beta=0.3, num_items_in_batch=num_items)


@pytest.mark.parametrize(
    "dtype, num_items, with_target",
    [
        (torch.float32, 5.0, True),
        (torch.float32, "tensor", False),
        # fp16 leaves the divisor to the backward (see mean_over_kept), which must not clamp one below 1.
        (torch.float16, 0.375, True),
        (torch.float16, "tensor", True),
    ],
)
def test_fused_linear_jsd_num_items_in_batch(dtype, num_items, with_target):
    num_items = torch.tensor(13.0, device=runtime.DEVICE) if num_items == "tensor" else num_items
    student, teacher = head(11, seq_len=1, dtype=dtype), head(11, seq_len=1, hidden=H + 8, dtype=dtype)
    tensors = [student[0].view(11, H), student[1], teacher[0].view(11, H + 8), teacher[1]]
    target = _distill()[2] if with_target else None
    assert check_op("fused_linear_jsd", *tensors, target, beta=0.0, num_items_in_batch=num_items, chunk_tokens=4)


def test_num_items_in_batch_makes_micro_batches_add_up_to_the_batch_mean():
    """What TRL passes it for: with the kept rows of the whole batch, the micro-batches' losses and gradients add up
    to those of the mean over the whole batch."""
    student, teacher, target = _distill(rows=12)
    leaf = student.requires_grad_()
    whole = liger_lab.jsd(leaf, teacher, target)
    (whole_grad,) = torch.autograd.grad(whole, leaf)
    kept = (target != -100).sum()
    parts = [liger_lab.jsd(leaf[rows], teacher[rows], target[rows], num_items_in_batch=kept)
             for rows in (slice(0, 5), slice(5, 12))]  # fmt: skip
    (parts_grad,) = torch.autograd.grad(sum(parts), leaf)
    torch.testing.assert_close(sum(parts), whole)
    torch.testing.assert_close(parts_grad, whole_grad)


@pytest.mark.parametrize(
    "num_items, message",
    [(0, "positive"), (-2.0, "positive"), (float("nan"), "positive"), (True, "positive"), ("7", "positive"),
     ("pair", "one real number"), ("bool", "one real number")],
)  # fmt: skip
def test_bad_num_items_in_batch(num_items, message):
    student, teacher, target = _distill()
    if num_items == "pair":
        num_items = torch.ones(2, device=runtime.DEVICE)
    elif num_items == "bool":
        num_items = torch.tensor(True, device=runtime.DEVICE)
    with pytest.raises(ValueError, match=message):
        liger_lab.jsd(student, teacher, target, num_items_in_batch=num_items)
    with pytest.raises(ValueError, match=message):
        liger_lab.fused_linear_jsd(student, teacher.new_ones(130, 130), teacher, teacher.new_ones(130, 130),
                                   num_items_in_batch=num_items)  # fmt: skip
