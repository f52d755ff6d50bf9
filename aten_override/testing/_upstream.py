r"""Every name this package takes from ``torch.testing._internal``, pinned in one place.

``torch.testing._internal`` is PyTorch's own test infrastructure, not a public API: names move
between releases (in 2.13 ``skip``/``xfail``/``skipOps`` live in ``common_device_type``; on main
``common_methods_invocations`` re-exports them). Each name is looked up in the modules that have
held it, newest first, so a move costs one line here and nothing elsewhere. A name found nowhere
raises ``ImportError`` naming the torch version and the modules searched; a module that fails to
import (``torch.testing._internal`` needs numpy) raises ``ImportError`` with that cause.

Importing this module imports ``torch.testing._internal`` (about 5 s): import it from test code
only, never from :mod:`aten_override` itself.
"""

from __future__ import annotations

import importlib

import torch

__all__ = [
    "DecorateInfo",
    "ErrorInput",
    "ModuleInfo",
    "OpDTypes",
    "OpInfo",
    "SampleInput",
    "TestCase",
    "TestGradients",
    "TrainEvalMode",
    "floating_types_and",
    "instantiate_device_type_tests",
    "make_tensor",
    "module_db",
    "modules",
    "op_db",
    "ops",
    "parametrize",
    "run_tests",
    "skipOps",
    "xfail",
]

_PREFIX = "torch.testing._internal."

# name -> modules (relative to torch.testing._internal) that have held it, newest first.
_LOCATIONS: dict[str, tuple[str, ...]] = {
    "op_db": ("common_methods_invocations",),
    "OpInfo": ("opinfo.core", "common_methods_invocations"),
    "SampleInput": ("opinfo.core", "common_methods_invocations"),
    "ErrorInput": ("opinfo.core", "common_methods_invocations"),
    "DecorateInfo": ("opinfo.core", "common_methods_invocations"),
    "skipOps": ("common_methods_invocations", "common_device_type"),
    "xfail": ("common_methods_invocations", "common_device_type"),
    "ops": ("common_device_type",),
    "OpDTypes": ("common_device_type",),
    "instantiate_device_type_tests": ("common_device_type",),
    "TestCase": ("common_utils",),
    "TestGradients": ("common_utils",),
    "parametrize": ("common_utils",),
    "run_tests": ("common_utils",),
    "module_db": ("common_modules",),
    "modules": ("common_modules",),
    "ModuleInfo": ("common_modules",),
    "TrainEvalMode": ("common_modules",),
    "floating_types_and": ("common_dtype",),
}


def _lookup(name: str):
    tried, errors = [], []
    for module_name in _LOCATIONS[name]:
        tried.append(_PREFIX + module_name)
        try:
            module = importlib.import_module(_PREFIX + module_name)
        except ImportError as e:  # e.g. numpy missing: torch.testing._internal needs it
            errors.append(f"{_PREFIX + module_name}: {type(e).__name__}: {e}")
            continue
        if hasattr(module, name):
            return getattr(module, name)
    if errors:
        raise ImportError(
            f"aten_override.testing: cannot import {name!r} from torch {torch.__version__}'s test "
            f"infrastructure ({'; '.join(errors)}); install the test extra: "
            "pip install 'aten_override[test]'"
        )
    raise ImportError(
        f"aten_override.testing: torch {torch.__version__} has no {name!r} in {', '.join(tried)}; "
        "torch.testing._internal changed: add its new location to "
        "aten_override/testing/_upstream.py (_LOCATIONS)"
    )


op_db = _lookup("op_db")
OpInfo = _lookup("OpInfo")
SampleInput = _lookup("SampleInput")
ErrorInput = _lookup("ErrorInput")
DecorateInfo = _lookup("DecorateInfo")
skipOps = _lookup("skipOps")
xfail = _lookup("xfail")
ops = _lookup("ops")
OpDTypes = _lookup("OpDTypes")
instantiate_device_type_tests = _lookup("instantiate_device_type_tests")
TestCase = _lookup("TestCase")
TestGradients = _lookup("TestGradients")
parametrize = _lookup("parametrize")
run_tests = _lookup("run_tests")
module_db = _lookup("module_db")
modules = _lookup("modules")
ModuleInfo = _lookup("ModuleInfo")
TrainEvalMode = _lookup("TrainEvalMode")
floating_types_and = _lookup("floating_types_and")
make_tensor = torch.testing.make_tensor

# Upstream's TestCase appends "To execute this test, run the following from the base repo dir:
# python test_fuzz.py ..." to every failure: a command for PyTorch's own checkout that users of this
# package cannot run. `python -m aten_override test` prints a command they can instead.
importlib.import_module(_PREFIX + "common_utils").PRINT_REPRO_ON_FAILURE = False
