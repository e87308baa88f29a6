"""scripts/sync_floor.py's persistent kernels (the grid barrier it measures against kernel
boundaries): right results in Triton's CPU interpreter with one program (the interpreter runs
programs one after another, so a barrier across several would wait forever there), and the
barrier's release/acquire atomics and the L1-bypassing loads in the code compiled for sm_90."""

from __future__ import annotations

import importlib.util

import pytest

from tests.helpers.kernels import run_interpreted

CHECK = """
import importlib.util, torch
spec = importlib.util.spec_from_file_location("sf", "scripts/sync_floor.py")
sf = importlib.util.module_from_spec(spec); spec.loader.exec_module(sf)
buf = torch.zeros(2, 1, dtype=torch.int32); cnt = torch.zeros(1, dtype=torch.int32)
sf._barrier_hop_kernel[(1,)](buf, cnt, 1, 7)
assert buf[1].item() == 7 and buf[0].item() == 6 and cnt.item() == 7, (buf, cnt)
torch.manual_seed(0)
m, k, steps = 16, 32, 5
w = torch.randn(steps, k, k) * k ** -0.5
x = torch.zeros(2, m, k); x0 = torch.randn(m, k); x[0] = x0; cnt.zero_()
sf._barrier_gemv_kernel[(1,)](x, w, cnt, steps, 1, M=m, K=k, BN=k)
ref = x0
for i in range(steps):
    ref = ref @ w[i].T
assert torch.allclose(x[steps % 2], ref, atol=1e-5), (x[steps % 2] - ref).abs().max()
assert cnt.item() == steps
print("ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_persistent_kernels_in_interpreter():
    """One program: every phase's hop counted once (7 phases: 7 and 6 in the two buffers, the
    counter at 7), the GEMV chain equal to five chained float32 products."""
    out = run_interpreted(CHECK)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_barrier_compiles_for_hopper():
    """The barrier arrives with a release atomic and spins on acquire atomics at GPU scope, and
    the phase inputs that other programs wrote are loaded past L1 (``.cg``)."""
    spec = importlib.util.spec_from_file_location("sync_floor", "scripts/sync_floor.py")
    sf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sf)
    from tests.helpers.kernels import compile_for_hopper

    sig = {"BUF": "*i32", "CNT": "*i32", "G": "i32", "STEPS": "i32"}
    ptx = compile_for_hopper(sf._barrier_hop_kernel, sig, {}, num_warps=1).asm["ptx"]
    lines = [ln.strip() for ln in ptx.splitlines()]
    arrive = [ln for ln in lines if ".add." in ln and "release" in ln and ".gpu" in ln]  # red/atom
    spin = [ln for ln in lines if "acquire" in ln and ".gpu" in ln]  # ld.acquire, or an atom
    assert arrive and all(ln.startswith(("red.", "atom.", "@")) for ln in arrive), arrive
    assert spin and any("ld.global.cg" in ln for ln in lines), spin
