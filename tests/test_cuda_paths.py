"""What the CUDA paths decide without a GPU: a torchrun rank's device, found before `set_device`, and
TF32 through the API torch has, and only where the precision asked for allows it."""

from __future__ import annotations

import pytest
import torch

from cram.stages.shared import device as devices


def test_cuda_under_torchrun_is_the_local_rank_without_asking_the_current_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    def current_device():  # planning runs before the runner's set_device: the current device is cuda:0
        raise AssertionError("resolve asked for the current CUDA device")

    monkeypatch.setattr(torch.cuda, "current_device", current_device)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert devices.resolve("cuda") == torch.device("cuda", 3)
    assert devices.resolve("auto") == torch.device("cuda", 3)


class Flags:
    """A stand-in for torch's TF32 flag holders that records what is set on it."""

    def __init__(self, new_api: bool):
        object.__setattr__(self, "set", {})
        if new_api:
            object.__setattr__(self, "fp32_precision", "none")

    def __setattr__(self, name, value):
        self.set[name] = value


@pytest.mark.parametrize("new_api", [True, False])
def test_tf32_goes_through_fp32_precision_where_torch_has_it(monkeypatch, new_api):
    matmul, conv, cudnn = Flags(new_api), Flags(new_api), Flags(new_api)
    object.__setattr__(cudnn, "conv", conv)
    monkeypatch.setattr(torch.backends.cuda, "matmul", matmul)
    monkeypatch.setattr(torch.backends, "cudnn", cudnn)
    devices.use_tf32()
    if new_api:  # torch 2.9 on: never the legacy flags, which torch 2.11 deprecates
        assert matmul.set == {"fp32_precision": "tf32"} and conv.set == {"fp32_precision": "tf32"}
        assert cudnn.set == {}
    else:
        assert matmul.set == {"allow_tf32": True} and cudnn.set == {"allow_tf32": True}


@pytest.mark.parametrize("new_api", [True, False])
@pytest.mark.parametrize("precision, tf32", [("fp32", False), ("auto", True), ("bf16", True)])
def test_fp32_on_cuda_is_fp32_and_tf32_only_where_the_precision_allows_it(monkeypatch, new_api, precision, tf32):
    matmul, conv, cudnn = Flags(new_api), Flags(new_api), Flags(new_api)
    object.__setattr__(cudnn, "conv", conv)
    monkeypatch.setattr(torch.backends.cuda, "matmul", matmul)
    monkeypatch.setattr(torch.backends, "cudnn", cudnn)
    autocast = devices.autocast_dtype(precision, torch.device("cuda", 0))
    assert autocast is (None if precision == "fp32" else torch.bfloat16)
    if new_api:
        value = "tf32" if tf32 else "ieee"
        assert matmul.set == {"fp32_precision": value} and conv.set == {"fp32_precision": value}
    else:
        assert matmul.set == {"allow_tf32": tf32} and cudnn.set == {"allow_tf32": tf32}


@pytest.mark.parametrize(
    "name, peak",
    [
        ("NVIDIA H200", 989e12),
        ("NVIDIA H200 NVL", 835e12),
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
    ],
)
def test_the_data_sheet_peak_tells_h200_sxm_from_nvl(monkeypatch, name, peak):
    from cram import model

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert model.peak_flops("cuda:0") == peak
