"""``state_bits`` and ``block_size``: the pinned API of 8-bit states, its errors (before anything
changes), and what ``state_bits=8`` keeps (Note [low-bit variants])."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch

import scaledoptim
from scaledoptim.fused.lowbit import LowBitStates

LOWBIT_CLASSES = [
    scaledoptim.Adam, scaledoptim.AdamW, scaledoptim.Lion, scaledoptim.SGD, scaledoptim.RMSprop
]


@pytest.mark.parametrize("cls", [*LOWBIT_CLASSES, scaledoptim.Adagrad], ids=lambda c: c.__name__)
@pytest.mark.parametrize("state_bits", [7, 0, 33, "8", 8.5, 16, True, None, -8])
def test_other_state_bits_are_refused_naming_the_option(cls: type, state_bits: object) -> None:
    param = torch.nn.Parameter(torch.ones(3))
    with pytest.raises((ValueError, TypeError), match="state_bits"):
        cls([param], lr=1e-3, state_bits=state_bits, block_size=256)
    assert torch.equal(param, torch.ones(3)) and param.grad is None


@pytest.mark.parametrize("cls", [*LOWBIT_CLASSES, scaledoptim.Adagrad], ids=lambda c: c.__name__)
@pytest.mark.parametrize("state_bits", [8, 32])
@pytest.mark.parametrize(
    ("block_size", "error"),
    [(0, ValueError), (-256, ValueError), (2.5, ValueError), (256.0, ValueError),
     ("256", TypeError), (None, TypeError), (True, TypeError), (2**40, ValueError)],
)
def test_block_size_must_be_a_positive_int(
    cls: type, state_bits: int, block_size: object, error: type
) -> None:
    with pytest.raises(error, match="block_size"):
        cls([torch.nn.Parameter(torch.ones(3))], lr=1e-3, state_bits=state_bits,
            block_size=block_size)


#: Per class, options that turn every state it keeps in 8 bits on, and those states.
EVERY_STATE = {
    scaledoptim.Adam: ({"amsgrad": True}, ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")),
    scaledoptim.AdamW: ({"amsgrad": True}, ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")),
    scaledoptim.Lion: ({}, ("exp_avg",)),
    scaledoptim.SGD: ({"momentum": 0.9}, ("momentum_buffer",)),
    scaledoptim.RMSprop: ({"momentum": 0.9}, ("square_avg", "momentum_buffer")),
}


@pytest.mark.parametrize("cls", LOWBIT_CLASSES, ids=lambda c: c.__name__)
def test_float32_states_are_the_default_and_unchanged(cls: type) -> None:
    options, keys = EVERY_STATE[cls]
    param = torch.nn.Parameter(torch.ones(3))
    opt = cls([param], lr=1e-3, **options)
    assert type(opt) is cls and "state_bits" not in opt.defaults
    assert opt.defaults == cls([param], lr=1e-3, state_bits=32, block_size=64, **options).defaults
    param.grad = torch.ones(3)
    opt.step()
    assert sorted(opt.state[param]) == sorted([*keys, "step"])
    assert all(opt.state[param][key].dtype == torch.float32 for key in keys)


@pytest.mark.parametrize("cls", LOWBIT_CLASSES, ids=lambda c: c.__name__)
def test_state_bits_8_keeps_codes_and_scales(cls: type) -> None:
    options, keys = EVERY_STATE[cls]
    param = torch.nn.Parameter(torch.ones(5, 100))
    opt = cls([param], lr=1e-3, state_bits=8, block_size=128, **options)
    assert isinstance(opt, cls) and isinstance(opt, LowBitStates)
    assert type(opt).__name__ == cls.__name__
    assert opt.param_groups[0]["state_bits"] == 8 and opt.param_groups[0]["block_size"] == 128
    param.grad = torch.ones(5, 100)
    opt.step()
    state = opt.state[param]
    assert sorted(state) == sorted([f"{k}_{part}" for k in keys for part in ("codes", "scales")]
                                   + ["step"])
    for key in keys:
        assert state[f"{key}_codes"].dtype == torch.uint8
        assert state[f"{key}_codes"].shape == param.shape
        assert state[f"{key}_scales"].dtype == torch.float32
        assert state[f"{key}_scales"].shape == (4,)  # 500 elements in blocks of 128


def test_a_million_element_param_keeps_at_most_2_2_bytes_per_element() -> None:
    param = torch.nn.Parameter(torch.zeros(1000, 1000))
    opt = scaledoptim.AdamW([param], lr=1e-3, state_bits=8, block_size=256)
    param.grad = torch.randn(1000, 1000)
    opt.step()
    state_bytes = sum(
        v.numel() * v.element_size() for k, v in opt.state[param].items() if k != "step"
    )
    assert state_bytes / param.numel() <= 2.2  # 2 codes + 2 scales per 256: 2.03


def test_each_group_keeps_the_optimizers_state_bits_and_block_size() -> None:
    first, second = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    with pytest.raises(ValueError, match="per optimizer"):
        scaledoptim.AdamW(
            [{"params": [first]}, {"params": [second], "block_size": 64}], state_bits=8
        )
    opt = scaledoptim.AdamW([first], state_bits=8)
    first.grad = torch.ones(3)
    opt.step()
    before = {k: v.clone() for k, v in opt.state[first].items()}
    opt.param_groups[0]["block_size"] = 32
    with pytest.raises(ValueError, match="per optimizer"):
        opt.step()
    assert all(torch.equal(before[k], v) for k, v in opt.state[first].items())


def test_differentiable_steps_take_float32_states() -> None:
    with pytest.raises(ValueError, match="differentiable"):
        scaledoptim.Adam([torch.nn.Parameter(torch.ones(3))], state_bits=8, differentiable=True)


def test_a_float32_optimizer_refuses_an_8_bit_state_dict() -> None:
    param = torch.nn.Parameter(torch.ones(3))
    opt = scaledoptim.AdamW([param], state_bits=8)
    param.grad = torch.ones(3)
    opt.step()
    plain = scaledoptim.AdamW([param])
    with pytest.raises(ValueError, match="state_bits=8"):
        plain.load_state_dict(opt.state_dict())
    assert not plain.state


@pytest.mark.parametrize("clone", [copy.deepcopy, lambda o: pickle.loads(pickle.dumps(o))])
def test_an_8_bit_optimizer_copies_and_pickles(clone) -> None:
    param = torch.nn.Parameter(torch.ones(300))
    opt = scaledoptim.AdamW([param], lr=0.1, state_bits=8, block_size=64)
    param.grad = torch.ones(300)
    opt.step()
    copied = clone(opt)
    assert type(copied) is type(opt) and isinstance(copied, scaledoptim.AdamW)
    assert torch.equal(copied.state_dict()["state"][0]["exp_avg_codes"],
                       opt.state[param]["exp_avg_codes"])


def test_a_state_dict_of_8_bit_states_loads_weights_only() -> None:
    param = torch.nn.Parameter(torch.ones(300))
    opt = scaledoptim.AdamW([param], lr=0.1, state_bits=8, block_size=64)
    param.grad = torch.ones(300)
    opt.step()
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert loaded["param_groups"][0]["state_bits"] == 8
    assert loaded["state"][0]["exp_avg_codes"].dtype == torch.uint8


def test_adagrad_keeps_float32_states_and_says_why() -> None:
    with pytest.raises(ValueError, match="state_sum is a sum"):
        scaledoptim.Adagrad([torch.nn.Parameter(torch.ones(3))], state_bits=8)


def test_centered_rmsprop_keeps_float32_states_and_says_why() -> None:
    with pytest.raises(ValueError, match="centered=True keeps float32 states"):
        scaledoptim.RMSprop([torch.nn.Parameter(torch.ones(3))], centered=True, state_bits=8)


def test_with_every_8_bit_state_off_the_step_is_the_float32_one() -> None:
    """SGD without momentum keeps no state to encode: its torch form runs as with float32
    states."""
    params = [torch.nn.Parameter(torch.linspace(-1, 1, 600).view(2, 300)) for _ in range(2)]
    lowbit = scaledoptim.SGD([params[0]], lr=0.1, state_bits=8, block_size=64)
    float32 = scaledoptim.SGD([params[1]], lr=0.1)
    for opt, param in ((lowbit, params[0]), (float32, params[1])):
        param.grad = torch.linspace(0, 1, 600).view(2, 300)
        opt.step()
    assert torch.equal(params[0], params[1])
    assert list(lowbit.state[params[0]]) == ["step"]
