"""aten_override.testing.opinfo: the op_db's samples and error inputs are what they claim to be."""

import pytest
import torch

from aten_override.testing import _upstream
from aten_override.testing.opinfo import OUTPUT_MASKS, VARIANTS, conv_op_db, op_db


@pytest.mark.parametrize("op", op_db, ids=lambda op: op.variant_test_name)
def test_samples_cover_every_output_mask_and_match_the_variant(op):
    _, dim, transposed = VARIANTS[op.variant_test_name]
    samples = list(op.sample_inputs("cpu", torch.float32))
    masks = {tuple(s.args[-1]) for s in samples}
    assert masks == set(OUTPUT_MASKS)
    for s in samples:
        grad_output, (x, w, bias_sizes, *_, transposed_arg, _op, groups, mask) = s.input, s.args
        assert w.dim() == dim + 2 and x.dim() == dim + 2 and grad_output.dim() == dim + 2, s.name
        assert transposed_arg is transposed, s.name
        assert bias_sizes is not None or not mask[2], s.name


def test_samples_derive_from_upstreams_conv_opinfos():
    assert sorted(op.name for op in conv_op_db) == sorted(v[0] for v in VARIANTS.values())
    conv2d = next(op for op in op_db if op.variant_test_name == "conv2d")
    names = [s.name for s in conv2d.sample_inputs("cpu", torch.float64)]
    assert len(names) == len(set(names)), "duplicate samples"
    assert any("groups=" in n for n in names) and any("dilation=" in n for n in names)


@pytest.mark.parametrize("op", op_db, ids=lambda op: op.variant_test_name)
def test_error_inputs_are_named_and_have_regexes(op):
    errors = list(op.error_inputs("cpu"))
    names = [e.name for e in errors]
    assert len(names) == len(set(names))
    for required in ("groups=0", "stride=0", "padding=-1", "grad_output_spatial_mismatch", "mixed_dtypes",
                     "C_in_mismatch", "groups_not_dividing_C_in"):
        assert required in names
    if not VARIANTS[op.variant_test_name][2]:
        assert "output_padding_not_transposed" in names
    assert all(e.error_type is RuntimeError and e.error_regex for e in errors)


def test_pinned_import_names_its_fix(monkeypatch):
    monkeypatch.setitem(_upstream._LOCATIONS, "op_db", ("common_utils",))
    with pytest.raises(ImportError, match=r"no 'op_db' in torch.testing._internal.common_utils.*_LOCATIONS"):
        _upstream._lookup("op_db")
