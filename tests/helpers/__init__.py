"""Code the tests hand to Ray's worker processes by import path (a factory model, a tokenizer,
workers that fail on purpose). tests/conftest.py ships this package to the workers with Ray's
runtime_env (py_modules), so nothing edits PYTHONPATH."""
