"""Warnings torch raises inside a patched op name the user's line, as without amp_patch."""
import inspect
import warnings

import pytest
import torch
import torch.nn.functional as F

import amp_patch


def _softmax_without_dim(x):
    """Call F.softmax without dim (torch warns, attributed to its caller); returns (warnings, the call's line)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = inspect.currentframe().f_lineno + 1
        F.softmax(x)
    return [w for w in caught if "Implicit dimension" in str(w.message)], line


@pytest.mark.parametrize("op_lists", ["apex", "torch_cpu"])
def test_a_torch_warning_inside_a_patched_op_names_the_callers_line(op_lists):
    x = torch.randn(2, 3)
    native, native_line = _softmax_without_dim(x)
    amp_patch.initialize(torch.nn.Linear(2, 2), opt_level="O1", op_lists=op_lists, verbosity=0)
    patched, line = _softmax_without_dim(x)
    amp_patch.deinitialize()
    assert native and patched, "F.softmax without dim no longer warns: pick another deprecated call"
    assert (native[0].filename, native[0].lineno) == (__file__, native_line)
    assert (patched[0].filename, patched[0].lineno) == (__file__, line), "the warning names amp_patch's wrapper"


def test_an_autocast_region_attributes_too_and_the_hook_goes_with_the_engine():
    original = warnings._showwarnmsg
    with amp_patch.autocast("cpu", dtype=torch.bfloat16):
        assert warnings._showwarnmsg is not original
        caught, line = _softmax_without_dim(torch.randn(2, 3))
    assert warnings._showwarnmsg is original
    assert (caught[0].filename, caught[0].lineno) == (__file__, line)


def test_warnings_of_other_files_are_left_as_they_are():
    amp_patch.initialize(torch.nn.Linear(2, 2), opt_level="O1", verbosity=0)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            warnings.warn_explicit("elsewhere", UserWarning, "/somewhere/else.py", 7)
    finally:
        amp_patch.deinitialize()
    assert [(w.filename, w.lineno) for w in caught] == [("/somewhere/else.py", 7)]
