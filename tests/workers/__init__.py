"""Scripts the tests run in subprocesses (several ranks, another Keras backend).

Each is run as `python tests/workers/NAME.py ...` and imported by its test
as `workers.NAME` for its constants and single-process helpers.
"""
