"""The GRPO family on the fused linear head, against the float64 reference (itself checked against TRL's own
GRPOTrainer._compute_loss)."""

import types
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from helpers import LargestNewTensor, OpCalls, check_op, randn

import liger_lab
from liger_lab import formulas, reference, runtime
from liger_lab.ops import chunked, grpo, operators

B, T, H, V = 3, 7, 16, 40
LOSS_TYPES = formulas.LOSS_TYPES
LEVELS = formulas.IMPORTANCE_SAMPLING_LEVELS


def targets(vocab=V, ignore_index=-100):
    """(B, T) completions: ragged padding on sequence 0, a masked first token on sequence 1, sequence 2 all padding."""
    t = torch.randint(0, vocab, (B, T), device=runtime.DEVICE)
    t[0, 5:] = ignore_index
    t[1, 0] = ignore_index
    t[2] = ignore_index
    return t


def inputs(dtype=torch.float32, per_token_advantages=False, scale=1.0, ignore_index=-100):
    """hidden, weight, target, advantages, and old / ref log-probabilities near the policy's: old with a bias per
    sequence (0.4, -0.4, 0.1) so that token and sequence ratios both leave the clip range. Padding positions of
    old and ref hold 50, which must not matter."""
    hidden, weight = randn(B, T, H, dtype=dtype, scale=scale), randn(V, H, dtype=dtype, scale=2 * H**-0.5)
    target = targets(ignore_index=ignore_index)
    advantages = randn(B, T) if per_token_advantages else randn(B)
    with torch.no_grad():
        logp = reference.fused_linear_logprobs(hidden.double(), weight.double(), target, ignore_index=ignore_index)
    bias = torch.tensor([0.4, -0.4, 0.1], device=runtime.DEVICE)[:, None]
    padding = target == ignore_index
    old = (logp.float() + 0.3 * randn(B, T) + bias).masked_fill(padding, 50.0)
    ref = (logp.float() + 0.5 * randn(B, T)).masked_fill(padding, 50.0)
    return hidden, weight, target, advantages, old, ref


# --------------------------------------------------------------------------------------------------
# Against float64


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("with_old", [False, True], ids=["old=None", "old"])
def test_matches_float64(loss_type, level, with_old):
    hidden, weight, target, advantages, old, ref = inputs()
    # cispo's epsilon_high is the ratio's upper bound (TRL's docs suggest values such as 5): 1.2 clips some tokens.
    epsilon_high = 1.2 if loss_type == "cispo" else 0.28
    # With old_logps, two chunks of 11 rows (sequence 1 split between them); without, one chunk (fewer launches).
    assert check_op(
        "fused_linear_grpo",
        hidden,
        weight,
        target,
        advantages,
        old_logps=old if with_old else None,
        loss_type=loss_type,
        importance_sampling_level=level,
        epsilon_high=epsilon_high,
        chunk_tokens=11 if with_old else None,
    )


@pytest.mark.parametrize(
    "loss_type, level, options",
    [
        ("dapo", "token", {"beta": 0.04}),  # the KL term
        ("grpo", "sequence", {"beta": 0.5, "delta": 1.3}),
        ("bnpo", "token", {"delta": 1.1, "epsilon_low": 0.1}),  # delta inside the clip range's top
        ("dapo", "sequence", {"delta": 0.9, "old": None}),  # every ratio 1 > delta: the clamp alone decides
        ("dr_grpo", "token", {"max_completion_length": 16, "temperature": 0.7}),
        ("dapo", "token", {"num_items_in_batch": 40}),  # a global token count, as a number
        ("cispo", "sequence", {"num_items_in_batch": "tensor", "beta": 0.1, "temperature": 1.5}),
        ("grpo", "token", {"per_token_advantages": True}),
        ("grpo", "sequence", {"per_token_advantages": True, "delta": 1.5}),
        ("bnpo", "sequence", {"ignore_index": 3, "epsilon_high": 0.0}),
    ],
)
def test_options(loss_type, level, options):
    options = dict(options)
    ignore_index = options.get("ignore_index", -100)
    hidden, weight, target, advantages, old, ref = inputs(
        per_token_advantages=options.pop("per_token_advantages", False), ignore_index=ignore_index
    )
    if options.get("num_items_in_batch") == "tensor":
        options["num_items_in_batch"] = torch.tensor(25, device=runtime.DEVICE)
    old = options.pop("old", old)
    assert check_op(
        "fused_linear_grpo",
        hidden,
        weight,
        target,
        advantages,
        old_logps=old,
        ref_logps=ref,
        loss_type=loss_type,
        importance_sampling_level=level,
        chunk_tokens=11,
        **options,
    )


def test_fp16_and_large_logits():
    hidden, weight, target, advantages, old, ref = inputs(dtype=torch.float16)
    assert check_op("fused_linear_grpo", hidden, weight, target, advantages, old_logps=old, ref_logps=ref, beta=0.1)
    hidden, weight, target, advantages, old, ref = inputs(scale=30.0)  # logits in the hundreds: saturated softmax
    assert check_op("fused_linear_grpo", hidden, weight, target, advantages, old_logps=old, loss_type="grpo", tol=1e-4)


def test_every_token_ignored():
    hidden, weight, _, advantages, old, ref = inputs()
    hidden.requires_grad_()
    target = torch.full((B, T), -100, device=runtime.DEVICE)
    for loss_type in LOSS_TYPES:
        loss = liger_lab.fused_linear_grpo(hidden, weight, target, advantages, old_logps=old, loss_type=loss_type)
        (grad,) = torch.autograd.grad(loss, hidden)
        assert loss.item() == 0 and not grad.any()


def test_padding_values_of_old_and_ref_do_not_matter():
    hidden, weight, target, advantages, old, ref = inputs()
    options = dict(beta=0.1, importance_sampling_level="sequence", loss_type="bnpo")
    expected = liger_lab.fused_linear_grpo(hidden, weight, target, advantages, old_logps=old, ref_logps=ref, **options)
    padding = target == -100
    for value in (float("inf"), float("-inf"), float("nan"), -1e4):
        old_, ref_ = old.masked_fill(padding, value), ref.masked_fill(padding, value)
        got = liger_lab.fused_linear_grpo(hidden, weight, target, advantages, old_logps=old_, ref_logps=ref_, **options)
        assert torch.equal(got, expected)


# --------------------------------------------------------------------------------------------------
# The reference against TRL's own GRPOTrainer._compute_loss (eval mode: no accumulation factors; one process)


def _trl_loss(trainer_cls, logits, completion_ids, completion_mask, advantages, old, ref, *, loss_type, level, beta,
              epsilon_low, epsilon_high, delta, max_completion_length, num_items, importance_sampling_ratio=None,
              use_bias_correction_kl=False, entropy_coef=0.0, top_entropy_quantile=1.0,
              off_policy_mask_threshold=None, **args):  # fmt: skip
    """TRL's own method on a stand-in trainer (eval mode, one process) given these logits; ``args``: GRPOConfig's
    sapo_* and vespo_* fields."""
    log_p = logits.log_softmax(-1)
    logps = log_p.gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)
    entropies = -(log_p.exp() * log_p).sum(-1)
    config = {"sapo_temperature_pos": 1.0, "sapo_temperature_neg": 1.05, "vespo_k_pos": 2.0, "vespo_lambda_pos": 3.0,
              "vespo_k_neg": 3.0, "vespo_lambda_neg": 2.0, **args}  # fmt: skip
    trainer = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *args, **kwargs: (logps, entropies, None),
        aux_loss_enabled=False, top_entropy_quantile=top_entropy_quantile,
        off_policy_mask_threshold=off_policy_mask_threshold, importance_sampling_level=level, beta=beta,
        loss_type=loss_type, epsilon_low=epsilon_low, epsilon_high=epsilon_high,
        args=SimpleNamespace(delta=delta, use_bias_correction_kl=use_bias_correction_kl, **config),
        use_vllm=importance_sampling_ratio is not None, vllm_importance_sampling_correction=True,
        model=SimpleNamespace(training=False), current_gradient_accumulation_steps=1,
        max_completion_length=max_completion_length, _entropy_bonus_enabled=entropy_coef != 0,
        entropy_coef=entropy_coef, use_adaptive_entropy=False,
        accelerator=SimpleNamespace(num_processes=1, gather=lambda x: x, reduce=lambda x, reduction: x,
                                    pad_across_processes=lambda x, dim, pad_index: x),
        _metrics=defaultdict(lambda: defaultdict(list)),
        get_off_policy_mask=trainer_cls.get_off_policy_mask, get_gamma_weights=trainer_cls.get_gamma_weights,
    )  # fmt: skip
    trainer.get_high_entropy_mask = types.MethodType(trainer_cls.get_high_entropy_mask, trainer)
    empty = completion_ids[:, :0]
    batch = {"prompt_ids": empty, "prompt_mask": empty, "completion_ids": completion_ids,
             "completion_mask": completion_mask, "advantages": advantages, "ref_per_token_logps": ref,
             "num_items_in_batch": num_items}  # fmt: skip
    if old is not None:
        batch["old_per_token_logps"] = old
    if importance_sampling_ratio is not None:
        batch["importance_sampling_ratio"] = importance_sampling_ratio
    return trainer_cls._compute_loss(trainer, None, batch)


def _trl_batch(generator, *, old_shift):
    """float64 hidden and weight (leaves), completion ids with TRL's completion mask (two ragged completions), the
    targets (-100 at padding), and old and reference log-probabilities near the policy's at temperature 0.8."""
    hidden = torch.randn(B, T, H, dtype=torch.float64, generator=generator).requires_grad_()
    weight = torch.randn(V, H, dtype=torch.float64, generator=generator).requires_grad_()
    ids = torch.randint(0, V, (B, T), generator=generator)
    completion_mask = torch.ones(B, T, dtype=torch.int64)
    completion_mask[0, 4:] = 0
    completion_mask[1, 6:] = 0
    target = ids.masked_fill(completion_mask == 0, -100)
    with torch.no_grad():
        logp = reference.fused_linear_logprobs(hidden, weight, target, temperature=0.8)
    old = logp + 0.3 * torch.randn(B, T, dtype=torch.float64, generator=generator) + old_shift
    ref = logp + 0.5 * torch.randn(B, T, dtype=torch.float64, generator=generator)
    return hidden, weight, ids, completion_mask, target, old, ref


def test_reference_matches_trl():
    trainer_cls = pytest.importorskip("trl.trainer.grpo_trainer").GRPOTrainer
    generator = torch.Generator().manual_seed(3)
    hidden, weight, ids, completion_mask, target, old, ref = _trl_batch(generator, old_shift=0.2)
    cases = [(loss_type, level, with_old) for loss_type in LOSS_TYPES for level in LEVELS for with_old in (0, 1)]
    for i, (loss_type, level, with_old) in enumerate(cases):
        advantages = torch.randn(B, T, dtype=torch.float64) if i % 3 == 0 else torch.randn(B, dtype=torch.float64)
        options = dict(loss_type=loss_type, beta=0.04 * (i % 2), epsilon_low=0.2,
                       epsilon_high=3.0 if i % 4 else 0.28, delta=1.4 if i % 5 == 0 else None,
                       max_completion_length=9, num_items=torch.tensor(11.0))  # fmt: skip
        old_ = old if with_old else None
        trl = _trl_loss(trainer_cls, hidden @ weight.T / 0.8, ids, completion_mask, advantages, old_, ref, level=level,
                        **options)  # fmt: skip
        ours = reference.fused_linear_grpo(
            hidden, weight, target, advantages, old_logps=old_, ref_logps=ref, temperature=0.8, beta=options["beta"],
            epsilon_low=0.2, epsilon_high=options["epsilon_high"], delta=options["delta"], loss_type=loss_type,
            importance_sampling_level=level, max_completion_length=9, num_items_in_batch=options["num_items"],
        )  # fmt: skip
        torch.testing.assert_close(ours, trl, rtol=1e-12, atol=1e-12, msg=lambda m, c=cases[i]: f"{c}: {m}")
        for a, b in zip(torch.autograd.grad(ours, [hidden, weight]), torch.autograd.grad(trl, [hidden, weight]),
                        strict=True):  # fmt: skip
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=lambda m, c=cases[i]: f"{c}: {m}")


TRL_OPTION_CASES = [
    ("sapo", "token", {}),
    ("sapo", "sequence", {"sapo_temperature_pos": 2.0, "sapo_temperature_neg": 0.5, "beta": 0.04}),
    ("luspo", "sequence", {"delta": 1.5}),
    ("luspo", "token", {"beta": 0.04, "use_bias_correction_kl": True}),
    ("vespo", "token", {"importance_sampling_ratio": "tokens"}),
    ("vespo", "sequence", {"vespo_k_pos": 1.5, "vespo_lambda_neg": 1.0}),
    ("dapo", "token", {"importance_sampling_ratio": "tokens", "beta": 0.04, "use_bias_correction_kl": True}),
    ("grpo", "sequence", {"importance_sampling_ratio": "sequences"}),
    ("bnpo", "token", {"off_policy_mask_threshold": 0.05}),
    ("dapo", "token", {"top_entropy_quantile": 0.3, "entropy_coef": 0.02}),
    ("grpo", "token", {"entropy_coef": -0.01}),
    ("cispo", "sequence", {"top_entropy_quantile": 0.5, "off_policy_mask_threshold": 0.0}),
]


@pytest.mark.parametrize("loss_type, level, options", TRL_OPTION_CASES)
def test_every_option_of_trl_matches_trl_and_float64(loss_type, level, options):
    """The loss math the fused loss does not serve (sapo, luspo, vespo; the KL's bias correction; the vLLM ratio; the
    off-policy mask; the high-entropy mask; the entropy bonus) runs on the RL head and TRL's formula: the float64
    reference against TRL's own GRPOTrainer._compute_loss, and the op against the reference, with gradients."""
    trainer_cls = pytest.importorskip("trl.trainer.grpo_trainer").GRPOTrainer
    options = dict(options)
    generator = torch.Generator().manual_seed(5)
    hidden, weight, ids, completion_mask, target, old, ref = _trl_batch(generator, old_shift=0.02)
    advantages = torch.randn(B, dtype=torch.float64, generator=generator)
    ratio = options.pop("importance_sampling_ratio", None)
    if ratio is not None:
        shape = (B, T) if ratio == "tokens" else (B, 1)
        options["importance_sampling_ratio"] = torch.rand(shape, dtype=torch.float64, generator=generator) + 0.5
    base = dict(loss_type=loss_type, beta=options.pop("beta", 0.0), epsilon_low=0.2, epsilon_high=0.28,
                delta=options.pop("delta", None), max_completion_length=9, num_items=torch.tensor(11.0))  # fmt: skip
    trl = _trl_loss(trainer_cls, hidden @ weight.T / 0.8, ids, completion_mask, advantages, old, ref, level=level,
                    **base, **options)  # fmt: skip
    kwargs = dict(old_logps=old, ref_logps=ref, temperature=0.8, beta=base["beta"], epsilon_low=0.2, epsilon_high=0.28,
                  delta=base["delta"], loss_type=loss_type, importance_sampling_level=level, max_completion_length=9,
                  num_items_in_batch=base["num_items"], **options)  # fmt: skip
    ours = reference.fused_linear_grpo(hidden, weight, target, advantages, **kwargs)
    torch.testing.assert_close(ours, trl, rtol=1e-12, atol=1e-12)
    exact_grads = torch.autograd.grad(ours, [hidden, weight])
    for a, b in zip(exact_grads, torch.autograd.grad(trl, [hidden, weight]), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    # The op, fp32, against the float64 reference: the loss and both gradients.
    h32, w32 = hidden.detach().float().requires_grad_(), weight.detach().float().requires_grad_()
    floats = {k: v.float() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in kwargs.items()}
    loss = liger_lab.fused_linear_grpo(h32, w32, target, advantages.float(), **floats)
    assert loss.dtype == torch.float32
    # VESPO's weight is exp(lambda + k log w - lambda w) of a sequence's summed log-ratios: fp32's error in T of them
    # comes out times (k - lambda w).
    rtol = 1e-4 if loss_type == "vespo" else 1e-5
    torch.testing.assert_close(loss.double(), ours.detach(), rtol=rtol, atol=1e-6)
    for a, b in zip(torch.autograd.grad(loss, [h32, w32]), exact_grads, strict=True):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-6)


# --------------------------------------------------------------------------------------------------
# Behaviour


def _forward(hidden, weight, target, advantages, old, level, chunk):
    """The operator's work for dapo with both gradients (what the autograd.Function's forward runs), into outputs
    allocated as the operator allocates them: called through the operator, a dispatch mode would see only it."""
    options = formulas.GRPOOptions.checked("dapo", level, 0.0, 0.2, None, None)
    args = (hidden, weight, target, advantages, old, None, None, *options.arguments(), 1.0, -100, None, None, chunk,
            "fp32", False, [True, True, False])  # fmt: skip
    loss, no_logps, no_entropies = (hidden.new_empty(shape, dtype=torch.float32) for shape in ((), 0, 0))
    grads = operators.allocate_outputs(grpo._forward, chunked.grad_outputs(), args)
    grpo._forward(*args, loss, no_logps, no_entropies, *grads)


@pytest.mark.parametrize(
    "level, with_old, matmuls", [("token", True, 3), ("sequence", False, 3), ("sequence", True, 4)]
)
def test_matmuls_per_chunk(level, with_old, matmuls):
    """3 matmuls per chunk (logits, dW, dh), 4 when sequence weights need every logp first (module docstring); the
    backward only scales the gradients."""
    hidden, weight, target, advantages, old, _ = inputs()
    with OpCalls() as calls:
        _forward(hidden, weight, target, advantages, old if with_old else None, level, 11)
    assert calls.counts["aten::mm"] + calls.counts["aten::addmm"] == matmuls * 2, calls.counts


def test_no_tensor_holds_the_logits_of_every_token():
    hidden, weight, target, advantages, old, _ = inputs()
    with LargestNewTensor() as mode:
        _forward(hidden, weight, target, advantages, old, "sequence", 7)
    assert mode.largest <= max(7 * V, weight.numel(), hidden.numel()) < B * T * V


def test_without_grad_and_caller_tensors_unmodified():
    hidden, weight, target, advantages, old, ref = inputs()
    options = dict(old_logps=old, ref_logps=ref, beta=0.1, loss_type="grpo", importance_sampling_level="sequence")
    with torch.no_grad():
        plain = liger_lab.fused_linear_grpo(hidden, weight, target, advantages, **options)
    tensors = [hidden.requires_grad_(), weight.requires_grad_(), target, advantages, old, ref]
    before = [t.detach().clone() for t in tensors]
    loss = liger_lab.fused_linear_grpo(hidden, weight, target, advantages, **options)
    loss.backward()
    assert loss.dtype == torch.float32 and loss.shape == () and torch.equal(loss.detach(), plain)
    assert all(torch.equal(t.detach(), b) for t, b in zip(tensors, before, strict=True))


@pytest.mark.parametrize(
    "options",
    [{}, {"importance_sampling_level": "sequence", "beta": 0.1}, {"loss_type": "sapo", "use_bias_correction_kl": True}],
    ids=["fused", "sequence_with_first_pass", "rl_head_path"],
)
def test_per_token_outputs_are_the_rl_head_s_and_change_nothing_else(options):
    """``per_token=True`` adds each token's logp and entropy, without gradient, equal to the RL head's, on the fused
    path and on the RL head's path alike; the loss and its gradients are those of the plain call."""
    hidden, weight, target, advantages, old, ref = inputs()
    hidden.requires_grad_()
    weight.requires_grad_()
    options = {"old_logps": old, "ref_logps": ref, **options}
    plain = liger_lab.fused_linear_grpo(hidden, weight, target, advantages, **options)
    loss, logps, entropies = liger_lab.fused_linear_grpo(hidden, weight, target, advantages, per_token=True, **options)
    expected = liger_lab.fused_linear_logprobs(hidden, weight, target, entropy=True)
    for got, want in zip((logps, entropies), expected, strict=True):
        assert got.shape == target.shape and not got.requires_grad
        torch.testing.assert_close(got, want.detach(), rtol=0, atol=0)
    assert torch.equal(loss.detach(), plain.detach())
    grads = [torch.autograd.grad(value, [hidden, weight]) for value in (loss, plain)]
    for got, want in zip(*grads, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    with pytest.raises(ValueError, match="per_token"):
        liger_lab.fused_linear_grpo(hidden, weight, target, advantages, per_token=1)


def test_operator_with_every_optional_tensor_passes_opcheck():
    """The table's row runs the default call (every opcheck test, torch.compile); this covers the old, ref and
    num_items tensors, the first logp pass and the per-token outputs. Not test_schema: it runs the op under a mode
    that checks every aten call of the interpreted kernels (4 s here), and these read-only inputs change nothing it
    checks."""
    hidden, weight, target, advantages, old, ref = inputs()
    num_items = torch.tensor(30.0, device=runtime.DEVICE)
    args = (hidden, weight, target, advantages, old, ref, num_items, "cispo", "sequence", 0.1, 0.2, 3.0, None, 0.9,
            -100, None, None, None, "fp32", True, [True, True, False])  # fmt: skip
    tests = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.liger_lab.fused_linear_grpo, args, test_utils=tests)


@pytest.mark.parametrize("level", LEVELS)
def test_a_target_out_of_range_on_the_gpu_path_gives_nan_loss_and_gradients(level, monkeypatch):
    """The GPU's logic (no host read of the range check) on the interpreter's tensors."""
    monkeypatch.setattr(runtime, "HOST_READS_WAIT", True)
    hidden, weight, target, advantages, old, _ = inputs()
    target[1, 3] = V
    hidden.requires_grad_()
    weight.requires_grad_()
    loss = liger_lab.fused_linear_grpo(hidden, weight, target, advantages, old_logps=old,
                                       importance_sampling_level=level)  # fmt: skip
    assert all(torch.isnan(t).all() for t in (loss, *torch.autograd.grad(loss, [hidden, weight])))


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: {**a, "hidden": a["hidden"][0]}, r"\(B, T, H\)"),
        (lambda a: {**a, "weight": a["weight"][:, :-1]}, "weight has shape"),
        (lambda a: {**a, "weight": a["weight"].half()}, "one dtype"),
        (lambda a: {**a, "target": a["target"][:, :-1]}, "target has shape"),
        (lambda a: {**a, "target": a["target"].float()}, "integer"),
        (lambda a: {**a, "target": a["target"].masked_fill(a["target"] == a["target"].max(), V)}, "out of range"),
        (lambda a: {**a, "advantages": a["advantages"][:-1]}, "advantages has shape"),
        (lambda a: {**a, "advantages": a["advantages"].long()}, "floating"),
        (lambda a: {**a, "old_logps": a["old_logps"][:, :-1]}, "old_logps has shape"),
        (lambda a: {**a, "ref_logps": a["ref_logps"][None]}, "ref_logps has shape"),
        (lambda a: {**a, "loss_type": "ppo"}, "loss_type"),
        (lambda a: {**a, "advantages": a["advantages"].clone().requires_grad_()}, "advantages requires grad"),
        (lambda a: {**a, "old_logps": a["old_logps"].clone().requires_grad_()}, "old_logps requires grad"),
        (lambda a: {**a, "top_entropy_quantile": 1.5}, "top_entropy_quantile"),
        (lambda a: {**a, "old_logps": None, "off_policy_mask_threshold": 0.5}, "needs old_logps"),
        (lambda a: {**a, "use_bias_correction_kl": 1}, "use_bias_correction_kl"),
        (lambda a: {**a, "loss_type": "sapo", "sapo_temperature_pos": 0.0}, "sapo_temperature_pos"),
        (lambda a: {**a, "entropy_coef": float("inf")}, "entropy_coef"),
        (lambda a: {**a, "importance_sampling_ratio": torch.ones(3)}, "importance_sampling_ratio"),
        (lambda a: {**a, "importance_sampling_level": "batch"}, "importance_sampling_level"),
        (lambda a: {**a, "beta": 0.1, "ref_logps": None}, "ref_logps"),
        (lambda a: {**a, "beta": -0.1}, "beta"),
        (lambda a: {**a, "epsilon_low": float("nan")}, "epsilon_low"),
        (lambda a: {**a, "epsilon_high": -0.2}, "epsilon_high"),
        (lambda a: {**a, "delta": 0.0}, "delta"),
        (lambda a: {**a, "temperature": 0.0}, "temperature"),
        (lambda a: {**a, "max_completion_length": 0}, "max_completion_length"),
        (lambda a: {**a, "num_items_in_batch": torch.ones(2)}, "num_items_in_batch"),
        (lambda a: {**a, "num_items_in_batch": -1}, "num_items_in_batch"),
        (lambda a: {**a, "ignore_index": 0.5}, "ignore_index"),
        (lambda a: {**a, "chunk_tokens": 0}, "chunk_tokens"),
    ],
)
def test_bad_input_is_a_value_error(change, message):
    hidden, weight, target, advantages, old, ref = inputs()
    given = dict(hidden=hidden, weight=weight, target=target, advantages=advantages, old_logps=old, ref_logps=ref)
    before = {k: v.clone() for k, v in given.items()}
    args = change(given)
    positional = [args.pop(k) for k in ("hidden", "weight", "target", "advantages")]
    with pytest.raises(ValueError, match=message):
        liger_lab.fused_linear_grpo(*positional, **args)
    assert all(torch.equal(given[k], before[k]) for k in given)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"loss_type": "ppo"}, "loss_type"),
        ({"epsilon_low": -0.1}, "epsilon_low"),
        ({"delta": 0.0}, "delta"),
        ({"top_entropy_quantile": -0.1}, "top_entropy_quantile"),
    ],
)
def test_the_reference_checks_its_options_as_the_kernel_does(options, message):
    """One check of the options for the kernel path and the float64 reference (GRPOOptions.checked)."""
    hidden, weight, target, advantages, _, _ = inputs()
    with pytest.raises(ValueError, match=message):
        reference.fused_linear_grpo(hidden.double(), weight.double(), target, advantages, **options)


# --------------------------------------------------------------------------------------------------
# GPU


@pytest.mark.cuda
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "cispo"])
@pytest.mark.parametrize("level", LEVELS)
def test_bf16_large_vocabulary(loss_type, level):
    torch.manual_seed(1)
    hidden = randn(4, 300, 256, dtype=torch.bfloat16)
    weight = randn(50257, 256, dtype=torch.bfloat16, scale=256**-0.5)
    target = torch.randint(0, 50257, (4, 300), device=runtime.DEVICE)
    target[0, 200:] = -100
    with torch.no_grad():
        logp = reference.fused_linear_logprobs(hidden.float(), weight.float(), target)
    old = logp + 0.2 * torch.randn_like(logp)
    # A token whose ratio sits within bf16's rounding of logp from a clip edge takes the other branch of the min in
    # one of the two computations, and its whole gradient appears or vanishes: move such ratios 0.02 off the edges,
    # so that the test compares the kernel's arithmetic, not the side of a discontinuity each rounding falls on.
    for edge in (0.8, 1.28, 3.0):
        ratio = (logp - old).exp()
        off_edge = torch.where(ratio < edge, edge - 0.02, edge + 0.02)
        old = torch.where((ratio - edge).abs() < 0.02, logp - off_edge.log(), old)
    advantages = randn(4)
    assert check_op(
        "fused_linear_grpo",
        hidden,
        weight,
        target,
        advantages,
        old_logps=old,
        loss_type=loss_type,
        importance_sampling_level=level,
        epsilon_high=3.0 if loss_type == "cispo" else 0.28,
    )


def test_torch_func_transforms_are_refused_naming_the_loss():
    hidden, weight, target, advantages, old, _ = inputs()

    def loss(h):
        return liger_lab.fused_linear_grpo(h, weight, target, advantages, old_logps=old)

    with pytest.raises(RuntimeError, match=r"liger_lab\.fused_linear_grpo does not run under torch\.func"):
        torch.func.grad(loss)(hidden)
