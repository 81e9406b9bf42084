"""A training script that knows nothing of ca_dynsaved: a custom op whose backward
(registered with register_autograd) passes ctx.scale / ctx.ratio to a
(Tensor, float, int) op, with values changing every step."""

import sys

import torch


@torch.library.custom_op("ca_dynsaved_script::pool_grad", mutates_args=())
def pool_grad(grad: torch.Tensor, scale: float, ratio: int) -> torch.Tensor:
    return grad * (scale * ratio)


@pool_grad.register_fake
def _(grad, scale, ratio):
    return torch.empty_like(grad)


@torch.library.custom_op("ca_dynsaved_script::pool", mutates_args=())
def pool(x: torch.Tensor, scale: float, ratio: int) -> torch.Tensor:
    return x * (scale * ratio)


@pool.register_fake
def _(x, scale, ratio):
    return torch.empty_like(x)


def _setup_context(ctx, inputs, output):
    _, ctx.scale, ctx.ratio = inputs


pool.register_autograd(lambda ctx, g: (pool_grad(g, ctx.scale, ctx.ratio), None, None), setup_context=_setup_context)

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 6
w = torch.ones(16, requires_grad=True)
for step in range(steps):
    loss = pool(w * 2, 0.5 + step, step + 1).sum()
    loss.backward()
print(f"script done: grad sum {w.grad.sum().item():.1f}")
if len(sys.argv) > 2:
    sys.exit(int(sys.argv[2]))
