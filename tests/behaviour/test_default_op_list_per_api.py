"""Which op list O1 loads when ``op_lists`` is not given: amp_patch's own ``initialize`` takes native autocast's
list for the models' device; the apex alias keeps Apex's lists; an explicit ``op_lists`` always wins."""
import torch

import amp_patch
from amp_patch.config.oplist import default_list_name
from amp_patch.legacy import amp
from amp_patch.session.checks import models_device_type
from amp_patch.session.state import active_engine


def _sources_after(init, **kwargs):
    init(torch.nn.Linear(2, 2), opt_level="O1", verbosity=0, **kwargs)
    try:
        return active_engine().table.sources
    finally:
        amp_patch.deinitialize()


def test_own_api_defaults_to_the_torch_list_of_the_models_device():
    assert _sources_after(amp_patch.initialize) == ("op_lists/torch_cpu.yaml",)
    assert default_list_name("cuda") == "torch_cuda" and default_list_name("cpu") == "torch_cpu"
    assert default_list_name("mps") == "apex"  # no shipped torch list for that device type


def test_the_models_device_decides_and_a_model_without_tensors_falls_back_to_the_engines():
    assert models_device_type([torch.nn.ReLU(), torch.nn.Linear(1, 1)]) == "cpu"
    assert models_device_type([torch.nn.ReLU()]) == ("cuda" if torch.cuda.is_available() else "cpu")


def test_the_apex_alias_keeps_apexs_lists():
    assert _sources_after(amp.initialize) == ("op_lists/apex.yaml",)


def test_an_explicit_list_wins_under_both():
    assert _sources_after(amp_patch.initialize, op_lists="apex") == ("op_lists/apex.yaml",)
    assert _sources_after(amp.initialize, op_lists="torch_cpu") == ("op_lists/torch_cpu.yaml",)
