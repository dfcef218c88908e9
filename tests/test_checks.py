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
