"""TRL 1.16's trainers on liger_lab's LM head (``liger_lab.patch_trl``): each trainer trains 3 steps on a tiny random
Llama (saved to disk, so the trainers build their reference models as they do from a hub id), once on TRL's own head
and once on liger_lab's; the loss and every logged metric agree, and liger_lab's head served the calls."""

import math
import warnings

import pytest
import torch

trl = pytest.importorskip("trl", minversion="1.16")
datasets = pytest.importorskip("datasets")
transformers = pytest.importorskip("transformers")

import liger_lab  # noqa: E402
from liger_lab import trl_head  # noqa: E402

WORDS = [f"w{i}" for i in range(60)]
STEPS = 3


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, **{word: i + 3 for i, word in enumerate(WORDS)}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>"
    )
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, pad_token_id=0, eos_token_id=1, bos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("tiny-llama")
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def _text(i: int, words: int) -> str:
    return " ".join(WORDS[(7 * i + j) % len(WORDS)] for j in range(words))


def _length_reward(completions, **kwargs):
    return [float(len(completion)) for completion in completions]


def _trainer(kind: str, model_dir: str, output_dir: str, model=None, **options):
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    common = dict(
        output_dir=output_dir, max_steps=STEPS, per_device_train_batch_size=2, report_to=[], logging_steps=1,
        use_cpu=True, save_strategy="no", learning_rate=1e-3, bf16=False, seed=0,
    )  # fmt: skip
    if kind == "sft" and options:
        raise ValueError(f"options {options} are for the other trainers")
    prompts = [_text(i, 3) for i in range(8)]
    model_dir = model_dir if model is None else model
    if kind == "sft":
        data = datasets.Dataset.from_dict({"text": [_text(i, 6) for i in range(8)]})
        return trl.SFTTrainer(model_dir, args=trl.SFTConfig(**common), train_dataset=data, processing_class=tokenizer)
    if kind in ("dpo", "cpo"):
        columns = {"prompt": prompts, "chosen": [_text(i + 1, 4) for i in range(8)]}
        data = datasets.Dataset.from_dict({**columns, "rejected": [_text(i + 2, 3) for i in range(8)]})
        if kind == "dpo":
            args = trl.DPOConfig(**{**common, **options})
            return trl.DPOTrainer(model_dir, args=args, train_dataset=data, processing_class=tokenizer)
        from trl.experimental.cpo import CPOConfig, CPOTrainer

        policy = transformers.AutoModelForCausalLM.from_pretrained(model_dir) if model is None else model
        args = CPOConfig(**{**common, **options})
        return CPOTrainer(policy, args=args, train_dataset=data, processing_class=tokenizer)
    if kind == "kto":
        columns = {"prompt": prompts, "completion": [_text(i + 1, 4) for i in range(8)]}
        data = datasets.Dataset.from_dict({**columns, "label": [i % 2 == 0 for i in range(8)]})
        args = trl.KTOConfig(**{**common, **options})
        return trl.KTOTrainer(model_dir, args=args, train_dataset=data, processing_class=tokenizer)
    config, trainer = {"grpo": (trl.GRPOConfig, trl.GRPOTrainer), "rloo": (trl.RLOOConfig, trl.RLOOTrainer)}[kind]
    args = config(**{**common, "num_generations": 2, "max_completion_length": 4, "beta": 0.04, **options})
    data = datasets.Dataset.from_dict({"prompt": prompts})
    return trainer(model_dir, reward_funcs=_length_reward, args=args, train_dataset=data, processing_class=tokenizer)


def _train(kind, model_dir, output_dir, *, patched, **options):
    return _run(_trainer(kind, model_dir, output_dir, **options), patched=patched)


def _run(trainer, *, patched):
    """Train ``trainer`` (under patch_trl when ``patched``): its logged rows, the head patch_trl put in place (None
    unpatched) and the liger_lab warnings it gave."""
    head = liger_lab.patch_trl() if patched else None
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.train()
    finally:
        liger_lab.unpatch_trl()
    logged = [row for row in trainer.state.log_history if "loss" in row]
    messages = [str(w.message) for w in caught if "liger_lab" in str(w.message)]
    return logged, head, messages


# fp32 throughout (TRL's configs default to bf16 autocast, on CPU too, where two heads round differently): every
# logged number of every step agrees to fp32 rounding, carried through 3 optimizer steps.
METRIC_TOL = 1e-4
UNCOMPARED = {"step_time", "learning_rate", "epoch", "train_runtime"}


@pytest.mark.parametrize("kind", ["sft", "grpo", "rloo"])  # DPO and KTO: test_preference_loss_runs_on_its_fused_loss
def test_trainer_runs_on_liger_lab_head_like_on_trl_s_own(kind, tiny_model_dir, tmp_path):
    theirs, _, _ = _train(kind, tiny_model_dir, str(tmp_path / "trl"), patched=False)
    ours, head, messages = _train(kind, tiny_model_dir, str(tmp_path / "liger_lab"), patched=True)
    assert head.calls >= STEPS and head.fallbacks == 0, (head.calls, head.fallbacks)
    assert len(ours) == len(theirs) == STEPS
    for step, (our_row, their_row) in enumerate(zip(ours, theirs, strict=True), 1):
        assert our_row.keys() == their_row.keys()
        for name in our_row.keys() - UNCOMPARED:
            assert math.isclose(our_row[name], their_row[name], rel_tol=METRIC_TOL, abs_tol=METRIC_TOL), (step, name)
    # SFT logs the token accuracy: liger_lab's head computes it too, with nothing to say.
    assert messages == [], messages


def _assert_same_logs(ours, theirs, tol):
    assert len(ours) == len(theirs) == STEPS
    for step, (our_row, their_row) in enumerate(zip(ours, theirs, strict=True), 1):
        assert our_row.keys() == their_row.keys()
        for name in our_row.keys() - UNCOMPARED:
            assert math.isclose(our_row[name], their_row[name], rel_tol=tol, abs_tol=tol), (step, name)


FUSED_LOSSES = ("fused_linear_grpo", "fused_linear_dpo", "fused_linear_kto", "fused_linear_cpo")


def _served_by(loss: str | None, calls: int) -> dict[str, int]:
    """The fused losses' calls: ``calls`` of ``loss``, none of the others."""
    return {name: calls if name == loss else 0 for name in FUSED_LOSSES}


@pytest.fixture
def head_calls(monkeypatch):
    """Calls of TRL's own head, of liger_lab's RL head in patch_trl's head, and of the fused losses there."""
    from trl.kernels import ChunkedLogProbFunction

    calls = {"trl": 0, "rl_head": 0, **dict.fromkeys(FUSED_LOSSES, 0)}

    def counted(key, function):
        def call(*args, **kwargs):
            calls[key] += 1
            return function(*args, **kwargs)

        return call

    trl_forward = ChunkedLogProbFunction.forward
    monkeypatch.setattr(ChunkedLogProbFunction, "forward", staticmethod(counted("trl", trl_forward)))
    monkeypatch.setattr(trl_head, "fused_linear_logprobs", counted("rl_head", trl_head.fused_linear_logprobs))
    for loss in FUSED_LOSSES:
        monkeypatch.setattr(trl_head, loss, counted(loss, getattr(trl_head, loss)))
    return calls


def _served_both_ways(kind, model_dir, tmp_path, head_calls, **options):
    """Train ``kind`` on TRL alone, then under patch_trl, and check that the fused loss served every micro-batch,
    TRL's head none, liger_lab's RL head every other call TRL's head made in training (reference, old policy, KL
    completions; precompute_ref_log_probs calls the head as the trainer is built, unpatched), and that every logged
    number agrees to 1e-5. Returns our logged rows and those calls."""

    def train(way: str, patched: bool):
        trainer = _trainer(kind, model_dir, str(tmp_path / way), **options)
        head_calls["trl"] = 0
        return _run(trainer, patched=patched)

    theirs, _, _ = train("trl", patched=False)
    steps = STEPS * options.get("gradient_accumulation_steps", 1)
    other_calls = head_calls["trl"] - (0 if kind == "cpo" else steps)  # CPO's TRL makes logits: no head call
    ours, head, messages = train("liger_lab", patched=True)
    assert head_calls == {"trl": 0, "rl_head": other_calls, **_served_by(f"fused_linear_{kind}", steps)}, head_calls
    assert (head.calls, head.fallbacks, messages) == (steps + other_calls, 0, [])
    _assert_same_logs(ours, theirs, tol=1e-5)
    return ours, other_calls


GRPO_OPTIONS = {
    "default": {"beta": 0.0},
    # The KL term (without TRL's default bias correction: the fused loss's three matmuls), over two accumulation
    # steps, with old log-probabilities (two iterations per generation), so that ratios leave 1 and clip.
    "dapo_kl": {"beta": 0.04, "use_bias_correction_kl": False, "num_iterations": 2, "gradient_accumulation_steps": 2,
                "epsilon": 0.001},
    "grpo_sequence": {"loss_type": "grpo", "importance_sampling_level": "sequence", "beta": 0.0, "num_iterations": 2,
                      "epsilon": 0.001},
    # TRL's default bias-corrected KL, and the entropy bonus on the high-entropy tokens (fused_linear_grpo's
    # RL-head path, four matmuls).
    "bias_corrected_kl": {"beta": 0.04},
    "sapo_entropy_bonus": {"loss_type": "sapo", "beta": 0.0, "entropy_coef": 0.01, "top_entropy_quantile": 0.5},
    # The rows TRL's fused forward scores on a GPU: only the completion's (on the CPU it scores every position).
    "compact_rows": {"loss_type": "bnpo", "beta": 0.04, "use_bias_correction_kl": False},
}  # fmt: skip


@pytest.mark.parametrize("config", GRPO_OPTIONS)
def test_grpo_runs_on_fused_linear_grpo_like_on_trl_s_own(config, tiny_model_dir, tmp_path, head_calls, monkeypatch):
    """GRPO's loss from fused_linear_grpo on the policy's hidden states: the policy's head runs 0 times (liger_lab's
    RL head serves only the reference's and the old policy's log-probs, as many calls as TRL's head makes for them),
    and the loss and every logged metric (clip ratios, KL, entropy...) agree with TRL alone to 1e-5 over 3 steps."""
    if config == "compact_rows":
        monkeypatch.setattr("trl.trainer.utils._use_triton", lambda device: True)
    options = GRPO_OPTIONS[config]
    ours, other_calls = _served_both_ways("grpo", tiny_model_dir, tmp_path, head_calls, **options)
    assert other_calls >= (STEPS if options.get("beta") else 0)  # the reference's and the old policy's log-probs
    assert any(row.get("clip_ratio/region_mean", 0) > 0 for row in ours) or config not in ("dapo_kl", "grpo_sequence")


# Plain SGD, at a rate that moves the policy: AdamW's first steps move every weight by about its rate whatever the
# gradient's size, so a gradient element near 0 whose sign rounds the other way (fused_linear_dpo sums in float64, TRL
# in fp32) moves a weight by twice the rate, a difference beyond 1e-5 two steps later. SGD keeps rounding at rounding.
SGD = {"optim": "sgd", "learning_rate": 0.5}
PREFERENCE_OPTIONS = {
    # The reference model's log-probs computed before the policy's forward (TRL computes them after it).
    ("dpo", "sigmoid"): SGD,
    # Another loss type and a loss weight; the reference's log-probs precomputed (precompute_ref_log_probs), over two
    # accumulation steps; the rows TRL's fused forward scores on a GPU (only the completions').
    ("dpo", "robust_precomputed_compact_rows"): {**SGD, "loss_type": ["robust"], "label_smoothing": 0.2,
                                                 "loss_weights": [0.5], "precompute_ref_log_probs": True,
                                                 "gradient_accumulation_steps": 2},
    # The KL estimate from the policy's and the reference's log-probs of the KL completions; the two weights; the
    # completions' rows alone.
    ("kto", "kto_weighted_compact_rows"): {**SGD, "desirable_weight": 1.5, "undesirable_weight": 0.5},
    # The experimental CPO, from the full logits in TRL: its NLL term, label smoothing and AlphaPO's reward shape.
    ("cpo", "sigmoid_alpha"): {**SGD, "label_smoothing": 0.1, "alpha": 0.05},
}  # fmt: skip


@pytest.mark.parametrize(("kind", "config"), PREFERENCE_OPTIONS)
def test_preference_loss_runs_on_its_fused_loss_like_on_trl_s_own(
    kind, config, tiny_model_dir, tmp_path, head_calls, monkeypatch
):
    """DPO's, KTO's and CPO's losses from fused_linear_dpo, fused_linear_kto and fused_linear_cpo on the policy's
    hidden states, and the statistics they log (entropy, mean logits, DPO's token accuracy, CPO's NLL) from the same
    pass: the policy's head runs 0 times (liger_lab's RL head serves the reference's log-probs and KTO's KL
    completions, as many calls as TRL's head makes for them; CPO's TRL makes the logits, no head call), and every
    logged number agrees with TRL alone to 1e-5."""
    if "compact_rows" in config:
        monkeypatch.setattr("trl.trainer.utils._use_triton", lambda device: True)
    _served_both_ways(kind, tiny_model_dir, tmp_path, head_calls, **PREFERENCE_OPTIONS[kind, config])


@pytest.mark.parametrize(
    ("kind", "options", "why"),
    [
        # TRL's mask compares with vLLM's sampling log-probs, which fused_linear_grpo does not take.
        ("grpo", {"off_policy_mask_threshold": 0.5, "beta": 0.0}, "off_policy_mask_threshold"),
        # Two loss types summed (MPO's sigmoid + SFT): fused_linear_dpo computes one.
        ("dpo", {**SGD, "loss_type": ["sigmoid", "sft"], "loss_weights": [0.8, 0.2]}, "fused_linear_dpo computes one"),
    ],
)
def test_an_option_not_served_keeps_trl_s_loss_and_is_named(kind, options, why, tiny_model_dir, tmp_path, head_calls):
    """The loss stays TRL's, on liger_lab's head (every head call is the RL head's): one warning, one fallback,
    patch_report's line."""
    theirs, _, _ = _train(kind, tiny_model_dir, str(tmp_path / "trl"), patched=False, **options)
    trl_calls = head_calls["trl"]
    head_calls["trl"] = 0
    trainer = _trainer(kind, tiny_model_dir, str(tmp_path / "liger_lab"), **options)
    ours, head, messages = _run(trainer, patched=True)
    assert len(messages) == 1 and why in messages[0], messages
    assert f"{type(trainer).__name__}'s loss stays TRL's" in messages[0]
    assert head.fallbacks == 1 and head_calls == {"trl": 0, "rl_head": trl_calls, **_served_by(None, 0)}, head_calls
    assert why in liger_lab.patch_report(trainer.model).left_alone["TRL trainer"]
    _assert_same_logs(ours, theirs, tol=1e-5)


@pytest.mark.parametrize("kind", ["dpo", "kto"])
def test_dropout_with_the_reference_in_the_loop_is_named(kind, tiny_model_dir, tmp_path):
    """disable_dropout=False: the reference's forward, moved before the policy's, would draw other dropout masks, so
    the loss stays TRL's, named as the trainer is built (with the reference's log-probs precomputed it is served)."""
    head = liger_lab.patch_trl()
    try:
        with pytest.warns(UserWarning, match="loss stays TRL's: disable_dropout=False"):
            trainer = _trainer(kind, tiny_model_dir, str(tmp_path / "loop"), disable_dropout=False)
        precomputed = _trainer(kind, tiny_model_dir, str(tmp_path / "precomputed"), disable_dropout=False,
                               precompute_ref_log_probs=True)  # fmt: skip
    finally:
        liger_lab.unpatch_trl()
    assert head.fallbacks == 1
    assert "disable_dropout" in liger_lab.patch_report(trainer.model).left_alone["TRL trainer"]
    assert liger_lab.patch_report(precomputed.model).replaced[f"{type(trainer).__name__}'s loss (fused_linear_{kind})"]


def test_outputs_and_gradients_match_trl_s_head():
    from trl.kernels import ChunkedLogProbFunction

    torch.manual_seed(0)
    hidden = torch.randn(13, 16, requires_grad=True)
    weight = (0.3 * torch.randn(40, 16)).requires_grad_()
    bias = (0.1 * torch.randn(40)).requires_grad_()
    target = torch.randint(0, 40, (13,))
    upstream = torch.randn(2, 13)
    head = trl_head.LigerLabHead(ChunkedLogProbFunction)
    results = []
    for function in (ChunkedLogProbFunction, head):
        outputs = function.apply(hidden, weight, bias, target, 0.7, 32768, None, 1.0, ("log_probs", "entropy"))
        assert all(o is None for o in outputs[2:])
        grads = torch.autograd.grad((outputs[0] * upstream[0] + outputs[1] * upstream[1]).sum(), (hidden, weight, bias))
        results.append(([o.detach() for o in outputs[:2]], grads))
    assert head.calls == 1
    for ours, theirs in zip(*(torch.cat([t.flatten() for t in (*o, *g)]) for o, g in results), strict=True):
        assert math.isclose(ours, theirs, rel_tol=1e-4, abs_tol=1e-5)


@pytest.mark.parametrize(("softcap", "logit_scale"), [(None, 1.0), (3.0, 0.7), (None, 0.25)])
def test_every_output_of_trl_s_head_and_its_gradients_come_from_ours(softcap, logit_scale):
    """All five outputs (the statistics TRL's SFT, DPO and KTO log included), soft-capped or scaled logits (Gemma 2,
    Cohere, Granite), with targets that are their row's argmax half of the time: TRL's head never runs."""
    from trl.kernels import ChunkedLogProbFunction

    torch.manual_seed(0)
    hidden = torch.randn(13, 16, requires_grad=True)
    weight = (0.3 * torch.randn(40, 16)).requires_grad_()
    bias = (0.1 * torch.randn(40)).requires_grad_()
    target = torch.randint(0, 40, (13,))
    target[::2] = torch.nn.functional.linear(hidden, weight, bias).argmax(-1)[::2]
    upstream = torch.randn(2, 13)
    head = trl_head.LigerLabHead(ChunkedLogProbFunction)
    names = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
    results = []
    for function in (ChunkedLogProbFunction, head):
        outputs = function.apply(hidden, weight, bias, target, 0.7, 32768, softcap, logit_scale, names)
        assert not outputs[2].requires_grad  # a statistic, as in TRL
        grads = torch.autograd.grad((outputs[0] * upstream[0] + outputs[1] * upstream[1]).sum(), (hidden, weight, bias))
        results.append(([o.detach() for o in outputs], grads))
    assert (head.calls, head.fallbacks) == (1, 0)
    (theirs, their_grads), (ours, our_grads) = results
    assert torch.equal(ours[4], theirs[4]) and 0 < int(ours[4].sum()) < 13
    for mine, expected in zip([*ours[:4], *our_grads], [*theirs[:4], *their_grads], strict=True):
        torch.testing.assert_close(mine, expected, rtol=1e-4, atol=1e-5)


def test_patch_trl_twice_and_unpatch_restore_trl_s_head():
    from trl.trainer import utils

    original = utils._ChunkedLogProbFunction
    head = liger_lab.patch_trl()
    try:
        assert liger_lab.patch_trl() is head and utils._ChunkedLogProbFunction is head
    finally:
        liger_lab.unpatch_trl()
    assert utils._ChunkedLogProbFunction is original
    liger_lab.unpatch_trl()  # nothing to undo
    assert utils._ChunkedLogProbFunction is original


def test_reference_model_gets_the_policy_s_patch(tiny_model_dir, tmp_path):
    """DPO loads its reference model from the policy's path: a policy patched as an object gets a reference patched
    the same way, so both compute alike (the first DPO loss is log 2), and patch_report says whose head runs."""
    policy = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    liger_lab.patch(policy, rope=False)
    head = liger_lab.patch_trl()
    try:
        trainer = _trainer("dpo", tiny_model_dir, str(tmp_path), model=policy)
        assert liger_lab.hf.api.patch_options(trainer.ref_model) == liger_lab.hf.api.patch_options(policy)
        assert liger_lab.hf.api.patch_options(policy)["rope"] is False
        report = liger_lab.patch_report(trainer.model)
        assert report.replaced["LM head under TRL (fused_linear_logprobs)"] == 1
        assert "loss (fused linear cross-entropy)" not in report.replaced
        trainer.train()
    finally:
        liger_lab.unpatch_trl()
    first = next(row for row in trainer.state.log_history if "loss" in row)
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-7)
    assert head.calls > 0 and head.fallbacks == 0
    assert "LM head under TRL" in liger_lab.patch_report(trainer.model).left_alone  # TRL's own head is back


@pytest.fixture(scope="module")
def teacher_dir(tiny_model_dir, tmp_path_factory):
    """Another random tiny Llama of the same vocabulary, so that the divergence is not 0."""
    torch.manual_seed(1)
    config = transformers.AutoConfig.from_pretrained(tiny_model_dir)
    folder = tmp_path_factory.mktemp("tiny-teacher")
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    transformers.AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(folder)
    return str(folder)


def _distiller(kind, student, teacher_dir, output_dir):
    """A DistillationTrainer (on-policy: the student generates) or a GKDTrainer (lmbda 0: on the dataset's
    completions, no generation) with beta 0.5, the generalized JSD."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(teacher_dir)
    common = dict(
        output_dir=output_dir, max_steps=STEPS, per_device_train_batch_size=2, report_to=[], logging_steps=1,
        use_cpu=True, save_strategy="no", learning_rate=1e-3, bf16=False, seed=0, beta=0.5,
    )  # fmt: skip
    if kind == "distillation":
        args = trl.DistillationConfig(**common, max_completion_length=4, temperature=0.8)
        data = datasets.Dataset.from_dict({"prompt": [_text(i, 3) for i in range(8)]})
        return trl.DistillationTrainer(
            student, teacher_model=teacher_dir, args=args, train_dataset=data, processing_class=tokenizer
        )
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    tokenizer.chat_template = "{% for message in messages %}{{ message['content'] }} {% endfor %}"
    turns = [
        [{"role": "user", "content": _text(i, 3)}, {"role": "assistant", "content": _text(i + 1, 4)}] for i in range(8)
    ]
    data = datasets.Dataset.from_dict({"messages": turns})
    args = GKDConfig(**common, lmbda=0.0, max_new_tokens=4)
    return GKDTrainer(student, teacher_model=teacher_dir, args=args, train_dataset=data, processing_class=tokenizer)


@pytest.fixture
def trl_divergence_calls(monkeypatch):
    """Calls of TRL's own divergences: the chunked one (DistillationTrainer) and GKD's on full logits."""
    from trl.experimental.gkd import GKDTrainer
    from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

    calls = []
    for owner, name in ((ChunkedDivergenceFunction, "forward"), (GKDTrainer, "generalized_jsd_loss")):
        function = getattr(owner, name)

        def counted(*args, function=function, name=name, **kwargs):
            calls.append(name)
            return function(*args, **kwargs)

        monkeypatch.setattr(owner, name, staticmethod(counted))
    return calls


def _distill(kind, student, teacher_dir, output_dir, *, patched):
    head = liger_lab.patch_trl() if patched else None
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer = _distiller(kind, student, teacher_dir, output_dir)
            trainer.train()
    finally:
        liger_lab.unpatch_trl()
    messages = [str(w.message) for w in caught if "liger_lab" in str(w.message)]
    return [row for row in trainer.state.log_history if "loss" in row], trainer, head, messages


@pytest.mark.parametrize("kind", ["distillation", "gkd"])
def test_distillation_runs_on_fused_linear_jsd_like_on_trl_s_own(
    kind, tiny_model_dir, teacher_dir, tmp_path, trl_divergence_calls
):
    """The divergence (and DistillationTrainer's logged entropy) from liger_lab's fused JSD: TRL's divergences run 0
    times, the student's head is never called for logits in training, and every logged number agrees with TRL's."""
    theirs, _, _, _ = _distill(kind, tiny_model_dir, teacher_dir, str(tmp_path / "trl"), patched=False)
    assert len(trl_divergence_calls) >= STEPS
    trl_divergence_calls.clear()
    student = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    head_calls = []
    student.lm_head.register_forward_hook(lambda *_: head_calls.append(1))  # GKD generates nothing here: a call
    ours, trainer, head, messages = _distill(kind, student, teacher_dir, str(tmp_path / "liger_lab"), patched=True)
    # would be logits made for the loss (DistillationTrainer's student generates its completions: it calls its head)
    assert trl_divergence_calls == [] and (kind == "distillation" or head_calls == [])
    assert (head.calls, head.fallbacks, messages) == (STEPS, 0, [])
    assert len(ours) == len(theirs) == STEPS
    for step, (our_row, their_row) in enumerate(zip(ours, theirs, strict=True), 1):
        assert our_row.keys() == their_row.keys()
        assert abs(our_row["loss"] - their_row["loss"]) < 1e-5, step
        for name in our_row.keys() - UNCOMPARED:
            assert math.isclose(our_row[name], their_row[name], rel_tol=METRIC_TOL, abs_tol=1e-7), (step, name)
    name = "DistillationTrainer's divergence" if kind == "distillation" else "GKDTrainer's generalized JSD"
    assert liger_lab.patch_report(trainer.model).replaced[f"{name} (fused_linear_jsd)"] == 1


@pytest.mark.parametrize("kind", ["distillation", "gkd"])
def test_an_option_not_served_keeps_trl_s_divergence_and_is_named(
    kind, tiny_model_dir, teacher_dir, tmp_path, trl_divergence_calls
):
    """A student whose lm_head has a bias: fused_linear_jsd takes none, so TRL's own divergence runs, named in one
    warning, one fallback and patch_report."""
    student = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        biased = torch.nn.Linear(student.config.hidden_size, student.config.vocab_size)
        biased.weight.copy_(student.lm_head.weight)
    student.lm_head = biased
    _, trainer, head, messages = _distill(kind, student, teacher_dir, str(tmp_path), patched=True)
    assert len(messages) == 1 and "lm_head has a bias" in messages[0] and "loss stays TRL's" in messages[0]
    assert head.fallbacks == 1 and head.calls == 0 and len(trl_divergence_calls) >= STEPS
    assert "lm_head has a bias" in liger_lab.patch_report(trainer.model).left_alone["TRL trainer"]


def test_a_trainer_whose_loss_is_not_served_is_named(tiny_model_dir, tmp_path):
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    student = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    liger_lab.patch(student)
    head = liger_lab.patch_trl()
    try:
        args = ORPOConfig(output_dir=str(tmp_path), max_steps=1, report_to=[], use_cpu=True, bf16=False)
        prompts = [_text(i, 3) for i in range(4)]
        data = datasets.Dataset.from_dict({"prompt": prompts, "chosen": prompts, "rejected": prompts})
        tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
        with pytest.warns(UserWarning, match="ORPOTrainer's loss stays TRL's"):
            trainer = ORPOTrainer(student, args=args, train_dataset=data, processing_class=tokenizer)
    finally:
        liger_lab.unpatch_trl()
    assert head.fallbacks == 1
    assert "full logits" in liger_lab.patch_report(trainer.model).left_alone["TRL trainer"]


def test_patch_report_under_trl_names_what_runs(tiny_model_dir):
    """Under TRL's head a never-patched model is reported as not patched (not as pieces switched off), and a head PEFT
    trains as a copy (``modules_to_save``) is not reported as materialising the logits while liger_lab's head serves
    every call."""
    peft = pytest.importorskip("peft")
    from trl.trainer.utils import add_fused_lm_head

    head = liger_lab.patch_trl()
    try:
        plain = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        add_fused_lm_head(plain)
        report = liger_lab.patch_report(plain)
        assert report.left_alone.keys() == {"the whole model"}
        assert report.left_alone["the whole model"].startswith("not patched")
        assert report.replaced == {"LM head under TRL (fused_linear_logprobs)": 1}

        policy = liger_lab.patch(transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir))
        add_fused_lm_head(policy)
        lora = peft.LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"])
        model = peft.get_peft_model(policy, lora)
        input_ids = torch.randint(3, 64, (2, 6))
        model(input_ids=input_ids, labels=input_ids, fused_lm_head=True).loss.backward()
        report = liger_lab.patch_report(model)
    finally:
        liger_lab.unpatch_trl()
    assert head.calls == 1 and policy.lm_head.modules_to_save["default"].weight.grad.norm() > 0
    assert report.replaced["LM head under TRL (fused_linear_logprobs)"] == 1
    assert "materialised" not in report.left_alone.get("loss", "")
