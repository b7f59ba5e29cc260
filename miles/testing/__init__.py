"""Test doubles the test suite, the benchmarks and `python -m miles.launch --selftest` use.

Nothing in a training run imports this package: `fake_engine` stands in for an engine on the weight
path (a dict of tensors behind a WeightReceiver), `noop` is a worker that does almost nothing.
"""
