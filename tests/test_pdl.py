"""nanoinfer.backends.cuda.pdl decides where kernels launch early: CUDA on Hopper or later only, never in
Triton's interpreter or with NANOINFER_PDL=0, and a launch asks for it exactly where its kernel
waits. (Its effect on results, none: tests/test_gpu.py's
`test_one_token_steps_launched_early_equal_those_launched_in_turn`.)"""

import pytest
import torch

pytest.importorskip("triton")

from nanoinfer.backends.cuda import pdl  # noqa: E402


def test_kernels_launch_early_only_on_a_capable_gpu(monkeypatch):
    monkeypatch.delenv("NANOINFER_PDL", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not pdl.enabled(torch.device("cpu"))
    assert pdl.launch(torch.device("cpu")) == {"PDL": False}
    monkeypatch.setattr(pdl, "_capable", lambda index: index == 1)  # (as if cuda:1 were a Hopper, cuda:0 not)
    assert pdl.enabled(torch.device("cuda", 1)) and not pdl.enabled(torch.device("cuda", 0))
    assert pdl.launch(torch.device("cuda", 1)) == {"PDL": True, "launch_pdl": True}
    monkeypatch.setenv("NANOINFER_PDL", "0")
    assert not pdl.enabled(torch.device("cuda", 1))
    monkeypatch.setenv("NANOINFER_PDL", "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not pdl.enabled(torch.device("cuda", 1))
