"""gpytorch 1.15.2 (linear_operator 0.6.1): an exact GP's marginal likelihood by CG.

A library stock CA already compiles in one graph: the plugin must change no count.
With ``max_cholesky_size(0)`` the likelihood goes through linear_operator's
``InvQuadLogdet`` (ctx: representation trees, probe vectors, settings and ints it
uses as narrow lengths), and the kernel through gpytorch's ``RBFCovariance`` (ctx: a
closure, no number; its backward traces). The plugin runs ``InvQuadLogdet`` opaque
(its ints need their values: a new probe count would recompile stock) and leaves
``RBFCovariance`` to stock, after tracing its backward alone.

Quirk: none (its dependencies jaxtyping, mpmath and scikit-learn come unpinned).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from helpers import Counts
from loops import compare, node

#: A real library's training runs: the quick loop (docs/contributing.md) leaves them out.
pytestmark = pytest.mark.slow

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # its import-time deprecation notices
    import gpytorch

STEPS = 5


class _ExactGP(gpytorch.models.ExactGP):
    def __init__(self, x: torch.Tensor, y: torch.Tensor, likelihood: gpytorch.likelihoods.Likelihood) -> None:
        super().__init__(x, y, likelihood)
        self.mean = gpytorch.means.ConstantMean()
        self.covar = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())

    def forward(self, x: torch.Tensor) -> gpytorch.distributions.MultivariateNormal:
        return gpytorch.distributions.MultivariateNormal(self.mean(x), self.covar(x))


def test_exact_gp_marginal_likelihood_by_cg() -> None:
    torch.manual_seed(0)
    x = torch.linspace(0, 1, 24)
    y = torch.sin(x * 6.0) + 0.1 * torch.randn(24)
    likelihood = gpytorch.likelihoods.GaussianLikelihood()
    model = _ExactGP(x, y, likelihood)
    model.train()
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(likelihood, model)

    def step(i: int) -> torch.Tensor:
        torch.manual_seed(100 + i)  # the trace estimator's probe vectors, as eager's
        with gpytorch.settings.max_cholesky_size(0):
            return -mll(model(x), y)

    found = compare(step, list(model.parameters()), STEPS)
    assert found["stock"] == found["plugin"] == Counts(captures=1, compiles=1, graph_breaks=0)
    assert node("InvQuadLogdet").handling == "opaque"
    assert node("InvQuadLogdet").reason == "ctx.num_precond_args needs its value (guard Eq(ctx.num_precond_args, 0))"
    assert node("RBFCovariance").handling == "stock"
    assert node("RBFCovariance").reason.startswith("no int or float ctx attribute, and Dynamo traces its backward")
