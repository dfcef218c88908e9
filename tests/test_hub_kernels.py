"""The Hub-kernels route (``use_kernels=True``): liger_lab's layers through the ``kernels`` package, offline.

In this process the ``kernels`` package kernelizes tiny models directly (transformers' classes marked by hand where
transformers' own integration is off); in a subprocess, transformers' ``from_pretrained(..., use_kernels=True)`` and
TRL's ``model_init_kwargs={"use_kernels": True}`` load a saved tiny model with liger_lab's layers after
``liger_lab.hf.hub_kernels.register()``."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from helpers import OpCalls
from test_patching import assert_same_training_step, batch, loss_and_grads, tiny_model

import liger_lab
from liger_lab.hf import hub_kernels
from liger_lab.hf.families import modeling_of
from liger_lab.workbook.checks import relative_l2_error

kernels = pytest.importorskip("kernels")
transformers = pytest.importorskip("transformers")

# transformers' classes and the layer names it gives them, marked here when its kernels integration is off
MARKED = {"llama": {"LlamaRMSNorm": "RMSNorm", "LlamaMLP": "SwiGLUMLP"}, "gemma": {"GemmaRMSNorm": "RMSNorm"},
          "olmo2": {"Olmo2RMSNorm": "RMSNorm"}}  # fmt: skip


@pytest.fixture
def marked():
    """Mark the classes of :data:`MARKED` as transformers does with its integration on, and unmark them after."""
    added = []
    for model_type, classes in MARKED.items():
        modeling = modeling_of(model_type)
        for name, layer_name in classes.items():
            cls = getattr(modeling, name)
            if getattr(cls, "kernel_layer_name", None) is None:
                kernels.replace_kernel_forward_from_hub(cls, layer_name)
                added.append(cls)
    yield
    for cls in added:
        del cls.kernel_layer_name, cls.kernel_condition


def _kernelized(model, mode):
    """``model`` kernelized with liger_lab's mapping alone. A layer name it maps must load liger_lab's layer (no
    fallback); names it does not map (``rotary_pos_emb`` and ``SiLU``, which transformers marks and ``kernels``
    0.19 kernelizes too) keep transformers' forward."""
    with kernels.use_kernel_mapping(hub_kernels.kernel_mapping(), inherit_mapping=False):
        return kernels.kernelize(model, mode=mode, device="cpu", use_fallback=kernels.KernelizeFallback.NO_LAYER)


@pytest.mark.parametrize("model_type", sorted(MARKED))
def test_kernelized_training_step_matches_transformers(model_type, marked):
    reference = tiny_model(model_type)
    model = _kernelized(copy.deepcopy(reference).train(), kernels.Mode.TRAINING)
    input_ids, labels = batch()
    with OpCalls() as calls:
        assert_same_training_step(model, reference, input_ids, labels)
    ran = {name.removeprefix("liger_lab::").rstrip("_") for name in calls.counts}
    assert {"rms_norm", "rms_norm_backward"} <= ran
    assert ("glu" in ran) == (model_type == "llama")  # the MLP where a layer name marks it


def test_kernelized_model_trains_under_torch_compile(marked):
    torch.manual_seed(0)
    reference = tiny_model("llama")
    model = _kernelized(copy.deepcopy(reference).train(), kernels.Mode.TRAINING | kernels.Mode.TORCH_COMPILE)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager")
    input_ids, labels = batch()
    for _ in range(2):  # the second step runs the compiled graph
        ours, our_grads = loss_and_grads(compiled, input_ids, labels)
        theirs, their_grads = loss_and_grads(reference, input_ids, labels)
        assert relative_l2_error(ours.loss, theirs.loss) < 1e-5
        for name, grad in their_grads.items():
            assert relative_l2_error(our_grads[f"_orig_mod.{name}"], grad) < 1e-4, name


def test_a_norm_of_no_family_runs_its_own_forward(marked):
    class OtherNorm(torch.nn.Module):  # a class no family row names: liger_lab does not know its formula
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(8))

        def forward(self, x):
            return 2 * x * self.weight

    kernels.replace_kernel_forward_from_hub(OtherNorm, "RMSNorm")
    model = _kernelized(OtherNorm(), kernels.Mode.INFERENCE)
    assert model.forward.__func__ is hub_kernels.layers.RMSNorm.forward  # kernelized, yet its own formula ran
    x = torch.randn(3, 8)
    assert torch.equal(model(x), 2 * x)


def test_layers_are_what_the_kernels_package_accepts():
    mapping = hub_kernels.kernel_mapping()
    assert set(mapping) == {"RMSNorm", "SwiGLUMLP", "GeGLUMLP"} and set(mapping["RMSNorm"]) == {"cuda", "cpu"}
    repo = mapping["RMSNorm"]["cpu"][kernels.Mode.TRAINING]
    assert repo.load() is hub_kernels.layers.RMSNorm and repo == hub_kernels.InstalledLayer("RMSNorm")
    with pytest.raises(ValueError, match="expected one of"):
        hub_kernels.InstalledLayer("LayerNorm")


def test_use_liger_kernel_in_training_arguments_patches_with_liger_lab(tmp_path, monkeypatch):
    import transformers.trainer

    monkeypatch.setattr(transformers.trainer, "apply_liger_kernel", transformers.trainer.apply_liger_kernel)
    hub_kernels.serve_use_liger_kernel()
    model = tiny_model("llama")
    input_ids, labels = batch()
    data = [{"input_ids": ids, "labels": target} for ids, target in zip(input_ids, labels, strict=True)]
    args = transformers.TrainingArguments(
        str(tmp_path), use_liger_kernel=True, liger_kernel_config={"rope": False}, max_steps=1,
        per_device_train_batch_size=2, use_cpu=True, report_to=[],
    )  # fmt: skip
    transformers.Trainer(model, args=args, train_dataset=data).train()
    report = liger_lab.patch_report(model)
    assert report.replaced["RMSNorm"] > 0 and "attention (RoPE)" not in report.replaced
    liger_lab.unpatch(model)


# transformers enables its kernels integration for one minor release of kernels (5.24: 0.18.x, 5.25: 0.19.x); the
# installed one may be another, whose layer API is the same: the subprocess then lifts the version check before
# transformers imports its integration (a no-op where a supported version is installed).
_USE_KERNELS = """
import liger_lab
import transformers.utils as utils, transformers.utils.import_utils as import_utils
import_utils.is_kernels_available = utils.is_kernels_available = lambda *args, **kwargs: True
import sys, torch, transformers
sys.path.insert(0, {tests!r})
from helpers import OpCalls
from test_patching import batch, tiny_model
from liger_lab.hf import hub_kernels

folder = {folder!r}
tiny_model("llama").save_pretrained(folder)
hub_kernels.register()
model = transformers.AutoModelForCausalLM.from_pretrained(folder, use_kernels=True).train()
reference = transformers.AutoModelForCausalLM.from_pretrained(folder).train()
input_ids, labels = batch()
with OpCalls() as calls:
    loss = model(input_ids=input_ids, labels=labels).loss
    loss.backward()
assert "liger_lab::rms_norm" in calls.counts, calls.counts
expected = reference(input_ids=input_ids, labels=labels).loss
assert torch.allclose(loss, expected, rtol=1e-5), (loss, expected)
hub_kernels.unregister()
plain = transformers.AutoModelForCausalLM.from_pretrained(folder, use_kernels=True)
assert plain.model.norm.forward.__func__ is not hub_kernels.layers.RMSNorm.forward
print("transformers ok")
"""

_TRL = """
import trl
from trl.trainer.sft_trainer import SFTTrainer
hub_kernels.register()
args = trl.SFTConfig(output_dir={folder!r} + "/out", max_steps=1, per_device_train_batch_size=2, report_to=[],
                     use_cpu=True, model_init_kwargs={{"use_kernels": True}})
tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=__import__("tokenizers").Tokenizer(
    __import__("tokenizers").models.WordLevel({{w: i for i, w in enumerate(["<pad>", "<eos>", "a", "b", "c"])}},
    unk_token="a")), pad_token="<pad>", eos_token="<eos>")
from datasets import Dataset
data = Dataset.from_dict({{"text": ["a b c a b", "c b a c", "a a b c", "b c a b"]}})
trainer = SFTTrainer(folder, args=args, train_dataset=data, processing_class=tokenizer)
assert trainer.model.model.norm.forward.__func__ is hub_kernels.layers.RMSNorm.forward
with OpCalls() as calls:
    trainer.train()
assert "liger_lab::rms_norm_backward" in calls.counts, calls.counts
print("trl ok")
"""


def test_use_kernels_in_transformers_and_trl_loads_liger_lab_s_layers(tmp_path):
    tests = os.path.dirname(os.path.abspath(__file__))
    script = _USE_KERNELS.format(tests=tests, folder=str(tmp_path)) + textwrap.dedent(_TRL.format(folder=str(tmp_path)))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join([os.path.dirname(tests), tests])}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "transformers ok" in result.stdout and "trl ok" in result.stdout
