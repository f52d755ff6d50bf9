r"""The shipped test suite: ``python -m aten_override test`` runs these modules with pytest.

- :mod:`.test_ops`: :data:`aten_override.testing.op_db` samples (values, dtypes, shapes, strides
  against the original kernel, every output_mask) and error inputs;
- :mod:`.test_gradients`: upstream's conv OpInfos through ``gradcheck``, ``gradgradcheck`` and
  forward-over-reverse, with the backend enabled;
- :mod:`.test_modules`: upstream's ``module_db`` conv modules, one training step, contiguous and
  channels_last, against native;
- :mod:`.test_fuzz`: hypothesis-driven differential fuzzing.

Every test is parametrized over :func:`aten_override.testing.selection.backends_under_test`.
"""

import os

SUITE_MODULES = ("test_ops", "test_gradients", "test_modules", "test_fuzz")
SUITE_DIR = os.path.dirname(os.path.abspath(__file__))
