"""bench/aot_min_cut_repro.py: what the rest="inductor" guard rests on, on this torch. The
default partitioner (the CUDA-graph trees') trains the parameter-writing forward as eager; the
min-cut one (aot_eager, Inductor) does not. Where a torch build fixes min-cut, the second test
fails, and the guard (backend._eager_where_inductor_miscomputes) can be narrowed to older builds."""
import pytest

from bench import aot_min_cut_repro


@pytest.mark.parametrize("backend", ["eager", "aot_eager_default_partitioner"])
def test_the_default_partitioner_trains_it_as_eager(backend):
    assert aot_min_cut_repro.dx_error(backend) <= 1e-6


def test_the_min_cut_partitioner_trains_it_wrong():
    assert aot_min_cut_repro.dx_error("aot_eager") == pytest.approx(0.25, abs=0.01)
