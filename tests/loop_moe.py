"""The masked-loop MoE over a models.TopKMoE's stacked gelu experts, for test models that route
themselves (to read the router, or to route wrongly on purpose) and then combine as the loop
spelling does."""
import torch


def loop_experts(moe, x, weight, index):
    """out [R,D] = Σ_e (Σ_j w_j [idx_j = e]) · gelu(x W1[e] + b1[e]) W2[e] + b2[e]."""
    out = torch.zeros_like(x)
    for e in range(moe.w1.shape[0]):
        gate = (weight * (index == e)).sum(-1, keepdim=True)
        out = out + gate * (torch.nn.functional.gelu(x @ moe.w1[e] + moe.b1[e]) @ moe.w2[e] + moe.b2[e])
    return out
