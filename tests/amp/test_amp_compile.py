"""Edited policies under torch.compile: compiled code computes what eager computes.

Each case compiles with the ``eager`` (dynamo's graph run op by op), ``aot_eager`` (AOTAutograd
tracing through the Autocast keys, casts baked into the graph) and ``inductor`` backends, with
``fullgraph=True``, and compares dtypes, values and gradients with the same function run
eagerly under the same policies.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.utils.checkpoint

from scaledoptim import amp

BACKENDS = ["eager", "aot_eager", "inductor"]
LOW = torch.bfloat16


@pytest.fixture(autouse=True)
def fresh_dynamo():
    # emulate_precision_casts: inductor rounds low precision intermediates as eager does,
    # so compiled and eager results can be compared at bf16's own tolerance.
    torch._dynamo.reset()
    with torch._inductor.config.patch(emulate_precision_casts=True):
        yield
    torch._dynamo.reset()


def _inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 8, generator=generator, requires_grad=True)
    w = torch.randn(8, 8, generator=generator, requires_grad=True)
    return x, w


def _block(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # mm is lower precision by torch's default and tanh has no autocast kernel: the edits
    # below flip both, so an ignored edit shows in the dtypes.
    y = torch.mm(x, w)
    return y, torch.tanh(y.float()) * 2


def _region_inside(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    with amp.autocast("cpu", dtype=LOW):
        return _block(x, w)


def _edit() -> None:
    amp.set_policy("aten::mm", "fp32", "cpu")
    amp.set_policy("aten::tanh", "lower_precision_fp", "cpu")


def _run(fn, x, w, outside: bool):
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    if outside:
        with amp.autocast("cpu", dtype=LOW):
            out = fn(x, w)
    else:
        out = fn(x, w)
    (out[0].float().sum() + out[1].float().pow(2).sum()).backward()
    return (*out, x.grad, w.grad)


def _assert_same(compiled, eager) -> None:
    for got, want in zip(compiled, eager):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("where", ["region inside", "region outside"])
def test_compiled_code_applies_edited_policies(backend, where):
    _edit()
    x, w = _inputs()
    fn = _region_inside if where == "region inside" else _block
    outside = where == "region outside"
    eager = _run(fn, x, w, outside)
    compiled = _run(torch.compile(fn, backend=backend, fullgraph=True), x, w, outside)
    # mm pinned to fp32, tanh to the region's dtype.
    assert (eager[0].dtype, eager[1].dtype) == (torch.float32, LOW)
    _assert_same(compiled, eager)


@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_code_follows_later_edits_and_the_kind_of_region(backend):
    x, w = _inputs()
    compiled = torch.compile(_block, backend=backend, fullgraph=True)

    def compiled_and_eager_dtypes(region):
        with region("cpu", dtype=LOW):
            return compiled(x, w)[0].dtype, _block(x, w)[0].dtype

    amp.set_policy("aten::mm", "fp32", "cpu")
    assert compiled_and_eager_dtypes(amp.autocast) == (torch.float32,) * 2
    # The graph traced in a scaledoptim region, called in a plain torch region: torch's policy.
    assert compiled_and_eager_dtypes(torch.autocast) == (LOW,) * 2
    # Edits made after compiling apply at the next call, as they do eagerly.
    amp.set_policy("aten::mm", "promote", "cpu")
    assert compiled_and_eager_dtypes(amp.autocast) == (torch.float32,) * 2
    amp.reset_policy()
    assert compiled_and_eager_dtypes(amp.autocast) == (LOW,) * 2


def test_first_edit_of_an_op_after_compiling():
    # An op never edited has torch's kernel (or none): code compiled before its first edit
    # never ran scaledoptim's kernel, yet must follow the edit like eager code does.
    @torch.library.custom_op("amp_test_compile::scale", mutates_args=())
    def scale(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * w

    @scale.register_fake
    def _(x, w):
        return torch.empty_like(x)

    def fn(x, w):
        return torch.ops.amp_test_compile.scale(x, w) + 1

    x, w = torch.randn(4), torch.randn(4)
    for backend in BACKENDS:
        torch._dynamo.reset()
        amp.reset_policy()
        compiled = torch.compile(fn, backend=backend, fullgraph=True)
        with amp.autocast("cpu", dtype=LOW):
            assert compiled(x, w).dtype == fn(x, w).dtype == torch.float32
            amp.set_policy("amp_test_compile::scale", "lower_precision_fp", "cpu")
            assert compiled(x, w).dtype == fn(x, w).dtype == LOW, backend


def test_compile_caches_never_serve_a_graph_traced_under_other_policies():
    # AOTAutograd's cache outlives torch._dynamo.reset() (it is on disk) and keys a graph
    # by dynamo's graph and torch's autocast state, which do not show scaledoptim's edits.
    x, w = _inputs()
    with amp.autocast("cpu", dtype=LOW):
        amp.set_policy("aten::mm", "fp32", "cpu")
        assert torch.compile(_block, backend="inductor")(x, w)[0].dtype == torch.float32
        torch._dynamo.reset()
        amp.set_policy("aten::mm", "lower_precision_fp", "cpu")
        assert torch.compile(_block, backend="inductor")(x, w)[0].dtype == LOW


@pytest.mark.parametrize("backend", BACKENDS)
def test_graph_break_inside_a_region(backend):
    _edit()
    x, w = _inputs()

    def fn(x, w):
        with amp.autocast("cpu", dtype=LOW):
            y = torch.mm(x, w)
            torch._dynamo.graph_break()
            return y, torch.tanh(y.float()) * 2

    _assert_same(_run(torch.compile(fn, backend=backend), x, w, False), _run(fn, x, w, False))


@pytest.mark.parametrize("backend", BACKENDS)
def test_plain_torch_region_with_a_graph_break_still_compiles(backend):
    # scaledoptim records torch.autocast regions once a scaledoptim region was entered
    # (Note [telling regions apart]); torch's own handling of a graph break inside a
    # torch.autocast region must not notice.
    with amp.autocast("cpu"):
        pass
    x, w = _inputs()

    def fn(x, w):
        with torch.autocast("cpu", dtype=LOW):
            y = torch.mm(x, w)
            torch._dynamo.graph_break()
            # (Not mm(y, w): torch's cast cache would give w one cast in eager and one per
            # graph compiled, and its gradient would be summed in another precision.)
            return y, torch.mm(y, w.t().contiguous())

    _assert_same(_run(torch.compile(fn, backend=backend), x, w, False), _run(fn, x, w, False))


@pytest.mark.parametrize("backend", BACKENDS)
def test_region_of_another_device_inside_compiled_code(backend):
    _edit()
    x, w = _inputs()

    def fn(x, w):
        with torch.autocast("cuda", enabled=False):  # accepted, and disabled, without CUDA
            return _block(x, w)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eager = _run(fn, x, w, True)
        compiled = _run(torch.compile(fn, backend=backend, fullgraph=True), x, w, True)
    assert (eager[0].dtype, eager[1].dtype) == (torch.float32, LOW)
    _assert_same(compiled, eager)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("use_reentrant", [False, True])
def test_amp_checkpoint_in_compiled_code(backend, use_reentrant):
    _edit()
    x, w = _inputs()

    def checkpointed(x, w):
        return amp.checkpoint(_block, x, w, use_reentrant=use_reentrant)

    eager = _run(_block, x, w, True)  # not checkpointed
    _assert_same(_run(checkpointed, x, w, True), eager)
    compiled = torch.compile(checkpointed, backend=backend)
    _assert_same(_run(compiled, x, w, True), eager)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_checkpoint_in_code_compiled_with_aot_autograd(backend):
    # AOTAutograd recomputes from the traced forward, whose casts are the region's.
    _edit()
    x, w = _inputs()

    def checkpointed(x, w):
        return torch.utils.checkpoint.checkpoint(_block, x, w, use_reentrant=False)

    compiled = torch.compile(checkpointed, backend=backend, fullgraph=True)
    _assert_same(_run(compiled, x, w, True), _run(_block, x, w, True))
