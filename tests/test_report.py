import pytest
import torch

from loglinear.report import machine_name


@pytest.mark.parametrize("gpu, expected", [("NVIDIA H200", "H200"), ("NVIDIA H100 80GB HBM3", "H100-80GB-HBM3")])
def test_machine_name_of_a_gpu(monkeypatch, gpu, expected):
    seen = []
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: seen.append(device) or gpu)
    assert machine_name("cuda:1") == expected
    assert seen == [torch.device("cuda:1")]


@pytest.mark.parametrize("device", ["cpu", torch.device("cpu"), "meta"])
def test_machine_name_off_a_gpu(monkeypatch, device):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: pytest.fail("asked for a GPU's name"))
    assert machine_name(device) == "cpu"
