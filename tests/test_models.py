"""The reference modules' constructors: a bad choice names the value and what is allowed."""
import pytest

from mha_compile import models


@pytest.mark.parametrize("make, message", [
    (lambda: models.MHABlock.from_preset("huge"), "preset='huge': expected one of ('tiny', 'small', 'medium', 'large')"),
    (lambda: models.MHABlock.from_preset("tiny", act="relu"), "act='relu': expected one of"),
    (lambda: models.MHABlock.from_preset("tiny", spelling="sparse"), "spelling='sparse': expected one of"),
])
def test_a_bad_choice_names_the_allowed_values(make, message):
    """from_preset("huge") raised a bare KeyError: 'huge' (a review's)."""
    with pytest.raises(ValueError) as raised:
        make()
    assert message in str(raised.value), str(raised.value)


def test_a_preset_gives_its_widths():
    block = models.MHABlock.from_preset("small")
    widths = models.PRESETS["small"]
    assert (block.moe.w1.shape, block.pool.query.numel()) == ((widths["E"], widths["D"], widths["F"]), widths["D"])
