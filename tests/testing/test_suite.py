"""The shipped suite (aten_override/testing/suite), collected here so CI runs it from the checkout.

``python -m aten_override test`` runs the same modules from an installed package.
"""

from aten_override.testing.suite import test_fuzz, test_gradients, test_modules, test_ops

# instantiate_device_type_tests put TestConvolutionBackward<Device> classes in each module.
for _module in (test_ops, test_gradients, test_modules, test_fuzz):
    globals().update({k: v for k, v in vars(_module).items() if k.startswith("TestConvolutionBackward")})
del _module
