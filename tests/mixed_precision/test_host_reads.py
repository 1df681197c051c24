"""`summary()` and `check()`: the loss-scale state read on the host, between steps."""

import numpy as np
import pytest

import lossscale as ls
from lossscale.mixed_precision import LossScaleError

pytestmark = pytest.mark.filterwarnings("ignore::lossscale.mixed_precision.UnscaledLossWarning")


def built(backend, **kwargs):
    params = [backend.array(np.random.default_rng(0).normal(size=(3,)))]
    opt = ls.LossScaleOptimizer(ls.optimizers.SGD(0.1), initial_scale=8.0, **kwargs)
    opt.build(params)
    return params, opt


def test_summary_reads_given_values_instead_of_the_variables(backend):
    params, opt = built(backend, dynamic_growth_steps=2)
    values = [v.value for v in opt.variables]
    bad = [backend.array(np.array([np.inf, 1.0, 2.0]))]
    _, values = opt.stateless_apply(values, bad, [p for p in params])
    assert opt.summary(values) == {"dynamic_scale": 4.0, "step_counter": 0}
    assert opt.summary() == {"dynamic_scale": 8.0, "step_counter": 0}  # untouched


def test_check_raises_only_on_a_recorded_error(backend):
    params, opt = built(backend, max_consecutive_skips=0)
    values = [v.value for v in opt.variables]
    opt.check(values)  # nothing recorded yet
    bad = [backend.array(np.array([np.nan, 1.0, 2.0]))]
    _, values = opt.stateless_apply(values, bad, list(params))
    with pytest.raises(LossScaleError, match="Loss scaling failed at step 0"):
        opt.check(values)
    opt.check()  # the optimizer's own variables recorded nothing


def test_values_must_match_the_variables_one_for_one(backend):
    _, plain = built(backend)
    _, limited = built(backend, max_consecutive_skips=3)
    for opt, method in (
        (plain, plain.summary),
        (limited, limited.summary),
        (limited, limited.check),
    ):
        count = len(opt.variables)
        with pytest.raises(
            ValueError,
            match=(
                rf"`optimizer_variables` must hold one value per optimizer variable "
                rf"\({count}\). Received: {count - 1} values"
            ),
        ):
            method([v.value for v in opt.variables][:-1])
    plain.check([])  # without limits there is nothing to check, and nothing is read
