"""What TensorFlow users plug in: lossscale inside TensorFlow's own tools.

- `trackable(optimizer)`: an optimizer's variables as an object
  `tf.train.Checkpoint` saves and restores, next to a model.

An optimizer itself needs nothing from here: it works on `tf.Variable`s and
`tf.Tensor`s directly, eagerly, inside `tf.function` (with or without
`jit_compile=True`) and under `tf.distribute.MirroredStrategy`.

Importing this package imports TensorFlow; `import lossscale` does not
import it.
"""

from lossscale.tensorflow.checkpoint import trackable

__all__ = ["trackable"]
