"""The scalars list's one layout (``scalars.Layout``) is where the runtime's packing
(``scalars.Packer``) puts each entry: the capture reads the graph's inputs at the
layout's indices, the run writes them in the packer's order."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ca_dynsaved.opaque import FLOAT, INT
from ca_dynsaved.scalars import Layout, Packer


@settings(max_examples=60, deadline=None)
@given(
    kinds=st.lists(st.sampled_from([INT, FLOAT]), max_size=6),
    derived_ints=st.integers(0, 3),
    derived_floats=st.integers(0, 3),
    unpacks=st.integers(0, 2),
)
def test_layout_indices_are_where_the_packer_puts_each_value(kinds, derived_ints, derived_floats, unpacks):
    values = [10 + i if kind is INT else 0.5 + i for i, kind in enumerate(kinds)]
    d_ints = [100 + i for i in range(derived_ints)]
    d_floats = [0.25 + i for i in range(derived_floats)]
    layout = Layout(tuple(kinds), packed=True, derived_ints=derived_ints, derived_floats=derived_floats)
    ints, floats, scalars = Packer(kinds, tensors=True)(list(values), d_ints, d_floats)
    likes = [object() for _ in range(unpacks)]
    scalars = [*scalars, *likes]  # the runtime appends the unpacks' likes last

    assert scalars[: layout.lifted] == values
    int_tensor, float_tensor = scalars[layout.packed_tensor(INT)], scalars[layout.packed_tensor(FLOAT)]
    assert int_tensor.dtype == torch.int64 and int_tensor.tolist() == [v for v, k in zip(values, kinds) if k is INT]
    assert float_tensor.dtype == torch.float64
    for at, value in enumerate(d_ints):
        assert scalars[layout.derived_int(at)] == value
    for at, value in enumerate(d_floats):
        assert float_tensor[layout.derived_float(at)].item() == value
    for slot, like in enumerate(likes):
        assert scalars[layout.unpack_like(slot)] is like
    assert list(ints) == [v for v, k in zip(values, kinds) if k is INT]
    assert list(floats) == [v for v, k in zip(values, kinds) if k is FLOAT]


def test_unpack_likes_follow_the_lifted_scalars_when_nothing_is_packed():
    layout = Layout((INT, FLOAT))
    _, _, scalars = Packer(layout.kinds, tensors=False)([3, 0.5])
    assert [*scalars, "like"][layout.unpack_like(0)] == "like"
