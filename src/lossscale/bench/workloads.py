"""The benchmark workloads: lists of float32 tensor shapes, and their data.

- `tiny`: 28 tensors, 117,002 parameters, the parameters of a small
  transformer (`TRANSFORMER`: token and position embeddings, two encoder
  layers with d_model 64 and feed-forward width 256, a 10-class head), so
  a step is bound by fixed per-step and per-tensor costs (on a GPU: launches).
- `many_small`: 400 tensors, about 1M parameters, shaped like a small
  convolutional network (3x3 kernels, dense matrices, biases and norm
  parameters), so per-tensor overhead dominates.
- `gpt`: 29 tensors, 986,624 parameters, the parameters of a small GPT
  (`GPT`: token and position embeddings, two decoder blocks with d_model
  128 and biases, a final norm and an untied head), the AdamW workload.
- `large`: 16 tensors of 1024x1024, about 16M parameters, so memory
  bandwidth dominates.
- `gpu_tiny`: `tiny` on CUDA.
- `gpu_many_small`: `many_small` on CUDA, where a step is bound by kernel
  launches rather than memory.
- `gpu_large`: 64 tensors of 2048x2048, about 256M parameters, on CUDA.

Parameters and gradients are random and never zero (magnitudes in
[0.5, 1.5), random signs; gradients then times 1e-3), identical for every
implementation (one seed). Loss-scaling implementations receive the
gradients pre-multiplied by `LOSS_SCALE`, their initial scale, so every
timed step is a finite, applied step that exercises the unscale and the
finite check.
"""

import dataclasses
import math

import numpy as np

LOSS_SCALE = 2.0**15
# Keras's, GradScaler's and jmp's default growth period: the scale stays put
# for any benchmark shorter than this many steps.
GROWTH_STEPS = 2000
GRADIENT_MAGNITUDE = 1e-3


@dataclasses.dataclass(frozen=True)
class Workload:
    """One benchmark workload.

    Args:
        name: Its name on the command line.
        shapes: One shape tuple per tensor.
        device: `"cpu"` or `"cuda"`.
    """

    name: str
    shapes: tuple
    device: str

    @property
    def size(self):
        """Total number of parameters."""
        return sum(math.prod(s) for s in self.shapes)

    def describe(self):
        return f"{len(self.shapes)} tensors, {self.size:,} float32 parameters, {self.device}"


def _small_network(widths, count):
    # Alternating conv blocks (3x3 kernel + bias, scale, offset) and dense
    # blocks (matrix + bias, scale, offset).
    shapes, i = [], 0
    while len(shapes) < count:
        c = widths[i % len(widths)]
        if i % 2 == 0:
            shapes += [(3, 3, c, 2 * c), (2 * c,), (2 * c,), (2 * c,)]
        else:
            shapes += [(4 * c, 3 * c), (3 * c,), (3 * c,), (3 * c,)]
        i += 1
    return tuple(shapes[:count])


# `tiny`: the parameters of a small transformer classifier, in torch's
# (out, in) layout: vocabulary 128, context 128, d_model 64, two
# `torch.nn.TransformerEncoderLayer(64, nhead, 256)` (any nhead), 10
# classes. 28 tensors, 117,002 parameters (tests/bench/test_workloads.py
# checks the layers against torch's own).
_ENCODER_LAYER = (
    (192, 64),  # self_attn.in_proj_weight (q, k and v packed)
    (192,),  # self_attn.in_proj_bias
    (64, 64),  # self_attn.out_proj.weight
    (64,),  # self_attn.out_proj.bias
    (256, 64),  # linear1.weight
    (256,),  # linear1.bias
    (64, 256),  # linear2.weight
    (64,),  # linear2.bias
    (64,),  # norm1.weight
    (64,),  # norm1.bias
    (64,),  # norm2.weight
    (64,),  # norm2.bias
)
TRANSFORMER = (
    ((128, 64), (128, 64))  # token embedding, learned position embedding
    + _ENCODER_LAYER * 2
    + ((10, 64), (10,))  # the head: weight, bias
)


# `gpt`: a GPT-2-style decoder in torch's (out, in) layout: vocabulary 2048,
# context 512, d_model 128, two blocks (pre-norm, fused q/k/v projection, a
# 4x feed-forward, every linear with a bias), a final norm and an untied
# head. 29 tensors, 986,624 parameters.
_D = 128
_GPT_BLOCK = (
    (_D,),  # ln_1.weight
    (_D,),  # ln_1.bias
    (3 * _D, _D),  # attn.c_attn.weight (q, k and v packed)
    (3 * _D,),  # attn.c_attn.bias
    (_D, _D),  # attn.c_proj.weight
    (_D,),  # attn.c_proj.bias
    (_D,),  # ln_2.weight
    (_D,),  # ln_2.bias
    (4 * _D, _D),  # mlp.c_fc.weight
    (4 * _D,),  # mlp.c_fc.bias
    (_D, 4 * _D),  # mlp.c_proj.weight
    (_D,),  # mlp.c_proj.bias
)
GPT = (
    ((2048, _D), (512, _D))  # wte, wpe
    + _GPT_BLOCK * 2
    + ((_D,), (_D,), (2048, _D))  # ln_f.weight, ln_f.bias, lm_head.weight
)


def _eighths(shapes):
    return tuple(tuple(-(-d // 8) for d in s) for s in shapes)


def _build(name, quick):
    if name == "tiny":
        if quick:  # the same 28 tensors, every dimension an eighth
            return Workload(name, _eighths(TRANSFORMER), "cpu")
        return Workload(name, TRANSFORMER, "cpu")
    if name == "gpt":  # quick: the same 29 tensors, every dimension an eighth
        return Workload(name, _eighths(GPT) if quick else GPT, "cpu")
    if name == "many_small":
        if quick:
            return Workload(name, _small_network((4, 6, 8), 24), "cpu")
        return Workload(name, _small_network((8, 12, 16, 20, 24, 28, 32, 36, 40), 400), "cpu")
    if name == "large":
        return Workload(name, ((128, 128),) * 2 if quick else ((1024, 1024),) * 16, "cpu")
    if name in ("gpu_tiny", "gpu_many_small"):
        return dataclasses.replace(_build(name[4:], quick), name=name, device="cuda")
    if name == "gpu_large":
        return Workload(name, ((256, 256),) * 2 if quick else ((2048, 2048),) * 64, "cuda")
    raise ValueError(f"`workload` must be one of {NAMES}. Received: workload={name!r}")


CPU_NAMES = ("tiny", "many_small", "gpt", "large")
GPU_NAMES = ("gpu_tiny", "gpu_many_small", "gpu_large")
NAMES = CPU_NAMES + GPU_NAMES


def get(name, quick=False):
    """Returns the `Workload` called `name`; `quick=True` gives a tiny version for tests."""
    return _build(name, quick)


def _nonzero(rng, shape):
    # Uniform in [-1, 1), pushed 0.5 away from zero: magnitudes in [0.5, 1.5).
    x = rng.random(shape, dtype=np.float32)
    x *= np.float32(2)
    x -= np.float32(1)
    x += np.copysign(np.float32(0.5), x)
    return x


def arrays(workload, loss_scaled=True, seed=0):
    """Returns `(params, grads)`: lists of float32 NumPy arrays.

    Args:
        workload: The `Workload`.
        loss_scaled: Whether the gradients come multiplied by `LOSS_SCALE`
            (a power of two, so exactly), as a loss-scaled backward pass
            gives them.
        seed: Random seed; the same for every implementation.
    """
    rng = np.random.default_rng(seed)
    factor = np.float32(GRADIENT_MAGNITUDE)
    params, grads = [], []
    for shape in workload.shapes:
        params.append(_nonzero(rng, shape))
        grad = _nonzero(rng, shape)
        grad *= factor
        if loss_scaled:
            grad *= np.float32(LOSS_SCALE)
        grads.append(grad)
    return params, grads
