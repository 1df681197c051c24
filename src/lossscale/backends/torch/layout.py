"""Memory layouts: which tensors a kernel may walk as one block, or write in place.

torch's fused kernels read each gradient in its parameter's memory order,
and in-place divisions write every element, so both need gradients laid out
as their parameters, each element at its own address. `apply` takes any
tensors (a channels-last gradient of a contiguous weight, an expanded one,
overlapping views): such a gradient is copied into its parameter's layout
(`in_layout_of`), and divided in a copy (`dense`, `disjoint`). A parameter
that is not dense takes the `foreach` kernels.
"""

import torch

_is_contiguous = torch.Tensor.is_contiguous
_is_view = torch.Tensor._is_view


def dense(tensor):
    """Whether `tensor`'s elements fill one block of memory, each at its own address.

    Contiguous, channels-last and transposed tensors are; expanded and
    strided ones are not.
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

    Only views' spans are compared; interleaved views count as sharing.
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
    """`tensors`, each laid out as its dense parameter in `params` (the same list if all are)."""
    if params_contiguous and all_contiguous(tensors):
        return tensors
    return [t if t.stride() == p.stride() else laid_out_as(t, p) for t, p in zip(tensors, params)]


def laid_out_as(tensor, like):
    """A copy of `tensor` with the strides of `like`, a dense tensor of its shape."""
    return torch.empty_like(like, dtype=tensor.dtype).copy_(tensor)
