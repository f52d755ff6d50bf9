"""aten_override.testing.mutants: each mutant is a backend the CLI loads, and breaks the reference.

Whether the shipped suite catches each is scripts/mutation_check.py's question
(tests/scripts/test_mutation_check.py, slow); here, cheaply, that every mutant does differ from the
reference on a call made for its bug, so a mutant that silently became correct cannot count as
caught.
"""

import pytest
import torch

from aten_override.testing.comparison import call_backend, call_native, check_against_native
from aten_override.testing.example_backends import from_forward_convolutions
from aten_override.testing.fuzz import layout_cases, value_cases
from aten_override.testing.mutants import CONTROL, MUTANTS
from aten_override.testing.selection import backend_from_spec


def test_at_least_20_mutants_with_names_the_test_summary_can_tell_apart():
    assert len(MUTANTS) >= 20
    names = list(MUTANTS) + [CONTROL.rpartition(":")[2]]
    # the CLI's summary finds a test's backend as "_<name>_" in the test name
    assert not [(a, b) for a in names for b in names if a != b and f"_{a}_" in f"_{b}_"]
    assert all(description for description in MUTANTS.values())


def _calls():
    g = torch.Generator().manual_seed(0)

    def randn(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)

    # (grad_output, input, weight, bias_sizes, stride, padding, dilation, transposed, output_padding, groups, output_mask)
    yield "grouped-strided", (randn(2, 6, 4, 4), randn(2, 4, 7, 9), randn(6, 2, 3, 2), [6], [2, 2], [1, 0], [1, 2],
                              False, [0, 0], 2, [True, True, True])
    yield "transposed-output_padding", (randn(2, 4, 10, 10), randn(2, 6, 4, 4), randn(6, 2, 3, 2), [4], [2, 2], [1, 1],
                                        [2, 3], True, [1, 2], 2, [True, True, True])
    yield "masked", (randn(2, 4, 3, 3), randn(2, 2, 5, 5), randn(4, 2, 3, 3), [4], [1, 1], [0, 0], [1, 1], False,
                     [0, 0], 1, [False, True, False])
    for case in layout_cases() + value_cases():
        yield f"fixed-{list(case.input.shape)}-{case.dtype}", case.aten_args()


@pytest.mark.parametrize("name", list(MUTANTS))
def test_mutant_breaks_the_reference_somewhere(name):
    mutant = backend_from_spec(f"aten_override.testing.mutants:{name}")
    for label, args in _calls():
        reference = from_forward_convolutions(*args)
        check_against_native(reference, call_native(args), output_mask=args[-1], where=label)  # a valid call
        try:
            check_against_native(call_backend(mutant, args), reference, output_mask=args[-1])
        except (AssertionError, RuntimeError):
            return
    raise AssertionError(f"{name} ({MUTANTS[name]}) computes what the reference computes on every call")
