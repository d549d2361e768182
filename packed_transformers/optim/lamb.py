"""LAMB (You et al., "Large Batch Optimization for Deep Learning", 2019), vectorised.

For every parameter tensor w with gradient g, at step t (1-based):

    g      <- g * min(1, max_grad_norm / ||all g||)        (optional global clipping)
    m      <- beta1 m + (1 - beta1) g
    v      <- beta2 v + (1 - beta2) g^2
    m_hat  =  m / (1 - beta1^t),  v_hat = v / (1 - beta2^t)  (bias_correction; else m, v)
    u      =  m_hat / (sqrt(v_hat) + eps) + weight_decay * w   (decoupled decay inside u)
    r      =  min(||w||, max_weight_norm) / ||u||   if both norms > 0, else 1
    w      <- w - lr * r * u

The step is memory-bound, so it is written as few passes over memory as possible:
torch._foreach_* kernels on CUDA; on CPU per-tensor ops into one persistent scratch
buffer per parameter (one extra parameter-sized buffer of memory; it is not saved in
the state_dict), because a fresh buffer per step costs more in page faults than the
arithmetic. Bias corrections and gradient clipping are folded into scalars.
"""

from __future__ import annotations

import functools
import math

import torch


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (an FSDP2 shard); a plain tensor as it is."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def tensor_norms(tensors: list[torch.Tensor]) -> torch.Tensor:
    """[n] the L2 norm of each whole tensor: of a plain tensor its own; of DTensors sharded
    over ranks (FSDP2), every rank's sum of squares of its shard summed over the mesh, so that
    a trust ratio or a clipping norm is the whole parameter's on every rank, as unsharded."""
    if not tensors:
        return torch.zeros(0)
    if not hasattr(tensors[0], "to_local"):
        return torch.stack(torch._foreach_norm(tensors))
    return shard_norms([t.to_local() for t in tensors], tensors[0].device_mesh.get_group())


def shard_norms(parts: list[torch.Tensor], group) -> torch.Tensor:
    """[n] the whole tensors' L2 norms from this rank's parts of them: each part's sum of
    squares, summed over the ranks of `group` (a collective: every rank calls it)."""
    import torch.distributed as dist

    squares = torch.stack([part.float().pow(2).sum() for part in parts])
    dist.all_reduce(squares, group=group)
    return squares.sqrt()


def _check_hyperparameters(lr, betas, eps, weight_decay, max_grad_norm, max_weight_norm):
    if not (isinstance(lr, (float, int)) and math.isfinite(lr) and lr >= 0):
        raise ValueError(f"Lamb: lr must be a finite number >= 0, got {lr!r}")
    if len(betas) != 2 or not all(math.isfinite(b) and 0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"Lamb: betas must both be in [0, 1), got {betas!r}")
    if not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"Lamb: eps must be >= 0, got {eps!r}")
    if not (math.isfinite(weight_decay) and weight_decay >= 0):
        raise ValueError(f"Lamb: weight_decay must be >= 0, got {weight_decay!r}")
    for name, value in (("max_grad_norm", max_grad_norm), ("max_weight_norm", max_weight_norm)):
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ValueError(f"Lamb: {name} must be None or > 0, got {value!r}")


class Lamb(torch.optim.Optimizer):
    """LAMB with decoupled weight decay, optional bias correction and clipping.

    Args:
        params: tensors or parameter groups (see optim.param_groups.weight_decay_groups).
        lr: learning rate (set by a schedule each step).
        betas: (beta1, beta2) decay rates of the first and second moments, in [0, 1).
        eps: added to sqrt(v_hat).
        weight_decay: decoupled decay coefficient applied inside the trust-ratio update.
        bias_correction: divide moments by (1 - beta^t); MLPerf IPU submissions ran without.
        max_grad_norm: clip the global gradient norm (over all groups) to this value.
        max_weight_norm: clip ||w|| in the trust ratio to this value.
        compiled: run each group's update through torch.compile (one fused program per
            group; the first step compiles). The same arithmetic as the foreach path.
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas=(0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        bias_correction: bool = True,
        max_grad_norm: float | None = None,
        max_weight_norm: float | None = None,
        compiled: bool = False,
    ):
        _check_hyperparameters(lr, betas, eps, weight_decay, max_grad_norm, max_weight_norm)
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            bias_correction=bias_correction,
            max_weight_norm=max_weight_norm,
        )
        super().__init__(params, defaults)
        self.max_grad_norm = max_grad_norm
        # compiled: each group's update is one torch.compile'd function (inductor fuses the
        # moment updates, norms and the weight update into few passes over memory); the
        # hyperparameters reach it as one device tensor, so a new lr or step never recompiles.
        self.compiled = compiled
        self._compiled_update = None
        self._scratch: dict[torch.Tensor, torch.Tensor] = {}  # CPU only; not part of the state

    def _scratch_for(self, p: torch.Tensor) -> torch.Tensor:
        buffer = self._scratch.get(p)
        if buffer is None or buffer.shape != p.shape or buffer.dtype != p.dtype:
            buffer = self._scratch[p] = torch.empty_like(p)
        return buffer

    def state_dict(self):
        state = super().state_dict()
        state["max_grad_norm"] = self.max_grad_norm
        return state

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        self.max_grad_norm = state_dict.pop("max_grad_norm", self.max_grad_norm)
        super().load_state_dict(state_dict)

    @torch.no_grad()
    def global_grad_norm(self) -> torch.Tensor:
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        if not grads:
            return torch.zeros(())
        return torch.linalg.vector_norm(tensor_norms(grads))

    @torch.no_grad()
    def step(self, closure=None, grad_norm: torch.Tensor | None = None):
        """One LAMB step. grad_norm: the global gradient norm when the caller already has it
        (the run's finiteness check computes it), so that clipping does not compute it
        again. Clipping scales the gradients in place by a device tensor: no host sync."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.max_grad_norm is not None:
            grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
            if grads:
                norm = self.global_grad_norm() if grad_norm is None else grad_norm
                coefficient = (self.max_grad_norm / norm.to(grads[0].device).float().clamp(min=1e-12)).clamp(
                    max=1.0
                )
                torch._foreach_mul_([local_part(g) for g in grads], coefficient)
        for group in self.param_groups:
            self._step_group(group)
        return loss

    def _step_group(self, group):
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return
        if any(p.grad.is_sparse for p in params):
            raise RuntimeError("Lamb does not support sparse gradients")
        beta1, beta2 = group["betas"]
        grads, exp_avgs, exp_avg_sqs = [], [], []
        for p in params:
            state = self.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float64)
                # a DTensor parameter's moments are DTensors of its placements (as saved whole)
                like = {} if hasattr(p, "to_local") else {"memory_format": torch.preserve_format}
                state["exp_avg"] = torch.zeros_like(p, **like)
                state["exp_avg_sq"] = torch.zeros_like(p, **like)
            state["step"] += 1
            grads.append(p.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
        step = float(self.state[params[0]]["step"])  # all tensors of a group step together
        # Sharded (FSDP2 DTensors): the arithmetic runs on each rank's shards, the norms of the
        # trust ratio over whole tensors (tensor_norms); the state stays DTensors, as saved.
        sharded = hasattr(params[0], "to_local")
        norm_of = tensor_norms
        if sharded:
            if self.compiled:
                raise RuntimeError("Lamb(compiled=True) does not take sharded (FSDP2) parameters")
            norm_of = functools.partial(shard_norms, group=params[0].device_mesh.get_group())
            params, grads = [p.to_local() for p in params], [g.to_local() for g in grads]
            exp_avgs, exp_avg_sqs = [m.to_local() for m in exp_avgs], [v.to_local() for v in exp_avg_sqs]

        # Bias corrections are folded into scalars so that no extra pass over memory is
        # needed (the step is memory-bound):  with c = sqrt(1-b2^t) / (1-b1^t),
        #   u = m_hat / (sqrt(v_hat) + eps) + wd w  =  c * (m / (sqrt(v) + eps') + (wd/c) w),
        # eps' = eps sqrt(1-b2^t). The trust ratio ||w|| / ||u|| cancels c except where it is 1.
        if group["bias_correction"]:
            bias2_sqrt = math.sqrt(1.0 - beta2**step)
            scale = bias2_sqrt / (1.0 - beta1**step)
        else:
            bias2_sqrt, scale = 1.0, 1.0
        eps = group["eps"] * bias2_sqrt
        if self.compiled:
            if self._compiled_update is None:
                self._compiled_update = torch.compile(lamb_group_update, fullgraph=True, dynamic=False)
            hyper = torch.tensor(
                [1.0 - beta1, beta2, 1.0 - beta2, eps, group["weight_decay"] / scale, -group["lr"], scale],
                dtype=torch.float32,
            ).to(params[0].device, non_blocking=True)
            self._compiled_update(params, grads, exp_avgs, exp_avg_sqs, hyper, group["max_weight_norm"])
            return

        torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)  # m = beta1 m + (1-beta1) g
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1.0 - beta2)
        del grads
        on_cpu = params[0].device.type == "cpu"
        if on_cpu:
            # A fresh 1.3 GB buffer per step (BERT-Large) costs page faults that can exceed
            # the arithmetic on CPU; a persistent scratch buffer per tensor avoids them.
            updates = [self._scratch_for(p) for p in params]
            for u, m, v in zip(updates, exp_avgs, exp_avg_sqs):
                torch.sqrt(v, out=u).add_(eps)
                torch.div(m, u, out=u)  # u / c
        else:  # the CUDA caching allocator reuses memory; foreach kernels are the fast path
            updates = torch._foreach_sqrt(exp_avg_sqs)
            torch._foreach_add_(updates, eps)
            torch._foreach_reciprocal_(updates)
            torch._foreach_mul_(updates, exp_avgs)  # u / c
        if group["weight_decay"] != 0:
            torch._foreach_add_(updates, params, alpha=group["weight_decay"] / scale)

        weight_norms = norm_of(params)
        if group["max_weight_norm"] is not None:
            weight_norms = torch.clamp(weight_norms, max=group["max_weight_norm"])
        scaled_update_norms = norm_of(updates)  # ||u|| / c
        usable = (weight_norms > 0) & (scaled_update_norms > 0)
        # w <- w - lr * r * u  with r = ||w|| / ||u|| (or 1), and u = c * updates.
        step_sizes = -group["lr"] * torch.where(
            usable,
            weight_norms / torch.where(usable, scaled_update_norms, 1.0),
            torch.full_like(weight_norms, scale),
        )
        if on_cpu:
            # On CPU one fused pass per tensor beats foreach mul + add (two passes).
            for p, u, a in zip(params, updates, step_sizes.tolist()):
                p.add_(u, alpha=a)
        else:
            torch._foreach_mul_(updates, list(step_sizes.unbind()))
            torch._foreach_add_(params, updates)


def lamb_group_update(params, grads, exp_avgs, exp_avg_sqs, hyper: torch.Tensor, max_weight_norm):
    """One group's LAMB update, written per tensor for torch.compile to fuse (Lamb(compiled=True)).

    hyper: float32 [7] on the parameters' device: 1-beta1, beta2, 1-beta2, eps' (eps scaled by
    sqrt(1-beta2^t)), wd/c, -lr, c (c = sqrt(1-beta2^t)/(1-beta1^t), 1 without bias correction).
    The arithmetic is the foreach path's: u/c = m / (sqrt(v) + eps') + (wd/c) w; r = ||w|| /
    ||u/c|| where both norms are > 0, else the step uses c itself. Updates m, v and w in place.
    """
    one_minus_beta1, beta2, one_minus_beta2, eps, decay, neg_lr, scale = hyper.unbind()
    for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs):
        m.lerp_(g, one_minus_beta1.to(m.dtype))
        v.mul_(beta2).add_(g * g * one_minus_beta2)
        update = m / (v.sqrt() + eps) + decay * p
        weight_norm = torch.linalg.vector_norm(p)
        if max_weight_norm is not None:
            weight_norm = weight_norm.clamp(max=max_weight_norm)
        update_norm = torch.linalg.vector_norm(update)
        usable = (weight_norm > 0) & (update_norm > 0)
        ratio = torch.where(usable, weight_norm / torch.where(usable, update_norm, 1.0), scale)
        p.add_(update * (neg_lr * ratio))
