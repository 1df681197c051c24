"""`mixed_precision.diagnosis`: the host's components, on their own.

The persistent-skip watch acts once and as asked, the scale's use warns for
each way a loss and its gradients disagree (once per owner), and the
agreement's cadence and checks. Through the front ends: the
`*_diagnosis.py` tests beside each front end's.
"""

import copy
import pickle
import warnings

import numpy as np
import pytest

from lossscale.backends import get_ops
from lossscale.mixed_precision import (
    LossScaleError,
    PersistentSkipWarning,
    ScaleMismatchWarning,
    UnscaledLossWarning,
    diagnosis,
)

SUMMARY = {
    "dynamic_scale": 0.5,
    "persistent_step": 7,
    "overflows": [
        {"step": 7, "cause": "persistent", "variables": ["w"], "module": None, "loss_finite": True}
    ],
}


def test_the_watch_acts_once_as_asked():
    calls = []
    watch = diagnosis.PersistentWatch(calls.append)
    assert watch.reads_every_step
    watch.notice(-1, lambda: SUMMARY)  # nothing recorded yet
    watch.notice(None, lambda: SUMMARY)
    assert calls == [] and not watch.seen
    watch.notice(7, lambda: SUMMARY)
    watch.notice(7, lambda: SUMMARY)
    assert calls == [SUMMARY] and watch.seen
    raising = diagnosis.PersistentWatch("raise")
    with pytest.raises(
        LossScaleError,
        match=r"^Loss scaling: step 7 was skipped, persistent: the same 1 variable \(w\) stayed "
        r"non-finite through back-offs since step 7, down to scale 0.5; backing off cannot help",
    ):
        raising.notice(np.int32(7), lambda: SUMMARY, 1)
    warning = diagnosis.PersistentWatch("warn")
    assert not warning.reads_every_step
    with pytest.warns(PersistentSkipWarning, match="step 7 was skipped, persistent"):
        warning.notice(7, lambda: SUMMARY)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warning.notice(7, lambda: SUMMARY)  # once


def test_on_persistent_is_checked():
    for good in ("raise", "warn", print):
        assert diagnosis.check_on_persistent(good) is good
    with pytest.raises(
        ValueError,
        match=r'^`on_persistent` must be "raise", "warn" or a callable taking the summary dict. '
        r"Received: on_persistent='ignore'$",
    ):
        diagnosis.PersistentWatch("ignore")


def test_a_loss_scaled_twice_warns_once():
    use = diagnosis.ScaleUse("opt", 8.0)
    loss = np.ones(3)  # an array: its identity is kept
    once = loss * 8
    use.scaled(loss, once)
    with pytest.warns(ScaleMismatchWarning, match=r"^'opt': the loss was scaled twice"):
        use.scaled(once, once * 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        use.scaled(once * 8, once * 64)  # once per owner
        use.unscaling()


def test_a_scale_changed_in_between_warns():
    use = diagnosis.ScaleUse("opt", 8.0)
    use.scaled(np.ones(2), np.ones(2) * 8)
    use.unscaling()  # the same scale: nothing
    use.changed()  # a load between scaling the loss and unscaling its gradients
    with pytest.warns(ScaleMismatchWarning, match="the scale changed between scaling the loss"):
        use.unscaling()
    fresh = diagnosis.ScaleUse("opt", 8.0)
    fresh.changed()
    fresh.scaled(np.ones(2), np.ones(2))  # scaled after the load: the same factor
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fresh.unscaling()


def test_gradients_of_a_loss_never_scaled_warn_as_unscaled():
    use = diagnosis.ScaleUse("opt", 32768.0)
    with pytest.warns(UnscaledLossWarning, match="'opt' is applying gradients, but its"):
        use.unscaling()
    assert issubclass(UnscaledLossWarning, ScaleMismatchWarning)


def test_a_number_loss_keeps_no_identity_and_a_copy_no_reference():
    use = diagnosis.ScaleUse("opt", 8.0)
    use.scaled(1.0, 8.0)  # no weak reference to a float: nothing kept
    loss = np.ones(2)
    use.scaled(loss, loss * 8)
    for twin in (copy.deepcopy(use), pickle.loads(pickle.dumps(use))):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            twin.scaled(loss * 8, loss)  # the copy knows no earlier output
            twin.unscaling()


def test_the_agreement_is_due_every_n_steps_and_checked():
    assert [diagnosis.Agreement(3).due(s) for s in range(7)] == [
        False,
        False,
        True,
        False,
        False,
        True,
        False,
    ]
    assert not any(diagnosis.Agreement(None).due(s) for s in range(5))
    with pytest.raises(ValueError, match=r"`agreement_every` must be an integer >= 1"):
        diagnosis.Agreement(0)
    # One participant: nothing to compare, nothing read.
    ops = get_ops("numpy")
    diagnosis.Agreement(1).check(ops, None, {"scale": np.float32(2.0)}, step=0)
