"""The benchmark workloads: lists of float32 tensor shapes, and their data.

- `tiny`: a small transformer's 28 tensors (`TRANSFORMER`): fixed per-step
  and per-tensor costs dominate.
- `many_small`: 400 tensors of a small convolutional network, about 1M
  parameters: per-tensor overhead dominates.
- `gpt`: a small GPT's 29 tensors (`GPT`), the AdamW workload.
- `large`: 16 tensors of 1024x1024: memory bandwidth dominates.
- `gpu_tiny`, `gpu_many_small`: the same on CUDA; `gpu_large`: 64 tensors of
  2048x2048 on CUDA.

Parameters and gradients are random and never zero, the same for every
implementation; loss-scaling ones receive the gradients times `LOSS_SCALE`,
so every timed step is a finite, applied step.
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
    """One benchmark workload: its name, one shape per tensor, and `"cpu"` or `"cuda"`."""

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


# `tiny`, in torch's (out, in) layout: vocabulary 128, context 128, two
# `torch.nn.TransformerEncoderLayer(64, nhead, 256)`, 10 classes.
# Weight and bias of self_attn.in_proj (q, k and v packed), self_attn.out_proj,
# linear1, linear2, norm1 and norm2.
_ENCODER_LAYER = ((192, 64), (192,), (64, 64), (64,), (256, 64), (256,), (64, 256)) + ((64,),) * 5
TRANSFORMER = (
    ((128, 64), (128, 64))  # token embedding, learned position embedding
    + _ENCODER_LAYER * 2
    + ((10, 64), (10,))  # the head: weight, bias
)


# `gpt`: a GPT-2-style decoder in torch's (out, in) layout: vocabulary 2048,
# context 512, d_model 128, two blocks, a final norm and an untied head.
_D = 128
# Weight and bias of ln_1, attn.c_attn (q, k and v packed), attn.c_proj, ln_2,
# mlp.c_fc and mlp.c_proj.
_GPT_BLOCK = ((_D,), (_D,), (3 * _D, _D), (3 * _D,), (_D, _D), (_D,), (_D,), (_D,))
_GPT_BLOCK += ((4 * _D, _D), (4 * _D,), (_D, 4 * _D), (_D,))
GPT = (
    ((2048, _D), (512, _D))  # wte, wpe
    + _GPT_BLOCK * 2
    + ((_D,), (_D,), (2048, _D))  # ln_f.weight, ln_f.bias, lm_head.weight
)


def _eighths(shapes):
    return tuple(tuple(-(-d // 8) for d in s) for s in shapes)


def get(name, quick=False):
    """Returns the `Workload` called `name`; `quick=True` gives a tiny version for tests."""
    # quick: the same tensors, every dimension an eighth
    if name == "tiny":
        return Workload(name, _eighths(TRANSFORMER) if quick else TRANSFORMER, "cpu")
    if name == "gpt":
        return Workload(name, _eighths(GPT) if quick else GPT, "cpu")
    if name == "many_small":
        if quick:
            return Workload(name, _small_network((4, 6, 8), 24), "cpu")
        return Workload(name, _small_network((8, 12, 16, 20, 24, 28, 32, 36, 40), 400), "cpu")
    if name == "large":
        return Workload(name, ((128, 128),) * 2 if quick else ((1024, 1024),) * 16, "cpu")
    if name in ("gpu_tiny", "gpu_many_small"):
        return dataclasses.replace(get(name[4:], quick), name=name, device="cuda")
    if name == "gpu_large":
        return Workload(name, ((256, 256),) * 2 if quick else ((2048, 2048),) * 64, "cuda")
    raise ValueError(f"`workload` must be one of {NAMES}. Received: workload={name!r}")


CPU_NAMES = ("tiny", "many_small", "gpt", "large")
GPU_NAMES = ("gpu_tiny", "gpu_many_small", "gpu_large")
NAMES = CPU_NAMES + GPU_NAMES


def _nonzero(rng, shape):
    # Uniform in [-1, 1), pushed 0.5 away from zero: magnitudes in [0.5, 1.5).
    x = rng.random(shape, dtype=np.float32)
    x *= np.float32(2)
    x -= np.float32(1)
    x += np.copysign(np.float32(0.5), x)
    return x


def arrays(workload, loss_scaled=True, seed=0):
    """Returns `(params, grads)`, float32 arrays (grads times `LOSS_SCALE` if `loss_scaled`)."""
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
