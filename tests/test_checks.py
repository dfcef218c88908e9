import torch

from liger_lab import checks


def test_check_close_reports_pass_fail_and_collects_the_error(capsys):
    errors = []
    expected = torch.tensor([1.0, 2.0, 2.0])
    assert checks.check_close("same", expected.clone(), expected, errors=errors)
    assert not checks.check_close("off", expected + 1.0, expected, tol=1e-5, errors=errors)
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("PASS same") and out[1].startswith("FAIL off")
    assert errors[0] == 0.0 and abs(errors[1] - 3**0.5 / 3) < 1e-12


def test_check_against_reference_collects_output_and_gradient_errors():
    errors = []
    x = torch.randn(5, 7)
    assert checks.check_against_reference("tanh", torch.tanh, torch.tanh, [x], input_names=["x"], errors=errors)
    assert len(errors) == 2 and max(errors) < 1e-6
    assert not checks.check_against_reference("wrong", torch.tanh, torch.sin, [x], input_names=["x"])


def test_a_reference_below_the_dtype_counts_as_its_zeros(capsys):
    # A one-hot softmax leaves gradients of about 1e-86: float32's zeros. Anything float32 can hold still counts.
    zeros = torch.zeros(8)
    assert checks.check_close("underflow", zeros, torch.full((8,), 1e-86, dtype=torch.float64))
    assert "below the smallest normal" in capsys.readouterr().out
    assert not checks.check_close("too large", torch.full((8,), 1e-30), torch.full((8,), 1e-86, dtype=torch.float64))
    assert not checks.check_close("representable", zeros, torch.full((8,), 1e-30, dtype=torch.float64))


class _IgnoresUpstream(torch.autograd.Function):
    # x.sum() whose backward assumes loss.backward() was called with a gradient of 1.
    @staticmethod
    def forward(ctx, x):
        return x.sum()

    @staticmethod
    def backward(ctx, grad):
        return torch.ones(1).expand(3)


def test_a_backward_that_ignores_its_upstream_gradient_fails_every_time(capsys):
    x = torch.randn(3)
    for _ in range(50):
        assert not checks.check_against_reference("ignores", _IgnoresUpstream.apply, torch.sum, [x])


def test_the_upstream_gradient_keeps_half_precision_gradients_normal():
    # A scalar loss of 8 x 500 fp16 logits has gradients near 1/4000; a standard normal upstream of 0.01 (one
    # draw in a hundred) would put them all below fp16's smallest normal number, 6.1e-5.
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        upstream = torch.stack([checks._upstream_gradient_like(torch.zeros((), dtype=dtype)) for _ in range(2000)])
        assert upstream.dtype == dtype
        assert upstream.abs().min() >= 1.25 and upstream.abs().max() <= 2.0
        assert (upstream > 0).any() and (upstream < 0).any()
