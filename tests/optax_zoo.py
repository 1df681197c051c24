"""Every optax and `optax.contrib` transformation, built from its signature.

`zoo()` enumerates the public callables of the installed `optax` and
`optax.contrib`: a callable annotated as returning a gradient
transformation is built from `ARGUMENTS` (one value per required argument
name) and must build; an unannotated one (`optax.contrib.dog`, `monitor`,
`optax.MultiSteps`, ...) joins when its required arguments are all in
`ARGUMENTS` and what it returns is a transformation. A transformation new
to optax therefore joins the zoo by itself, and one needing an argument
nobody has named fails the zoo's build test instead of dropping out.
"""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
import optax.contrib

SHAPES = {"w": (4, 3), "b": (3,)}
BATCH = 2  # per-example gradients (differential privacy)


def _labels(params):
    return {"w": "a", "b": "b"}


def _mask(params):
    return {"w": True, "b": False}


def _matrices(updates):
    return jax.tree_util.tree_map(lambda _: optax.contrib.MuonDimensionNumbers(), updates)


# One value per required argument name; wrappers wrap Adam.
ARGUMENTS = {
    "learning_rate": lambda: 0.01,
    "inner": lambda: optax.adam(0.01),
    "opt": lambda: optax.adam(0.01),
    "optimizer": lambda: optax.adam(0.01),
    "base_optimizer": lambda: optax.adam(0.01),
    "fast_optimizer": lambda: optax.adam(0.01),
    "adv_optimizer": lambda: optax.sgd(0.01),
    "tx": lambda: optax.adam(0.01),
    "inner_factory": lambda: optax.adam,
    "transforms": lambda: {"a": optax.adam(0.01), "b": optax.sgd(0.1, momentum=0.9)},
    "param_labels": lambda: _labels,
    "mask": lambda: _mask,
    "freeze_mask": lambda: _mask,
    "should_transform_fn": lambda: lambda step: step % 2 == 0,
    "every_k_schedule": lambda: 2,
    "max_consecutive_errors": lambda: 2,
    "clipping": lambda: 0.1,
    "eta": lambda: 0.01,
    "gamma": lambda: 0.55,
    "max_delta": lambda: 0.5,
    "threshold": lambda: 0.5,
    "max_norm": lambda: 1.0,
    "decay": lambda: 0.9,
    "step_size": lambda: 0.1,
    "step_size_fn": lambda: optax.exponential_decay(0.1, 2, 0.5),
    "sync_period": lambda: 2,
    "slow_step_size": lambda: 0.5,
    "measure": lambda: lambda updates: optax.global_norm(updates),
    "measure_name": lambda: "norm",
    "measures": lambda: {"norm": lambda updates: optax.global_norm(updates)},
    "f": lambda: lambda updates, params: jax.tree_util.tree_map(lambda u: 0.5 * u, updates),
    "max_backtracking_steps": lambda: 4,
    "max_linesearch_steps": lambda: 4,
    "l2_norm_clip": lambda: 1.0,
    "noise_multiplier": lambda: 0.1,
    "seed": lambda: 0,
}

# Built otherwise than from `ARGUMENTS`: factories of factories, and chains
# with something in them.
SPECIAL = {
    "optax.inject_hyperparams": lambda f: f(optax.adam)(learning_rate=0.01),
    "optax.inject_stateful_hyperparams": lambda f: f(optax.adam)(learning_rate=0.01),
    "optax.chain": lambda f: f(optax.clip_by_global_norm(1.0), optax.adamw(0.01)),
    "optax.named_chain": lambda f: f(("clip", optax.clip(1.0)), ("adam", optax.adam(0.01))),
    # Matrices only, unless told how to see a vector as one.
    "optax.contrib.scale_by_muon": lambda f: optax.masked(
        f(weight_dimension_numbers=_matrices), _mask
    ),
}

# Extra arguments beyond the loss `value`, `value_fn` and `grad`: optax's
# line searches refuse any their `value_fn` does not take.
OBJECTIVE = {"optax.contrib.sophia", "optax.contrib.hutchinson_estimator_diag_hessian"}

# Transformations of per-example gradients (a leading batch axis).
PER_EXAMPLE = {"optax.contrib.dpsgd", "optax.contrib.differentially_private_aggregate"}

# The types themselves, not transformations.
_NOT_TRANSFORMATIONS = {optax.GradientTransformation, optax.GradientTransformationExtraArgs}


def _annotated(function):
    try:
        return "GradientTransformation" in str(inspect.signature(function).return_annotation)
    except (TypeError, ValueError):
        return False


def _required(function):
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return None
    return [
        p.name
        for p in parameters
        if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]


def is_transformation(x):
    return isinstance(x, optax.GradientTransformation) or isinstance(x, optax.MultiSteps)


def build(name, function):
    """The transformation `function` makes, from `SPECIAL` or `ARGUMENTS`."""
    if name in SPECIAL:
        return SPECIAL[name](function)
    missing = [n for n in _required(function) if n not in ARGUMENTS]
    if missing:
        raise KeyError(f"{name} needs arguments the zoo does not know: {missing}")
    return function(**{n: ARGUMENTS[n]() for n in _required(function)})


def zoo():
    """`{qualified name: callable}` for every transformation of optax and optax.contrib."""
    found, seen = {}, set()
    for module in (optax, optax.contrib):
        for attribute in sorted(dir(module)):
            function = getattr(module, attribute)
            if attribute.startswith("_") or not callable(function):
                continue
            if function in _NOT_TRANSFORMATIONS or id(function) in seen:
                continue
            name = f"{module.__name__}.{attribute}"
            if _annotated(function) or name in SPECIAL:
                seen.add(id(function))
                found[name] = function
                continue
            required = _required(function)
            if required is None or any(n not in ARGUMENTS for n in required):
                continue
            if inspect.isclass(function) and not issubclass(function, optax.MultiSteps):
                continue  # states, named tuples, masks
            try:
                made = function(**{n: ARGUMENTS[n]() for n in required})
            except Exception:  # noqa: BLE001 - not a transformation factory
                continue
            if is_transformation(made):
                seen.add(id(function))
                found[name] = function
    return found


def params(seed=0):
    rng = np.random.default_rng(seed)
    return {k: jnp.asarray(rng.normal(size=s).astype(np.float32)) for k, s in SHAPES.items()}


def grads(seed, name, scale=1.0):
    """Unscaled gradients (per example for `PER_EXAMPLE`), times `scale`."""
    rng = np.random.default_rng(seed)
    batch = (BATCH,) if name in PER_EXAMPLE else ()
    return {
        k: jnp.asarray((rng.normal(size=batch + s) * scale).astype(np.float32))
        for k, s in SHAPES.items()
    }


def loss(p):
    return sum(jnp.sum(jnp.sin(x) * x) for x in jax.tree_util.tree_leaves(p))


def wrapped_params(transformation, p):
    """What `init` and `update` take as parameters (lookahead: fast and slow copies)."""
    if name_of_lookahead(transformation):
        return optax.LookaheadParams.init_synced(p)
    return p


def name_of_lookahead(transformation):
    init = getattr(transformation, "init", None)
    return init is not None and "lookahead" in getattr(init, "__qualname__", "")
