r"""``aten.convolution_backward`` OpInfo tests: every backend against the original kernel.

Upstream style: ``instantiate_device_type_tests`` (CPU, CUDA when present) x ``@ops(op_db)`` x
backend. Test names read ``test_<what>_<backend>_convolution_backward_<variant>_<device>_<dtype>``.
"""

from __future__ import annotations

import re

import torch

from aten_override import active_backend
from aten_override.backends import ATEN_IMPL
from aten_override.testing._upstream import OpDTypes, TestCase, instantiate_device_type_tests, ops, parametrize
from aten_override.testing.comparison import call_backend, compare_with_native, expected_server, served_by
from aten_override.testing.opinfo import op_db
from aten_override.testing.selection import backends_under_test, test_name
from aten_override.testing.skips import SKIPS

BACKENDS = backends_under_test()
backend_parametrize = parametrize("backend", BACKENDS, name_fn=test_name)


class TestConvolutionBackward(TestCase):
    """Samples derived from upstream's conv OpInfos, all 8 output_masks, each dtype."""

    @backend_parametrize
    @ops(op_db)
    def test_matches_native(self, device, dtype, op, backend):
        samples = list(op.sample_inputs(device, dtype))
        expected: dict[str, int] = {}
        reasons = set()
        for sample in samples:
            server, reason = expected_server(backend, (sample.input, *sample.args))
            expected[server] = expected.get(server, 0) + 1
            reasons.add(reason)
        if backend.name not in expected:
            self.skipTest(SKIPS["all_fallback"].format(backend=backend.name, reasons="; ".join(sorted(reasons))))
        with served_by(backend, expected):
            for sample in samples:
                aten_args = (sample.input, *sample.args)
                before = [t.clone() for t in aten_args[:3]]
                compare_with_native(backend, aten_args, where=sample.name)
                for name, b, t in zip(("grad_output", "input", "weight"), before, aten_args):
                    self.assertTrue(torch.equal(b, t), msg=f"{sample.name}: {name} was mutated")

    @backend_parametrize
    @ops(op_db, dtypes=OpDTypes.none)
    def test_errors(self, device, op, backend):
        previous = active_backend()
        for error_input in op.error_inputs(device):
            sample = error_input.sample_input
            aten_args = (sample.input, *sample.args)
            with self.subTest(error_input.name):
                # A backend may hand a call to the original kernel (auto does, for one): then
                # upstream's error is the expected one.
                server, _ = expected_server(backend, aten_args)
                if server == ATEN_IMPL.name:
                    if error_input.native_error_regex is None:
                        self.skipTest(SKIPS["native_unchecked"].format(gap=error_input.native_gap))
                    regex = error_input.native_error_regex
                else:
                    regex = rf"convolution_backward\[{re.escape(server)}\]: .*{error_input.error_regex}"
                with self.assertRaisesRegex(error_input.error_type, regex):
                    call_backend(backend, aten_args)
                self.assertEqual(active_backend(), previous, msg="a failing backend left the dispatcher changed")


instantiate_device_type_tests(TestConvolutionBackward, globals())

if __name__ == "__main__":
    from aten_override.testing._upstream import run_tests

    run_tests()
