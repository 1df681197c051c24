"""Memory layouts: which tensors a kernel may walk as one block, or write in place.

torch's fused optimizer kernels (`torch._fused_adam_`, `_fused_sgd_`) read
each gradient's memory in the order of its parameter's, element for
element; `torch._amp_foreach_non_finite_check_and_unscale_` and the other
in-place divisions write every element of a gradient. Both need gradients
whose elements each have their own address, laid out as their parameters
are. A `.grad` that autograd accumulated is (torch's gradient layout
contract), but `apply(grads, variables)` takes any tensors, and
`torch.autograd.grad` returns others:

- a channels-last gradient of a contiguous convolution weight, under a
  channels-last input: read in the weight's order, its elements would be
  applied to the wrong weights;
- an expanded gradient (stride 0: the gradient of a weight used only
  through a sum), whose elements share memory: the kernels would read
  past it, and an in-place division fails;
- gradients that are overlapping views of one buffer: divided in place,
  their shared elements would be divided twice.

Such a gradient is copied into its parameter's layout (`in_layout_of`), and
divided in a copy rather than in place (`dense`, `disjoint`). A parameter that is not
dense itself (a strided view made a parameter) takes the `foreach` kernels,
which follow any strides (`fused._fusable`).
"""

import torch

_is_contiguous = torch.Tensor.is_contiguous
_is_view = torch.Tensor._is_view


def dense(tensor):
    """Whether `tensor`'s elements fill one block of memory, each at its own address.

    A contiguous tensor is; so are channels-last and transposed ones (some
    order of the dimensions is contiguous). An expanded tensor (stride 0)
    or a strided slice is not.
    """
    if _is_contiguous(tensor):
        return True
    expected = 1
    # Dimensions of size 1 take any stride; the others, from the smallest
    # stride up, must each step over exactly the block of those before.
    for size, stride in sorted(zip(tensor.shape, tensor.stride()), key=lambda d: d[1]):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def disjoint(tensors):
    """Whether no two of `tensors` share memory (given distinct tensors).

    A tensor that is no view owns its memory (unless made to share it by
    hand, with `set_`): only where some are views are the spans of memory
    compared. Two interleaved views (`x[::2]` and `x[1::2]`) count as
    sharing: the caller then copies, which is safe.
    """
    if not any(map(_is_view, tensors)):
        return True
    spans = sorted(_span(t) for t in tensors if t.numel())
    return all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))


def _span(tensor):
    """`(first, past the last)` byte address of `tensor`'s elements."""
    last = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    start = tensor.data_ptr()
    return start, start + (last + 1) * tensor.element_size()


def own_memory(tensors):
    """Whether each of `tensors` is `dense` and shares no memory with another (`disjoint`)."""
    return (all_contiguous(tensors) or all(map(dense, tensors))) and disjoint(tensors)


def all_contiguous(tensors):
    """Whether every one of `tensors` is contiguous (one C-level check each)."""
    return all(map(_is_contiguous, tensors))


def in_layout_of(tensors, params, params_contiguous):
    """`tensors`, each laid out as its parameter in `params` (the same list if all are).

    Args:
        tensors: Tensors of the parameters' shapes (gradients).
        params: The dense parameters, aligned with `tensors`.
        params_contiguous: Whether every one of `params` is contiguous: then
            a contiguous tensor needs no stride comparison (the common step
            pays one C-level check per tensor).
    """
    if params_contiguous and all_contiguous(tensors):
        return tensors
    return [t if t.stride() == p.stride() else laid_out_as(t, p) for t, p in zip(tensors, params)]


def laid_out_as(tensor, like):
    """A copy of `tensor` with the strides of `like`, a dense tensor of its shape."""
    return torch.empty_like(like, dtype=tensor.dtype).copy_(tensor)
