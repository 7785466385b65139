from lm_data import tiny_data  # noqa: F401
