r"""An upstream-style test bed for ``aten::convolution_backward`` backends, shipped in the package.

- :data:`op_db` (:mod:`.opinfo`): OpInfo entries for ``aten.convolution_backward.default`` whose
  samples derive from torch's own conv / conv-transpose OpInfos, plus error inputs;
- :mod:`.comparison`: results against the original kernel (values vs float64, dtypes, shapes,
  strides) and proof that a backend served the calls;
- :mod:`.fuzz`: hypothesis strategies for random valid calls, with reproductions;
- :mod:`.suite`: the test modules ``python -m aten_override test`` runs;
- :mod:`.selection`: which backends the suite runs (``module:function`` for your own);
- :mod:`.example_backends`: user-backend templates: a correct reference from forward
  convolutions, two deliberately wrong;
- :mod:`.mutants`: the reference with one plausible bug each (``scripts/mutation_check.py``).

Importing :mod:`aten_override.testing` is cheap; ``op_db`` imports ``torch.testing._internal``
(pinned in :mod:`._upstream`) on first access.
"""

from __future__ import annotations

__all__ = ["op_db"]


def __getattr__(name: str):
    if name == "op_db":
        from .opinfo import op_db

        return op_db
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
