"""torch 2.13 kernels that give wrong results, and the proof that our paths do not.

Each test asserts both halves: torch's result is wrong (so if torch fixes it, the test fails and
the detour can be re-measured) and ours equals the fp32 reference.
"""

from __future__ import annotations

import torch

import scaledoptim


def _within_one_ulp(actual: torch.Tensor, expected: torch.Tensor) -> None:
    info = torch.finfo(actual.dtype)
    torch.testing.assert_close(actual.float(), expected.float(), rtol=info.eps, atol=info.tiny)


def test_cpu_fused_sgd_leaves_16bit_params_unchanged() -> None:
    """CPU ``SGD(fused=True)`` skips bf16/fp16 params of >= 16 elements, so
    the torch-native backend updates 16-bit params through fp32 working copies."""
    for dtype in (torch.bfloat16, torch.float16):
        torch_param = torch.nn.Parameter(torch.randn(16).to(dtype))
        our_param = torch.nn.Parameter(torch_param.detach().clone())
        before = torch_param.detach().clone()
        grad = torch.randn(16).to(dtype)
        torch_param.grad, our_param.grad = grad.clone(), grad.clone()
        torch.optim.SGD([torch_param], lr=0.5, fused=True).step()
        scaledoptim.SGD([our_param], lr=0.5).step()
        assert torch.equal(torch_param, before), "torch's fused CPU SGD now updates 16-bit params"
        _within_one_ulp(our_param.detach(), (before.float() - 0.5 * grad.float()).to(dtype))


def test_cpu_fused_adamw_misreads_a_transposed_grad() -> None:
    """``_fused_adamw_`` walks a grad as if it had its param's strides, so fused optimizers copy
    such a grad into the param's layout first."""
    param = torch.randn(5, 7)
    grad = torch.randn(7, 5).t()
    reference = torch.nn.Parameter(param.clone())
    reference.grad = grad.contiguous()
    torch.optim.AdamW([reference], lr=0.1).step()
    for fused in (True, False):
        ours = torch.nn.Parameter(param.clone())
        ours.grad = grad
        if fused:
            torch.optim.AdamW([ours], lr=0.1, fused=True).step()
            assert not torch.allclose(ours, reference), "torch's fused AdamW now reads strides"
        else:
            scaledoptim.AdamW([ours], lr=0.1).step()
            torch.testing.assert_close(ours, reference)


def test_fused_sgd_steps_on_uninitialised_momentum_after_a_skipped_first_step() -> None:
    """GradScaler + ``SGD(fused=True)``: the first step allocates the momentum buffers with
    ``empty_like`` and decides "first step" on the host; when that step is skipped for an
    overflow, the next step treats whatever the buffers hold as momentum. (With dampening the
    result is wrong even when that memory happens to be zero: ``(1 - dampening) * g`` instead of
    ``g``.) scaledoptim counts taken steps on device (``state["step"]``), so a skipped first
    step is not the one that sets the buffer."""
    start = torch.ones(1000)
    results = {}
    for name in ("torch fused", "scaledoptim", "reference"):
        p = torch.nn.Parameter(start.clone())
        if name == "torch fused":
            opt = torch.optim.SGD([p], lr=0.1, momentum=0.9, dampening=0.5, fused=True)
            scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
        elif name == "scaledoptim":
            opt = scaledoptim.SGD([p], lr=0.1, momentum=0.9, dampening=0.5)
            opt.configure_scaling(init_scale=4.0)
        else:
            opt = torch.optim.SGD([p], lr=0.1, momentum=0.9, dampening=0.5)
        for step in range(2):
            opt.zero_grad()
            if name == "reference":  # the skipped step never happened
                if step == 0:
                    continue
                p.sum().backward()
                opt.step()
            elif name == "torch fused":
                scaler.scale(p.sum()).backward()
                if step == 0:
                    p.grad[0] = float("inf")
                scaler.step(opt)
                scaler.update()
            else:
                scaledoptim.scale_outputs(p.sum(), opt.scale).backward()
                if step == 0:
                    p.grad[0] = float("inf")
                opt.unscale_and_step(grads_scaled_by=opt.scale)
        results[name] = p.detach()
    assert not torch.allclose(results["torch fused"], results["reference"])
    torch.testing.assert_close(results["scaledoptim"], results["reference"])
