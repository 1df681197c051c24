"""traced_unscale: a traced step's unscale and check as one opaque `lossscale::unscale_checked_`."""

import numpy as np
import pytest
import torch

from lossscale.backends.torch import multi, traced_unscale
from lossscale.bench import workloads

# A small transformer's 28 gradients (117,002 values, every one under
# `multi.PACK_BELOW`) and one above it.
SHAPES = [*workloads.get("tiny").shapes, (300, 300)]
F32_MAX = float(np.finfo(np.float32).max)


def _gradients(seed, bad=None):
    """Seeded gradients of `SHAPES`; `bad`: `(tensor, flat index, value)` written in."""
    rng = np.random.default_rng(seed)
    grads = [torch.from_numpy(rng.normal(size=s).astype(np.float32) * 1e3) for s in SHAPES]
    if bad is not None:
        tensor, index, value = bad
        grads[tensor].view(-1)[index] = value
    return grads


def _bad_values(seed):
    """inf and NaN at the first and last value of the first and last tensor, and at random."""
    rng = np.random.default_rng(seed)
    places = [(0, 0), (0, -1), (len(SHAPES) - 1, 0), (len(SHAPES) - 1, -1)]
    for _ in range(4):
        tensor = int(rng.integers(len(SHAPES)))
        places.append((tensor, int(rng.integers(int(np.prod(SHAPES[tensor]))))))
    return [(t, i, v) for (t, i), v in zip(places, [np.inf, -np.inf, np.nan] * 3, strict=False)]


def _traced(backend="aot_eager", graphs=None):
    def capture(graph_module, example_inputs):
        graphs.append(graph_module)
        return torch._dynamo.backends.debugging.aot_eager(graph_module, example_inputs)

    def step(grads, scale):
        _, finite, skip = traced_unscale.unscale_checked(grads, scale, in_place=True)
        return finite, skip

    torch.compiler.reset()
    return torch.compile(step, fullgraph=True, backend=capture if graphs is not None else backend)


def _targets(graph):
    return [str(n.target) for n in graph.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("scale", [2.0**15, 3.0, 0.5, 2.0**-20])
def test_traced_unscale_and_check_equal_the_eager_ones_bit_for_bit(scale):
    """Powers of two (one AMP pass), others (divide, then check), below 1 (may overflow)."""
    graphs = []
    traced = _traced(graphs=graphs)
    scale = torch.tensor(scale)
    cases = [None, *_bad_values(int(scale.item() * 7) % 100)]
    # Finite values that overflow only when divided by a scale below 1.
    cases.append((5, 17, F32_MAX))
    with torch._dynamo.config.patch(error_on_recompile=True):
        for seed, bad in enumerate(cases):
            compiled, eager = _gradients(seed, bad), _gradients(seed, bad)
            finite, skip = traced(compiled, scale)
            unscaled, eager_finite, eager_skip = multi.unscale_checked(eager, scale, in_place=True)
            assert all(u is g for u, g in zip(unscaled, eager))  # the eager rule: in place
            assert bool(finite) == bool(eager_finite)
            assert torch.equal(skip, eager_skip)
            assert bool(finite) == (bad is None or (scale >= 1 and bad[2] == F32_MAX))
            for a, b in zip(compiled, eager):
                assert torch.equal(a, b) or torch.equal(a.isnan(), b.isnan())
                assert torch.equal(a[~a.isnan()], b[~b.isnan()])
    torch.compiler.reset()
    (graph,) = graphs
    targets = _targets(graph)
    assert targets.count("lossscale.unscale_checked_.default") == 1, targets
    assert not any("isfinite" in t or "div" in t for t in targets), targets


def test_inductor_calls_the_operation_on_the_gradients_themselves():
    traced = _traced(backend="inductor")
    scale = torch.tensor(2.0**10)
    for seed, bad in enumerate([None, (3, 5, np.nan), None]):
        compiled, eager = _gradients(seed, bad), _gradients(seed, bad)
        finite, skip = traced(compiled, scale)
        _, eager_finite, eager_skip = multi.unscale_checked(eager, scale, in_place=True)
        assert bool(finite) == bool(eager_finite) == (bad is None)
        assert torch.equal(skip, eager_skip)
        for a, b in zip(compiled, eager):
            assert torch.equal(a.nan_to_num(), b.nan_to_num())
    torch.compiler.reset()


def test_a_gradient_given_twice_is_divided_once():
    graphs = []
    traced = _traced(graphs=graphs)
    grads = _gradients(3)[:4]
    want = [g / 8.0 for g in grads]
    finite, skip = traced([grads[0], grads[1], grads[0], grads[2], grads[3]], torch.tensor(8.0))
    torch.compiler.reset()
    assert bool(finite) and float(skip) == 0.0
    for g, w in zip(grads, want):
        assert torch.equal(g, w)
    assert _targets(graphs[0]).count("lossscale.unscale_checked_.default") == 1


@pytest.mark.parametrize(
    "case", ["requires_grad", "float16", "float64_scale", "not_host_readable", "not_in_place"]
)
def test_elsewhere_the_compiler_traces_the_multi_tensor_rule(case, monkeypatch):
    """Gradients of an autograd graph, half precision, another scale, a GPU: not opaque."""
    dtype = torch.float16 if case == "float16" else torch.float32
    grads = [g.to(dtype) for g in _gradients(4)[:3]]
    if case == "requires_grad":
        grads = [g.requires_grad_() for g in grads]
    if case == "not_host_readable":
        monkeypatch.setattr(multi, "HOST_READABLE", frozenset())
    scale = torch.tensor(4.0, dtype=torch.float64 if case == "float64_scale" else torch.float32)
    graphs = []

    def capture(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    def step(grads, scale):
        unscaled, finite, _ = traced_unscale.unscale_checked(
            grads, scale, in_place=case != "not_in_place"
        )
        return unscaled, finite

    torch.compiler.reset()
    unscaled, finite = torch.compile(step, fullgraph=True, backend=capture)(grads, scale)
    torch.compiler.reset()
    assert bool(finite)
    for u, g in zip(unscaled, grads):
        torch.testing.assert_close(u, (g.float() / 4.0).to(u.dtype), rtol=0, atol=0)
    targets = _targets(graphs[0])
    assert "lossscale.unscale_checked_.default" not in targets, targets
    assert any("isfinite" in t for t in targets), targets


def test_outside_a_trace_it_is_the_multi_tensor_rule():
    grads, eager = _gradients(5, (2, 3, np.inf)), _gradients(5, (2, 3, np.inf))
    unscaled, finite, skip = traced_unscale.unscale_checked(grads, torch.tensor(64.0), True)
    want, want_finite, want_skip = multi.unscale_checked(eager, torch.tensor(64.0), True)
    assert unscaled == grads and not bool(finite) and torch.equal(skip, want_skip)
    for a, b in zip(grads, want):
        assert torch.equal(a.nan_to_num(), b.nan_to_num())
