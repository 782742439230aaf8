"""AOTAutograd's min-cut partitioner trains a forward that writes a trained parameter in place wrong
(PERF_NOTES v65, v66): why backend._eager_where_inductor_miscomputes runs such a graph with
rest="eager". Ten lines of plain torch, no mha_compile, for an upstream report and for checking a
torch build (the GPU machine's 2.11):

    PYTHONPATH=. python bench/aot_min_cut_repro.py

prints, per backend, ∂x's relative error against eager: 0.25 under aot_eager and inductor (both
min-cut) on torch 2.13, 0 under the default partitioner, which Dynamo's cudagraphs backend (the
CUDA-graph trees) uses. The backward recomputes the write from the parameter already written: the
scale's sum read 2.5 where the forward's was 2.0.
"""
import copy

import torch

BACKENDS = ("eager", "aot_eager", "aot_eager_default_partitioner", "inductor")


class BumpsItsScale(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.tensor([1.0, 0.5]))
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        with torch.no_grad():
            self.scale.add_(0.25)
        return self.lin(x) * 3 * self.scale.sum()


def dx_error(backend, seed=0):
    """∂x of one training step compiled with `backend`, relative to eager's."""
    torch.manual_seed(seed)
    torch._dynamo.reset()
    eager = BumpsItsScale()
    model = copy.deepcopy(eager)
    x = torch.randn(3, 4)
    got, want = x.clone().requires_grad_(), x.clone().requires_grad_()
    torch.compile(model, backend=backend)(got).square().sum().backward()
    eager(want).square().sum().backward()
    return float((got.grad - want.grad).norm() / want.grad.norm())


if __name__ == "__main__":
    for name in BACKENDS:
        print(f"torch {torch.__version__}  {name:32s} ∂x relative error {dx_error(name):.3g}")
