"""Test support that ships with the package: the optimizer table (``optim_db``)."""
