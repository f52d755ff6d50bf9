r"""Training steps of upstream's conv ``module_db`` entries, a backend against native.

``nn.Conv1d/2d/3d`` and ``nn.ConvTranspose1d/2d/3d`` with the ``ModuleInput``s of
``torch.testing._internal.common_modules`` (batched and unbatched, ``padding="same"``), contiguous
and channels_last: forward, backward with the backend enabled, one SGD step. Input grads,
parameter grads and updated parameters are checked by the rule of
:func:`aten_override.testing.comparison.check_tensor`: exactly the dtypes, shapes and strides of the
same step run natively, and values as far from the step run natively in float64 as at most twice
the native step's own distance, plus a few ulps of their scale (a correct backend that sums in
another order than oneDNN's passes; one off by a dropped summand does not).
"""

from __future__ import annotations

import copy

import torch

from aten_override.context import enable
from aten_override.testing._upstream import (
    TestCase,
    TrainEvalMode,
    instantiate_device_type_tests,
    make_tensor,
    module_db,
    modules,
    parametrize,
)
from aten_override.testing.comparison import check_against_native, check_tensor, served_by
from aten_override.testing.selection import backends_under_test, test_name
from aten_override.testing.skips import SKIPS

BACKENDS = backends_under_test()
backend_parametrize = parametrize("backend", BACKENDS, name_fn=test_name)

CONV_MODULES = (
    torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d,
    torch.nn.ConvTranspose1d, torch.nn.ConvTranspose2d, torch.nn.ConvTranspose3d,
)
conv_module_db = [info for info in module_db if info.module_cls in CONV_MODULES]

MEMORY_FORMATS = {"contiguous": None, "channels_last": "channels_last"}


def _channels_last(dim: int) -> torch.memory_format:
    return torch.channels_last if dim == 4 else torch.channels_last_3d


def _train_step(module, x, grad, lr=0.1):
    """One step: forward, ``backward(grad)``, SGD; returns (x.grad, weight.grad, bias.grad, module)."""
    x = x.detach().clone().requires_grad_()
    out = module(x)
    out.backward(grad)
    grads = (x.grad, module.weight.grad, None if module.bias is None else module.bias.grad)
    with torch.no_grad():
        for p in module.parameters():
            p -= lr * p.grad
    return grads, out


class TestConvolutionBackwardModules(TestCase):
    @backend_parametrize
    @parametrize("memory_format", list(MEMORY_FORMATS))
    @modules(conv_module_db, allowed_dtypes=(torch.float32, torch.float64), train_eval_mode=TrainEvalMode.train_only)
    def test_train_step(self, device, dtype, module_info, training, memory_format, backend):
        if memory_format == "channels_last" and module_info.module_cls in (torch.nn.Conv1d, torch.nn.ConvTranspose1d):
            self.skipTest(SKIPS["channels_last_1d"])
        inputs = module_info.module_inputs_func(module_info, device=device, dtype=dtype, requires_grad=False, training=True)
        with served_by(backend):
            for module_input in inputs:
                x = module_input.forward_input.args[0]
                args, kwargs = module_input.constructor_input.args, module_input.constructor_input.kwargs
                module = module_info.module_cls(*args, **kwargs).to(device=device, dtype=dtype)
                if memory_format == "channels_last":
                    if x.dim() != module.weight.dim():
                        continue  # unbatched input: no channels_last
                    x = x.contiguous(memory_format=_channels_last(x.dim()))
                    module = module.to(memory_format=_channels_last(x.dim()))
                native_module, reference_module = copy.deepcopy(module), copy.deepcopy(module).double()
                out = module(x)
                grad = make_tensor(out.shape, device=device, dtype=dtype)
                with enable(backend):
                    actual, _ = _train_step(module, x, grad)
                native, _ = _train_step(native_module, x, grad)
                reference, reference_params = None, [None] * len(list(module.parameters()))
                if dtype != torch.float64:
                    reference, _ = _train_step(reference_module, x.double(), grad.double())
                    reference_params = list(reference_module.parameters())
                where = f"{module_info.name}({args}, {kwargs}) on input {list(x.shape)} {memory_format}"
                mask = [True, True, module.bias is not None]
                check_against_native(actual, native, reference, output_mask=mask, where=where)
                for (name, p), p_native, p_reference in zip(
                    module.named_parameters(), native_module.parameters(), reference_params
                ):
                    check_tensor(p.detach(), p_native.detach(), p_reference, where=f"{where}: {name} after the SGD step")
                    self.assertEqual(p.stride(), p_native.stride(), msg=f"{where}: {name} strides")


instantiate_device_type_tests(TestConvolutionBackwardModules, globals())

if __name__ == "__main__":
    from aten_override.testing._upstream import run_tests

    run_tests()
