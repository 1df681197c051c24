"""lossscale/torch/internals.py: torch's private GradScaler parts, checked at import."""

import subprocess
import sys

import pytest
import torch

from lossscale.torch import internals


def test_the_installed_torch_has_what_lossscale_overrides():
    assert internals.problems() == []
    for name in internals.METHODS:  # each is overridden (or called) by our GradScaler
        assert hasattr(torch.amp.GradScaler, name)


def _import_after(patch):
    """`import lossscale.torch` in a fresh interpreter after `patch` changed torch."""
    code = f"import torch, torch.amp.grad_scaler as m\n{patch}\nimport lossscale.torch\n"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    "patch,named",
    [
        ("del m.GradScaler._check_inf_per_device", "`GradScaler._check_inf_per_device` is missing"),
        (
            "m.GradScaler._unscale_grads_ = lambda self, optimizer, inv_scale, found_inf: None",
            "`GradScaler._unscale_grads_` takes ('optimizer', 'inv_scale', 'found_inf'), "
            "where lossscale expects ('optimizer', 'inv_scale', 'found_inf', 'allow_fp16')",
        ),
        ("del m.OptState", "`torch.amp.grad_scaler.OptState` is missing"),
    ],
    ids=["missing method", "changed signature", "missing OptState"],
)
def test_a_torch_whose_internals_differ_is_refused_at_import(patch, named):
    proc = _import_after(patch)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: lossscale.torch cannot run on torch 2."), last
    assert named in last and "lossscale supports torch >= 2.13" in last


def test_the_check_passes_in_a_fresh_interpreter():
    assert _import_after("").returncode == 0
