"""model.layers computes what transformers' activation of the same name computes, bit
for bit, without importing transformers.activations (whose import brings torch._dynamo and
torch.distributed.tensor into every command's start-up)."""

from __future__ import annotations

import pytest
import torch

from packed_transformers.model.layers import FUNCTIONS, activation


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_activation_equals_transformers(name, dtype):
    from transformers.activations import ACT2FN

    x = (torch.randn(4, 257, generator=torch.Generator().manual_seed(0)) * 4).to(dtype)
    x[0, :5] = torch.tensor([0.0, -0.0, 1e-8, -30.0, 30.0])
    assert torch.equal(activation(name)(x), ACT2FN[name](x)), name


def test_a_name_not_listed_is_transformers_own():
    from transformers.activations import ACT2FN

    x = torch.linspace(-8, 8, 101)
    assert "relu6" not in FUNCTIONS
    assert torch.equal(activation("relu6")(x), ACT2FN["relu6"](x))
    with pytest.raises(KeyError):
        activation("no_such_activation")
