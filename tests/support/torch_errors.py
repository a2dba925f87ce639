"""One error input of torch's optimizer table, checked against a class as torch's suite checks
it (shared by the drop-in and the with_scaling tests)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from scaledoptim.testing.torch_optim_db import OptimizerErrorEnum


def assert_raises_as_torch_optim(cls: type[torch.optim.Optimizer], error_input: Any) -> None:
    """``cls`` raises (or warns) ``error_input.error_type`` matching its regex, at construction or
    at the first step as ``error_input.error_on`` says."""
    optim_input = error_input.optimizer_error_input
    error, regex = error_input.error_type, error_input.error_regex
    if error_input.error_on == OptimizerErrorEnum.CONSTRUCTION_ERROR:
        context = (
            pytest.warns(error, match=regex)
            if issubclass(error, Warning)
            else pytest.raises(error, match=regex)
        )
        with context:
            cls(optim_input.params, **optim_input.kwargs)
    else:
        opt = cls(optim_input.params, **optim_input.kwargs)
        with pytest.raises(error, match=regex):
            opt.step()
