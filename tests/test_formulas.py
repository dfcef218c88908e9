"""The options of :mod:`liger_lab.formulas` default as the public functions do: the float64 references take their
options as keywords and leave the defaults to these objects, so a default that drifted would hold a kernel against
another call than the one made."""

import inspect

import pytest

import liger_lab
from liger_lab import formulas


def _defaults(function) -> dict[str, object]:
    parameters = inspect.signature(function).parameters.values()
    return {p.name: p.default for p in parameters if p.default is not inspect.Parameter.empty}


@pytest.mark.parametrize(
    ("function", "options"),
    [
        ("cross_entropy", formulas.LossOptions),
        ("jsd", formulas.JSDOptions),
        ("fused_linear_dpo", formulas.dpo_options),
        ("fused_linear_orpo", formulas.orpo_options),
        ("fused_linear_simpo", formulas.simpo_options),
        ("fused_linear_cpo", formulas.cpo_options),
        ("fused_linear_kto", formulas.kto_options),
        ("fused_linear_grpo", formulas.grpo_options),
        ("fused_linear_grpo", formulas.TRLOptions),
    ],
)
def test_options_default_as_the_public_function(function, options):
    public, ours = _defaults(getattr(liger_lab, function)), _defaults(options)
    assert ours
    assert {name: public.get(name, "missing") for name in ours} == ours
