"""The demo network in NumPy, differentiated by hand.

Float16 arithmetic follows what float16 matrix units do: products of
float16 inputs are summed in float32 and the result is rounded to float16.
Elementwise operations run in float16 directly.
"""

import numpy as np
from threadpoolctl import threadpool_limits

from lossscale.demo.models import check_precision, wrap


def _matmul(a, b, dtype):
    return (a.astype(np.float32) @ b.astype(np.float32)).astype(dtype)


def _column_sum(a, dtype):
    return a.astype(np.float32).sum(axis=0).astype(dtype)


def _softmax_cross_entropy(logits, y):
    logits = logits.astype(np.float32)
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    loss = -log_probs[np.arange(len(y)), y].mean(dtype=np.float32)
    return np.float32(loss), np.exp(log_probs)


def single_threaded():
    return threadpool_limits(limits=1)


class MLP:
    """Float32 master variables; float16 passes work on rounded copies."""

    backend = "numpy"

    def __init__(self, weights):
        self.variables = wrap([np.array(w, dtype=np.float32) for w in weights])

    def _forward(self, x, dtype):
        w1, b1, w2, b2 = (v.value.astype(dtype) for v in self.variables)
        x = x.astype(dtype)
        pre = _matmul(x, w1, dtype) + b1
        hidden = np.maximum(pre, 0)
        return x, pre, hidden, _matmul(hidden, w2, dtype) + b2

    def gradients(self, x, y, precision, loss_weight, scale_loss):
        check_precision(precision)
        # Overflow to inf (and inf * 0 = NaN after it) is expected with a
        # loss scale that is too large: the optimizer detects it and skips.
        with np.errstate(over="ignore", invalid="ignore"):
            return self._gradients(x, y, np.dtype(precision), loss_weight, scale_loss)

    def _gradients(self, x, y, dtype, loss_weight, scale_loss):
        x, pre, hidden, logits = self._forward(x, dtype)
        loss, probs = _softmax_cross_entropy(logits, y)
        # scale_loss is linear, so its derivative is its value at 1.
        seed = np.float32(scale_loss(np.float32(1.0))) * np.float32(loss_weight)
        probs[np.arange(len(y)), y] -= 1.0
        d_logits = (probs * (seed / len(y))).astype(dtype)  # float16 flushes here
        w2 = self.variables[2].value.astype(dtype)
        d_hidden = _matmul(d_logits, w2.T, dtype) * (pre > 0)
        grads = [
            _matmul(x.T, d_hidden, dtype),
            _column_sum(d_hidden, dtype),
            _matmul(hidden.T, d_logits, dtype),
            _column_sum(d_logits, dtype),
        ]
        return loss, grads

    def evaluate(self, x, y):
        *_, logits = self._forward(x, np.float32)
        loss, _ = _softmax_cross_entropy(logits, y)
        return float(loss), float((logits.argmax(axis=1) == y).mean())
