import pytest
import torch
from helpers import check_op, non_contiguous, randn, row_strided

import liger_lab
from liger_lab import reference, runtime
from liger_lab.nn import RMSNorm
from liger_lab.workbook.checks import check_against_reference, relative_l2_error


@pytest.mark.parametrize("shape", [(8, 64), (1, 37), (5, 1000), (3, 7, 96), (130, 33), (2, 1, 4099)])
@pytest.mark.parametrize("casting_mode,offset", [("llama", 0.0), ("gemma", 1.0), ("llama", 0.5)])
def test_matches_float64_fp32(shape, casting_mode, offset):
    x = randn(*shape)
    w = randn(shape[-1], scale=0.5)
    assert check_op("rms_norm", x, w, casting_mode=casting_mode, offset=offset)


@pytest.mark.parametrize("casting_mode,offset", [("llama", 0.0), ("gemma", 1.0)])
def test_fp16(casting_mode, offset):
    assert check_op(
        "rms_norm",
        randn(33, 257, dtype=torch.float16),
        randn(257, dtype=torch.float16),
        casting_mode=casting_mode,
        offset=offset,
    )


@pytest.mark.parametrize("layout", [non_contiguous, row_strided, lambda x: x.transpose(0, 1)])
def test_non_contiguous_input(layout):
    x = layout(randn(24, 48))
    assert not x.is_contiguous()
    assert check_op("rms_norm", x, randn(x.shape[-1]))


def test_transposed_heads_keep_their_memory_layout():
    # Gemma 3 normalises q_proj(h).view(B, T, H, D).transpose(1, 2): dense rows in another order. The output keeps
    # that layout, as PyTorch's elementwise ops do (a contiguous one costs a copy before o_proj, kept for backward).
    def heads(x):
        return x.transpose(1, 2)

    layouts = []

    def ours(x, w):
        y = liger_lab.rms_norm(heads(x), w, 1e-6, offset=1.0, casting_mode="gemma")
        layouts.append((y.stride(), heads(x).stride()))
        return y

    def theirs(x, w):
        return reference.rms_norm(heads(x), w, 1e-6, offset=1.0, casting_mode="gemma")

    x, w = randn(2, 5, 3, 16), randn(16)
    assert check_against_reference("rms_norm", ours, theirs, [x, w], input_names=["x", "weight"])
    assert layouts and all(y_strides == x_strides for y_strides, x_strides in layouts)


def test_strided_weight():
    assert check_op("rms_norm", randn(6, 40), non_contiguous(randn(40)))


def test_mixed_precision_llama_promotes_like_hugging_face():
    x, w = randn(4, 64, dtype=torch.float16), randn(64)
    y = liger_lab.rms_norm(x, w)
    assert y.dtype == torch.float32 == reference.rms_norm(x, w).dtype
    assert relative_l2_error(y, reference.rms_norm(x.double(), w.double())) < 1e-3
    assert liger_lab.rms_norm(x, w.half(), casting_mode="gemma").dtype == torch.float16


def test_in_place_backward_gives_the_same_gradients():
    x, w, upstream = randn(16, 80), randn(80), randn(16, 80)
    grads = []
    for in_place in (False, True):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        liger_lab.rms_norm(xi, wi, in_place_backward=in_place).backward(upstream.clone())
        grads.append((xi.grad, wi.grad))
    torch.testing.assert_close(grads[0][0], grads[1][0])
    torch.testing.assert_close(grads[0][1], grads[1][1])


def test_zero_rows_and_zero_input():
    empty = liger_lab.rms_norm(randn(0, 16), randn(16))
    assert empty.shape == (0, 16)
    x = torch.zeros(3, 16, device=runtime.DEVICE, requires_grad=True)
    y = liger_lab.rms_norm(x, randn(16))
    y.sum().backward()
    assert torch.isfinite(y).all() and torch.isfinite(x.grad).all()


def test_module_is_a_drop_in_for_llama_rms_norm():
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    theirs = LlamaRMSNorm(96, eps=1e-5).to(runtime.DEVICE)
    with torch.no_grad():
        theirs.weight.normal_()
    ours = RMSNorm(96, eps=1e-5, device=runtime.DEVICE)
    ours.load_state_dict(theirs.state_dict())
    assert set(ours.state_dict()) == set(theirs.state_dict()) == {"weight"}
    x = randn(2, 5, 96)
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-5, atol=1e-5)
    del transformers


def test_gemma_module_starts_at_identity_scale():
    norm = RMSNorm(32, offset=1.0, casting_mode="gemma", device=runtime.DEVICE)
    x = randn(3, 32)
    torch.testing.assert_close(norm(x), reference.rms_norm(x, torch.ones(32, device=x.device)))


@pytest.mark.parametrize(
    "x,w,kwargs,message",
    [
        (lambda: randn(4, 64), lambda: randn(63), {}, "weight has shape"),
        (lambda: randn(4, 64), lambda: randn(4, 64), {}, "weight has shape"),
        (lambda: randn(4, 64).double(), lambda: randn(64), {}, "torch.float64"),
        (lambda: torch.arange(8).reshape(2, 4), lambda: randn(4), {}, "dtype"),
        (lambda: randn(4, 64), lambda: randn(64), {"casting_mode": "mistral"}, "casting_mode"),
        (lambda: randn(4, 64), lambda: randn(64), {"eps": -1.0}, "eps"),
        (lambda: randn(4, 100_000), lambda: randn(100_000), {}, "at most"),
    ],
)
def test_bad_input_is_a_value_error(x, w, kwargs, message):
    with pytest.raises(ValueError, match=message):
        liger_lab.rms_norm(x(), w(), **kwargs)


@pytest.mark.skipif(runtime.INTERPRET, reason="on a GPU run, CPU tensors are the wrong device")
def test_cpu_tensor_on_gpu_run_is_a_value_error():
    with pytest.raises(ValueError, match="expected a CUDA tensor"):
        liger_lab.rms_norm(torch.randn(4, 8), torch.ones(8, device="cuda"))


@pytest.mark.skipif(not runtime.INTERPRET, reason="only in the interpreter are CUDA tensors the wrong device")
def test_interpreter_rejects_non_cpu_tensors():
    meta = torch.empty(4, 8, device="meta")
    with pytest.raises(ValueError, match="expected a CPU tensor"):
        liger_lab.rms_norm(meta, torch.ones(8))


@pytest.mark.cuda
@pytest.mark.parametrize("shape", [(4096, 4096), (3, 77, 2048), (1, 128), (513, 5120)])
@pytest.mark.parametrize("casting_mode,offset", [("llama", 0.0), ("gemma", 1.0)])
def test_bf16_on_gpu(shape, casting_mode, offset):
    x = randn(*shape, dtype=torch.bfloat16)
    w = (1 + 0.1 * randn(shape[-1])).to(torch.bfloat16)
    assert check_op("rms_norm", x, w, casting_mode=casting_mode, offset=offset)
