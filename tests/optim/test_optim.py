"""LAMB against an independent numpy reference; the beta^p statement; schedules;
accumulation arithmetic; exact resume; PopTorch mapping; bad hyperparameters."""

import copy
import math

import numpy as np
import pytest
import torch

from packed_transformers.optim import (
    Lamb,
    WarmupPolyDecay,
    adjust_for_packing,
    packing_factor_from_metadata,
    poptorch_lamb_kwargs,
    weight_decay_groups,
)
from packed_transformers.optim.lamb import lamb_group_update


def numpy_lamb(
    weights, grads_per_step, lr, betas, eps, decays, bias_correction, max_grad_norm=None, max_weight_norm=None
):
    """Reference LAMB in float64 numpy, written from the paper, one tensor at a time."""
    w = [x.astype(np.float64).copy() for x in weights]
    m = [np.zeros_like(x) for x in w]
    v = [np.zeros_like(x) for x in w]
    b1, b2 = betas
    for t, grads in enumerate(grads_per_step, start=1):
        grads = [g.astype(np.float64) for g in grads]
        if max_grad_norm is not None:
            total = math.sqrt(sum(float((g * g).sum()) for g in grads))
            scale = min(1.0, max_grad_norm / total) if total > 0 else 1.0
            grads = [g * scale for g in grads]
        for i, g in enumerate(grads):
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            m_hat = m[i] / (1 - b1**t) if bias_correction else m[i]
            v_hat = v[i] / (1 - b2**t) if bias_correction else v[i]
            u = m_hat / (np.sqrt(v_hat) + eps) + decays[i] * w[i]
            w_norm = float(np.linalg.norm(w[i]))
            if max_weight_norm is not None:
                w_norm = min(w_norm, max_weight_norm)
            u_norm = float(np.linalg.norm(u))
            trust = w_norm / u_norm if w_norm > 0 and u_norm > 0 else 1.0
            w[i] = w[i] - lr * trust * u
    return w


@pytest.mark.parametrize("compiled", [False, True], ids=["foreach", "compiled-math"])
@pytest.mark.parametrize("bias_correction", [True, False])
@pytest.mark.parametrize("max_grad_norm,max_weight_norm", [(None, None), (0.5, None), (None, 0.3)])
def test_lamb_matches_numpy_reference(bias_correction, max_grad_norm, max_weight_norm, compiled):
    """compiled: Lamb(compiled=True)'s per-group function, run eagerly here (torch.compile's
    own code generation is checked on CUDA, tests/model/test_cuda.py)."""
    rng = np.random.default_rng(0)
    shapes = [(5, 7), (7,), (3, 2, 4), (1,)]
    weights = [rng.normal(size=s).astype(np.float32) for s in shapes]
    weights[3][:] = 0.0  # zero weight norm: trust ratio 1
    steps = [[rng.normal(size=s).astype(np.float32) for s in shapes] for _ in range(6)]
    steps[2][1][:] = 0.0  # a zero gradient at one step
    decays = [0.01, 0.0, 0.01, 0.0]  # bias-like tensors excluded from decay
    params = [torch.nn.Parameter(torch.from_numpy(w.copy())) for w in weights]
    groups = [
        {"params": [params[0], params[2]], "weight_decay": 0.01},
        {"params": [params[1], params[3]], "weight_decay": 0.0},
    ]
    opt = Lamb(
        groups,
        lr=0.05,
        betas=(0.9, 0.999),
        eps=1e-6,
        bias_correction=bias_correction,
        max_grad_norm=max_grad_norm,
        max_weight_norm=max_weight_norm,
        compiled=compiled,
    )
    if compiled:
        opt._compiled_update = lamb_group_update  # the function torch.compile would be given
    for grads in steps:
        for p, g in zip(params, grads):
            p.grad = torch.from_numpy(g.copy())
        opt.step()
    expected = numpy_lamb(
        weights, steps, 0.05, (0.9, 0.999), 1e-6, decays, bias_correction, max_grad_norm, max_weight_norm
    )
    for p, e in zip(params, expected):
        np.testing.assert_allclose(p.detach().numpy(), e, rtol=2e-5, atol=1e-6)


def test_zero_update_norm_gives_trust_one_and_no_nan():
    p = torch.nn.Parameter(torch.zeros(4))
    opt = Lamb([p], lr=0.1, weight_decay=0.0)
    p.grad = torch.zeros(4)
    opt.step()
    assert torch.equal(p.detach(), torch.zeros(4))


def test_beta_power_is_exact_for_constant_gradient():
    """p steps with (b1, b2) on a constant gradient == one step with (b1^p, b2^p)."""
    g = torch.tensor([0.3, -1.2, 2.0])
    b1, b2, p = 0.9, 0.999, 3
    m = torch.tensor([0.1, 0.2, -0.4])
    v = torch.tensor([0.5, 0.1, 0.2])
    m_many, v_many = m.clone(), v.clone()
    for _ in range(p):
        m_many = b1 * m_many + (1 - b1) * g
        v_many = b2 * v_many + (1 - b2) * g * g
    adjusted = adjust_for_packing("same_packs_per_step", p, 8, (b1, b2))
    a1, a2 = adjusted.betas
    torch.testing.assert_close(a1 * m + (1 - a1) * g, m_many)
    torch.testing.assert_close(a2 * v + (1 - a2) * g * g, v_many)
    # And through the optimizer: its moment state after one adjusted step from zero.
    w = torch.nn.Parameter(torch.ones(3))
    opt = Lamb([w], lr=0.0, betas=adjusted.betas)
    w.grad = g.clone()
    opt.step()
    torch.testing.assert_close(opt.state[w]["exp_avg"], (1 - b1**p) * g)


@pytest.mark.parametrize(
    "ga,p,expected",
    [(64, 2.0, 32), (3, 2.0, 2), (1, 2.0, 1), (1, 3.5, 1), (10, 3.0, 3), (7, 1.0, 7), (5, 4.9, 1)],
)
def test_accumulation_arithmetic(ga, p, expected):
    adjusted = adjust_for_packing("same_sequences_per_step", p, ga, (0.9, 0.999))
    assert adjusted.gradient_accumulation == expected >= 1
    assert adjusted.betas == (0.9, 0.999)
    none = adjust_for_packing("none", p, ga, (0.9, 0.999))
    assert none.gradient_accumulation == ga and none.betas == (0.9, 0.999)


@pytest.mark.parametrize("p", [0.5, float("nan"), float("inf"), -1, "2"])
def test_bad_packing_factor(p):
    with pytest.raises(ValueError, match="packing factor"):
        adjust_for_packing("same_packs_per_step", p, 4, (0.9, 0.999))


def test_packing_factor_from_metadata():
    assert packing_factor_from_metadata({"packing_factor": 1.99}) == 1.99
    with pytest.raises(ValueError, match="packing_factor"):
        packing_factor_from_metadata({})


def test_warmup_poly_decay_values():
    s = WarmupPolyDecay(peak_lr=4e-3, warmup_samples=1000, total_samples=10000, power=1.0)
    assert s(0) == 0.0
    assert s(500) == pytest.approx(2e-3)
    assert s(1000) == pytest.approx(4e-3 * (1 - 0.1))  # decay measured from sample 0 (MLPerf)
    assert s(5500) == pytest.approx(4e-3 * 0.45)
    assert s(10000) == 0.0 and s(20000) == 0.0
    offset = WarmupPolyDecay(4e-3, 1000, 10000, start_offset_samples=-500)
    assert offset(0) == pytest.approx(2e-3)  # negative offset: warmup already half done
    squared = WarmupPolyDecay(1.0, 0, 100, power=2.0)
    assert squared(50) == pytest.approx(0.25)


def test_resume_from_state_dict_is_bit_identical():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    data = [torch.randn(4, 6) for _ in range(8)]

    def make(m):
        return Lamb(weight_decay_groups(m.named_parameters(), 0.01), lr=0.01, max_grad_norm=1.0)

    def train(m, opt, batches):
        for x in batches:
            opt.zero_grad()
            m(x).pow(2).mean().backward()
            opt.step()

    straight = copy.deepcopy(model)
    opt = make(straight)
    train(straight, opt, data)

    first = copy.deepcopy(model)
    opt1 = make(first)
    train(first, opt1, data[:4])
    saved_model, saved_opt = copy.deepcopy(first.state_dict()), copy.deepcopy(opt1.state_dict())
    resumed = copy.deepcopy(model)
    resumed.load_state_dict(saved_model)
    opt2 = make(resumed)
    opt2.load_state_dict(saved_opt)
    train(resumed, opt2, data[4:])
    for a, b in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


def test_weight_decay_groups_exclude_bias_and_layernorm():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.LayerNorm(3))
    named = [
        ("encoder.dense.weight", model[0].weight),
        ("encoder.dense.bias", model[0].bias),
        ("encoder.LayerNorm.weight", model[1].weight),
        ("encoder.LayerNorm.bias", model[1].bias),
    ]
    decay, no_decay = weight_decay_groups(named, 0.01)
    assert decay["params"] == [model[0].weight] and decay["weight_decay"] == 0.01
    assert len(no_decay["params"]) == 3 and no_decay["weight_decay"] == 0.0


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"betas": (1.0, 0.999)}, "betas"),
        ({"betas": (0.9, -0.1)}, "betas"),
        ({"lr": -1.0}, "lr"),
        ({"weight_decay": -0.1}, "weight_decay"),
        ({"lr": float("nan")}, "lr"),
        ({"max_grad_norm": 0.0}, "max_grad_norm"),
    ],
)
def test_bad_hyperparameters(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Lamb([torch.nn.Parameter(torch.ones(2))], **kwargs)


def test_poptorch_mapping_without_poptorch():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.LayerNorm(3))
    groups = weight_decay_groups(model.named_parameters(), 0.01)
    adjusted = adjust_for_packing("same_packs_per_step", 2.0, 192, (0.62, 0.996))
    kwargs = poptorch_lamb_kwargs(
        groups, lr=2e-3, adjusted=adjusted, bias_correction=False, first_order_type="float16"
    )
    assert kwargs["betas"] == pytest.approx((0.62**2, 0.996**2))
    assert kwargs["bias_correction"] is False and kwargs["lr"] == 2e-3
    assert kwargs["first_order_momentum_accum_type"] is torch.float16
    assert kwargs["accum_type"] is torch.float32
    assert [g["weight_decay"] for g in kwargs["params"]] == [0.01, 0.0]
    with pytest.raises(ValueError, match="accum_type"):
        poptorch_lamb_kwargs(groups, 1e-3, adjusted, accum_type="int8")


def test_clipping_with_a_shared_gradient_norm_equals_computing_it():
    """The run's finiteness check hands LAMB the global gradient norm it computed; the
    step is then bit for bit the step that computes the norm itself."""
    torch.manual_seed(0)
    weights = [torch.randn(7, 5), torch.randn(5)]
    grads = [torch.randn(7, 5) * 3, torch.randn(5) * 3]
    results = []
    for share in (False, True):
        params = [torch.nn.Parameter(w.clone()) for w in weights]
        optimizer = Lamb(params, lr=0.01, max_grad_norm=1.0)
        for _ in range(3):
            for p, g in zip(params, grads):
                p.grad = g.clone()
            norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm([p.grad for p in params])))
            optimizer.step(grad_norm=norm if share else None)
        results.append([p.detach().clone() for p in params])
    for a, b in zip(*results):
        assert torch.equal(a, b)
