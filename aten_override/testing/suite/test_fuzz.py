r"""Differential fuzzing: random valid ``convolution_backward`` calls, each backend against the
original kernel (values against float64, dtypes, shapes, strides). See
:mod:`aten_override.testing.fuzz`; a failure prints a shrunk, copy-pasteable reproduction.
"""

from __future__ import annotations

from hypothesis import example, given, note

from aten_override.testing._upstream import TestCase, instantiate_device_type_tests, parametrize
from aten_override.testing.comparison import compare_with_native, expected_server, served_by
from aten_override.testing.fuzz import convolution_backward_cases, fuzz_settings, layout_cases, value_cases
from aten_override.testing.selection import backends_under_test, test_name

BACKENDS = backends_under_test()
backend_parametrize = parametrize("backend", BACKENDS, name_fn=test_name)


class TestConvolutionBackwardFuzz(TestCase):
    @backend_parametrize
    def test_matches_native(self, device, backend):
        def check(case):
            note("Reproduction:\n" + case.reproduction(backend))
            aten_args = case.aten_args()
            server, _ = expected_server(backend, aten_args)
            with served_by(backend, {server: 1}):
                compare_with_native(backend, aten_args)

        # The fixed cases first, whatever the seed; then the random draws.
        for case in reversed(layout_cases(device) + value_cases(device)):
            check = example(case=case)(check)
        fuzz_settings()(given(case=convolution_backward_cases(device))(check))()


instantiate_device_type_tests(TestConvolutionBackwardFuzz, globals())

if __name__ == "__main__":
    from aten_override.testing._upstream import run_tests

    run_tests()
