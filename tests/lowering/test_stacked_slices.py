"""Slices of a stacked parameter spelled otherwise than W[e]: the experts unbound (W1.unbind(0), in a
loop over zip(...)), taken by torch.select or W.select(0, e), by W.narrow(0, e, 1).squeeze(0) or
W[e:e+1][0]; K's and V's weights kept as one kv_w [2, D, D] and read by kv_w[i], .select(0, i) or
.unbind(0). Before, the unbound, narrowed and kv_w[i] spellings were refused (their
near-misses blamed the experts or the key projection), and W.select(0, e) was read as a tensor of its
own, stacked again on every call; the op now takes the stored stack, each slice as the user took it."""
import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from compiled_checks import as_eager_in_every_gradient, assert_one_match, compile_and_compare
from spellings import SpelledBlock, inputs

# SPEC's tiny preset (SpelledBlock's and inputs' defaults), and odd sizes: (block, inputs) keywords
SIZES = {"tiny": ({}, {}), "odd": (dict(D=21, P=3, F_=13, E=5, k=3), dict(B=3, H=2, N=7, D=21))}


def _args(sizes):
    return inputs(dtype=torch.float64, generator=torch.Generator().manual_seed(1), **SIZES[sizes][1])


def _stored(names):
    """Each parameter's node in the graph (Dynamo's l_self_parameters_<name>_), by its name."""
    return {name: f"l_self_parameters_{name}_" for name in names}


def _one_match(model, sizes):
    """The one match of model compiled in float64, its output and every gradient checked against eager's."""
    return assert_one_match(compile_and_compare(model.double(), _args(sizes), torch.float64))


def _assert_stored(match, names):
    """The op takes each named parameter as stored, not a torch.stack of its slices."""
    params = {name: match["params"][name] for name in names}
    assert params == _stored(params), params


class SlicedExperts(SpelledBlock):
    """The loop MoE with each expert's W1, W2, b1 and b2 taken from the stacks by `how`."""

    TAKE = {
        "torch.select": lambda p, e: torch.select(p, 0, e),
        "select": lambda p, e: p.select(0, e),
        "narrow.squeeze": lambda p, e: p.narrow(0, e, 1).squeeze(0),
        "[e:e+1].squeeze": lambda p, e: p[e:e + 1].squeeze(0),
        "[e:e+1][0]": lambda p, e: p[e:e + 1][0],
    }

    def __init__(self, how, **block):
        super().__init__(**block)
        self.how = how

    def _experts(self):
        """(e, (w1, w2, b1, b2)) for every expert."""
        stacks = (self.w1, self.w2, self.b1, self.b2)
        if self.how == "unbind zip":
            return enumerate(zip(*(p.unbind(0) for p in stacks)))
        if self.how == "unbind list":
            w1s, w2s, b1s, b2s = (p.unbind(0) for p in stacks)
            return ((e, (w1s[e], w2s[e], b1s[e], b2s[e])) for e in range(self.E))
        return ((e, tuple(self.TAKE[self.how](p, e) for p in stacks)) for e in range(self.E))

    def moe_forward(self, y):
        x = y.reshape(-1, y.shape[-1])
        weight, index = self.route(x)
        out = torch.zeros_like(x)
        for e, (w1, w2, b1, b2) in self._experts():
            gate = (weight * (index == e)).sum(dim=-1, keepdim=True)
            out = out + gate * (self._act(x @ w1 + b1) @ w2 + b2)
        return out.reshape(y.shape)


@pytest.mark.parametrize("sizes", list(SIZES))
@pytest.mark.parametrize("how", ["unbind zip", "unbind list", *SlicedExperts.TAKE])
def test_experts_sliced_from_their_stacks_match_and_train_as_eager(how, sizes):
    """The op takes the stored stacks themselves, not a torch.stack of their slices."""
    torch.manual_seed(0)
    _assert_stored(_one_match(SlicedExperts(how, **SIZES[sizes][0]), sizes), ("w1", "w2", "b1", "b2"))


class ExpertAxisSecond(SpelledBlock):
    """W1 stored [D, E, F] and W2 [F, E, D], their experts on axis 1: W1.unbind(1)[e] is expert e's
    [D, F], which is no W1[e] of the stored tensor (that would be [E, F]): each is read as a tensor of
    its own (an expert's nn.Linear weight, say), W1 and W2 alike."""

    def __init__(self, **block):
        super().__init__(**block)
        self.w1 = nn.Parameter(self.w1.detach().transpose(0, 1).contiguous())
        self.w2 = nn.Parameter(self.w2.detach().transpose(0, 1).contiguous())

    def moe_forward(self, y):
        x = y.reshape(-1, y.shape[-1])
        weight, index = self.route(x)
        out = torch.zeros_like(x)
        w1s, w2s = self.w1.unbind(1), self.w2.unbind(1)
        for e in range(self.E):
            gate = (weight * (index == e)).sum(dim=-1, keepdim=True)
            out = out + gate * (self._act(x @ w1s[e] + self.b1[e]) @ w2s[e] + self.b2[e])
        return out.reshape(y.shape)


def test_an_unbind_along_another_axis_is_no_expert_select():
    """Refused before (an item of the unbind's tuple was taken as a select on the tuple); now its
    items are stacked as separate experts' weights, and b1 is still read as its stored stack."""
    torch.manual_seed(0)
    model = ExpertAxisSecond().double()
    match = assert_one_match(compile_and_compare(model, _args("tiny"), torch.float64))
    assert match["params"]["w1"].startswith("stack(") and match["params"]["w2"].startswith("stack("), match["params"]
    assert match["params"]["b1"] == "l_self_parameters_b1_", match["params"]


class StackedKV(SpelledBlock):
    """K's and V's weights (and biases) kept as one stack kv_w [S, D, D] (kv_b [S, D]), read by `how`;
    K takes slice `key_at`, V slice `value_at` (S = the larger + 1, at least 2)."""

    TAKE = {
        "[i]": lambda p, i: p[i],
        "select": lambda p, i: p.select(0, i),
        "unbind": lambda p, i: p.unbind(0)[i],
    }

    def __init__(self, how, key_at=0, value_at=1, **block):
        super().__init__(**block)
        self.how, self.at = how, (key_at, value_at)
        size = max(key_at, value_at, 1) + 1
        self.kv_w = nn.Parameter(torch.randn(size, self.D, self.D) / math.sqrt(self.D))
        self.kv_b = nn.Parameter(0.1 * torch.randn(size, self.D))
        del self.key, self.value

    def _kv(self, tok):
        if self.how == "matmul":  # x @ Wᵀ + b, the bias added by hand
            return tuple(tok @ self.kv_w[i].mT + self.kv_b[i] for i in self.at)
        take = self.TAKE[self.how]
        return tuple(F.linear(tok, take(self.kv_w, i), take(self.kv_b, i)) for i in self.at)


@pytest.mark.parametrize("sizes", list(SIZES))
@pytest.mark.parametrize("how", [*StackedKV.TAKE, "matmul"])
def test_k_and_v_weights_in_one_stack_match_and_train_as_eager(how, sizes):
    torch.manual_seed(0)
    model = StackedKV(how, **SIZES[sizes][0]).double()
    match = assert_one_match(compile_and_compare(model, _args(sizes), torch.float64))
    assert {name: match["params"][name] for name in ("wk", "bk", "wv", "bv")} == {
        "wk": "l_self_parameters_kv_w_[0]", "bk": "l_self_parameters_kv_b_[0]",
        "wv": "l_self_parameters_kv_w_[1]", "bv": "l_self_parameters_kv_b_[1]"}, match["params"]


@pytest.mark.parametrize("key_at, value_at", [(0, 0), (2, 0)], ids=["one slice for both", "K from 2 of 3"])
def test_k_and_v_read_by_use_not_by_their_place_in_the_stack(key_at, value_at):
    """Which slice is K is read from the projection it feeds, not from its index: K and V tied to one
    slice (kv_w[0] for both) is the block with Wk = Wv, and the op gets that slice twice (autograd sums
    both gradients into it); a stack of three read at 2 and 0 gives the op those slices."""
    torch.manual_seed(0)
    model = StackedKV("[i]", key_at=key_at, value_at=value_at).double()
    match = assert_one_match(compile_and_compare(model, _args("tiny"), torch.float64))
    assert (match["params"]["wk"], match["params"]["wv"]) == (
        f"l_self_parameters_kv_w_[{key_at}]", f"l_self_parameters_kv_w_[{value_at}]"), match["params"]


class StackedKVBiasOnTokens(StackedKV):
    """V's bias kv_b[1] added along the token axis of (tok @ kv_w[1]ᵀ)ᵀ (N = D): not the block's V."""

    def _kv(self, tok):
        k = F.linear(tok, self.kv_w[0], self.kv_b[0])
        v = ((tok @ self.kv_w[1].mT).transpose(1, 2) + self.kv_b[1]).transpose(1, 2)
        return k, v


def test_a_stacked_bias_added_along_the_tokens_is_named():
    """kv_b[1] is read as V's [D] bias, so the near-miss says where it is added; it blamed the
    key's projection before (no slice of a stack was read as a projection's parameter)."""
    torch.manual_seed(0)
    args = inputs(N=32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    reasons = as_eager_in_every_gradient(StackedKVBiasOnTokens("[i]").double(), args, torch.float64)
    assert len(reasons) == 1 and "bias is added along the token axis" in reasons[0], reasons


class ShiftedProjectionInput(SpelledBlock):
    """A forward pre-hook on the key or value projection that shifts its input: tok + 0.5 projected
    there, tok itself by the other projection. Not the block."""

    def __init__(self, where):
        super().__init__()
        getattr(self, where).register_forward_pre_hook(lambda module, args: (args[0] + 0.5,))


@pytest.mark.parametrize("where", ["value", "key"])
def test_a_pre_hook_shifting_a_projection_s_input_is_named(where):
    """The near-miss named the einsum after the value projection (the reason of the walk from the
    shifted tokens, tried last); it names the add and says what it changes."""
    torch.manual_seed(0)
    args = inputs(dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    reasons = as_eager_in_every_gradient(ShiftedProjectionInput(where).double(), args, torch.float64)
    assert len(reasons) == 1 and reasons[0].startswith("add: the tokens are changed by add"), reasons
    assert "pre-hook" in reasons[0], reasons


class RowBiasExperts(SlicedExperts):
    """The loop MoE with W1[e] and W2[e], and each expert's b1 and b2 taken from their [E, F] and
    [E, D] stacks by `how`: a one-row slice kept [1, F] (it broadcasts over the rows as b[e] does), or
    the expert's column of b.T."""

    TAKE_BIAS = {
        "narrow(0, e, 1)": lambda b, e: b.narrow(0, e, 1),
        "[e:e+1]": lambda b, e: b[e:e + 1],
        "b.T[:, e]": lambda b, e: b.T[:, e],
        "b.T.select(1, e)": lambda b, e: b.T.select(1, e),
        "b.T.narrow(1, e, 1).squeeze(1)": lambda b, e: b.T.narrow(1, e, 1).squeeze(1),
    }

    def _experts(self):
        take = self.TAKE_BIAS[self.how]
        return ((e, (self.w1[e], self.w2[e], take(self.b1, e), take(self.b2, e))) for e in range(self.E))


@pytest.mark.parametrize("sizes", list(SIZES))
@pytest.mark.parametrize("how", list(RowBiasExperts.TAKE_BIAS))
def test_a_bias_kept_one_row_or_read_through_its_transpose_is_its_stack(how, sizes):
    """Refused before, the near-miss blaming the bias's add ("add_1 on the expert's pre-activation ...
    is not part of that math"); the op now takes b1 and b2 as stored."""
    torch.manual_seed(0)
    _assert_stored(_one_match(RowBiasExperts(how, **SIZES[sizes][0]), sizes), ("w1", "w2", "b1", "b2"))


class NarrowedExpertAxisSecond(ExpertAxisSecond):
    """W1 [D, E, F] and W2 [F, E, D] read by W.narrow(1, e, 1).squeeze(1) or W[:, e:e+1].squeeze(1):
    W.select(1, e), each expert's a tensor of its own, as select's are."""

    TAKE = {
        "narrow(1, e, 1).squeeze(1)": lambda p, e: p.narrow(1, e, 1).squeeze(1),
        "[:, e:e+1].squeeze(1)": lambda p, e: p[:, e:e + 1].squeeze(1),
    }

    def __init__(self, how, **block):
        super().__init__(**block)
        self.how = how

    def moe_forward(self, y):
        x = y.reshape(-1, y.shape[-1])
        weight, index = self.route(x)
        out = torch.zeros_like(x)
        take = self.TAKE[self.how]
        for e in range(self.E):
            gate = (weight * (index == e)).sum(dim=-1, keepdim=True)
            out = out + gate * (self._act(x @ take(self.w1, e) + self.b1[e]) @ take(self.w2, e) + self.b2[e])
        return out.reshape(y.shape)


@pytest.mark.parametrize("sizes", list(SIZES))
@pytest.mark.parametrize("how", list(NarrowedExpertAxisSecond.TAKE))
def test_a_squeezed_narrow_along_a_later_axis_reads_as_its_select(how, sizes):
    """Refused before (the squeeze was read as the [D, 1, F] narrow, and the near-miss said only that
    the experts could not be read), where W.select(1, e) matched."""
    torch.manual_seed(0)
    match = _one_match(NarrowedExpertAxisSecond(how, **SIZES[sizes][0]), sizes)
    assert match["params"]["w1"].startswith("stack(") and match["params"]["w2"].startswith("stack("), match["params"]


class StackedKVAxisOne(StackedKV):
    """K's and V's weights kept as kv_w [D, 2, D] (kv_b [D, 2]), read by narrow(1, i, 1).squeeze(1)."""

    def __init__(self, **block):
        super().__init__("[i]", **block)
        self.kv_w = nn.Parameter(self.kv_w.detach().transpose(0, 1).contiguous())
        self.kv_b = nn.Parameter(self.kv_b.detach().T.contiguous())

    def _kv(self, tok):
        return tuple(F.linear(tok, self.kv_w.narrow(1, i, 1).squeeze(1), self.kv_b.narrow(1, i, 1).squeeze(1))
                     for i in self.at)


@pytest.mark.parametrize("sizes", list(SIZES))
def test_k_and_v_narrowed_from_a_stack_along_axis_1_match_and_train_as_eager(sizes):
    """Refused before ("k (call_function linear) is not part of the block's math"), where kv_w[:, i],
    .select(1, i) and .unbind(1) matched."""
    torch.manual_seed(0)
    _one_match(StackedKVAxisOne(**SIZES[sizes][0]), sizes)


class OtherExpertsW1(SpelledBlock):
    """Expert e's W1 is not W1[e]: another expert's (`permuted`, W1[(e + 1) % E]), W1[0] for every
    expert (`first`), or one W1 [D, F] shared, read as w1_shared.expand(E, D, F)[e] (`expanded`)."""

    TAKE = {
        "permuted": lambda s, e: s.w1[(e + 1) % s.E],
        "first": lambda s, e: s.w1[0],
        "expanded": lambda s, e: s.w1_shared.expand(s.E, *s.w1_shared.shape)[e],
    }

    def __init__(self, how, **block):
        super().__init__(**block)
        self.how = how
        if how == "expanded":
            self.w1_shared = nn.Parameter(self.w1.detach()[0].clone())
            del self.w1

    def expert(self, e, x):
        return self._act(x @ self.TAKE[self.how](self, e) + self.b1[e]) @ self.w2[e] + self.b2[e]


@pytest.mark.parametrize("sizes", list(SIZES))
@pytest.mark.parametrize("how", list(OtherExpertsW1.TAKE))
def test_an_expert_s_w1_taken_from_another_slice_is_stacked_per_gate(how, sizes):
    """Refused before, the near-miss naming the wrong node or cause: W2[e] (getitem_4) as the weight
    that could not be read (permuted, expanded), or "an expert's output is added to something other
    than zeros" (W1[0]). Each gate's expert keeps the W1 it used: the op takes their stack (autograd
    sums a shared W1's gradients), W2, b1 and b2 as stored."""
    torch.manual_seed(0)
    match = _one_match(OtherExpertsW1(how, **SIZES[sizes][0]), sizes)
    assert match["params"]["w1"].startswith("stack("), match["params"]
    _assert_stored(match, ("w2", "b1", "b2"))


class OtherExpertsW3(SpelledBlock):
    """A SwiGLU expert e's W3 is not W3[e]: another expert's (`permuted`), W3[0] for every expert
    (`first`), or one W3 [D, F] shared, read as w3_shared.expand(E, D, F)[e] (`expanded`)."""

    TAKE = {
        "permuted": lambda s, e: s.w3[(e + 1) % s.E],
        "first": lambda s, e: s.w3[0],
        "expanded": lambda s, e: s.w3_shared.expand(s.E, *s.w3_shared.shape)[e],
    }

    def __init__(self, how, **block):
        super().__init__(act="swiglu", **block)
        self.how = how
        if how == "expanded":
            self.w3_shared = nn.Parameter(self.w3.detach()[0].clone())
            del self.w3

    def expert(self, e, x):
        hidden = F.silu(x @ self.w1[e] + self.b1[e]) * (x @ self.TAKE[self.how](self, e))
        return hidden @ self.w2[e] + self.b2[e]


@pytest.mark.parametrize("sizes", list(SIZES))
@pytest.mark.parametrize("how", list(OtherExpertsW3.TAKE))
def test_a_swiglu_expert_s_w3_taken_from_another_slice_is_stacked_per_gate(how, sizes):
    """W1's case above, for SwiGLU's W3: refused before (the two up projections' experts had to be
    one slice). Each gate's expert keeps the W3 it used: the op takes their stack, W1, W2, b1 and
    b2 as stored."""
    torch.manual_seed(0)
    match = _one_match(OtherExpertsW3(how, **SIZES[sizes][0]), sizes)
    assert match["params"]["w3"].startswith("stack("), match["params"]
    _assert_stored(match, ("w1", "w2", "b1", "b2"))
