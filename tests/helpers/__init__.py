"""What the tests share: code they hand to Ray's worker processes by import path (a factory model,
a tokenizer, workers that fail on purpose; tests/conftest.py ships this package to the workers with
Ray's runtime_env, py_modules, so nothing edits PYTHONPATH), the checks and run configs several test
modules use (parity, faults, Hugging Face cases, pipeline gradients), and the probes that the
system tests run as `python -m helpers.<probe>` from tests/."""
