r"""PyTorch's gradient checks over upstream's conv OpInfos, with a backend serving the backward.

``TestGradients`` helpers from ``torch.testing._internal.common_utils``, as upstream's
test/test_ops_gradients.py and test/test_ops_fwd_gradients.py use them, on the six
``nn.functional.conv*`` / ``conv_transpose*`` OpInfos of torch's own ``op_db``, float64:

- ``test_fn_grad``: ``gradcheck`` (reverse mode; batched grad, which runs our kernel under vmap);
- ``test_fn_gradgrad``: ``gradgradcheck`` (the double backward re-enters ``convolution_backward``);
- ``test_fn_fwgrad_bwgrad``: forward-over-reverse (the jvp of ``convolution_backward`` calls it
  again with tangents).

Each test proves the backend served calls (``aten_override.stats()``).
"""

from __future__ import annotations

import pytest
import torch

from aten_override.context import enable
from aten_override.testing._upstream import TestGradients, instantiate_device_type_tests, ops, parametrize
from aten_override.testing.comparison import served_by
from aten_override.testing.opinfo import conv_op_db
from aten_override.testing.selection import backends_under_test, test_name

BACKENDS = backends_under_test()
backend_parametrize = parametrize("backend", BACKENDS, name_fn=test_name)
gradient_ops = ops(conv_op_db, allowed_dtypes=(torch.float64,))


class TestConvolutionBackwardGradients(TestGradients):
    exact_dtype = True

    def _check(self, device, dtype, op, backend, check):
        with served_by(backend), enable(backend):
            if check == "gradcheck":
                self._grad_test_helper(device, dtype, op, op.get_op())
            else:
                self._check_helper(device, dtype, op, op.get_op(), check)

    @backend_parametrize
    @gradient_ops
    def test_fn_grad(self, device, dtype, op, backend):
        self._check(device, dtype, op, backend, "gradcheck")

    @pytest.mark.slow  # ~30 s per op on 2 cores
    @backend_parametrize
    @gradient_ops
    def test_fn_gradgrad(self, device, dtype, op, backend):
        self._check(device, dtype, op, backend, "bwgrad_bwgrad")

    @pytest.mark.slow  # ~30 s per op on 2 cores
    @backend_parametrize
    @gradient_ops
    def test_fn_fwgrad_bwgrad(self, device, dtype, op, backend):
        self._check(device, dtype, op, backend, "fwgrad_bwgrad")


instantiate_device_type_tests(TestConvolutionBackwardGradients, globals())

if __name__ == "__main__":
    from aten_override.testing._upstream import run_tests

    run_tests()
