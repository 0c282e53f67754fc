"""A rank's gradients as whole tensors on the host, for tests and debugging that pin a wrong
gradient down to one parameter (Worker.gradients)."""

from __future__ import annotations

from torch.distributed.tensor import DTensor

from raymp.models.spec import clean_name


def full_gradients(engine) -> dict:
    """The full gradient of every parameter of this rank's modules, by plain name (collective
    under ZeRO and TP: every rank calls); the gradients are then cleared."""
    grads = {}
    for module in engine.modules:
        for name, param in module.named_parameters():
            grad = param.grad
            full = None if grad is None else grad.full_tensor() if isinstance(grad, DTensor) else grad
            grads[clean_name(name)] = None if full is None else full.detach().clone().cpu()
    engine.optimizer.zero_grad(set_to_none=True)
    engine.after_optimizer_step()
    return grads
