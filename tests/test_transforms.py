"""The slice contract of every transform and of chains, checked against plain numpy.

For a transform (or chain) `t`, a source `x` and any box `r` of the output:

    chain.apply(x[box(chain.regions(r)[0])], chain.regions(r)) == full(x)[box(r)]

with the same shape, the same dtype and bit-identical values, where `full` is computed
with plain numpy (`np.transpose`, `np.split`, `ndarray.reshape`, `ndarray.astype`).
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from port._transforms import Cast, Chain, Reshape, Split, Transpose

FLOATS = [np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)]

dims = st.integers(1, 12)
shapes = st.lists(dims, min_size=1, max_size=4).map(tuple)


# --------------------------------------------------------------------------- helpers


def _slices(region):
    return tuple(slice(a, b) for a, b in region)


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _source(data, shape, dtype=None) -> np.ndarray:
    """A source array with distinct-ish random values (float32 unless told)."""
    seed = data.draw(st.integers(0, 2**32 - 1), label="seed")
    dtype = np.dtype(np.float32) if dtype is None else dtype
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * 100
    return x.astype(dtype)


@st.composite
def shard_box(draw, shape):
    """A box as jax NamedSharding gives it: per dim, a shard count dividing it and an index."""
    box = []
    for n in shape:
        k = draw(st.sampled_from(_divisors(n)))
        i = draw(st.integers(0, k - 1))
        box.append((i * n // k, (i + 1) * n // k))
    return tuple(box)


@st.composite
def any_box(draw, shape):
    """An arbitrary non-empty box."""
    box = []
    for n in shape:
        a = draw(st.integers(0, n - 1))
        b = draw(st.integers(a + 1, n))
        box.append((a, b))
    return tuple(box)


def out_box(shape):
    return st.one_of(shard_box(shape), any_box(shape), st.just(tuple((0, n) for n in shape)))


def reference(transforms, x: np.ndarray) -> np.ndarray:
    """The full output computed with plain numpy, independently of the transforms' code."""
    for t in transforms:
        if isinstance(t, Transpose):
            x = np.transpose(x, t.perm)
        elif isinstance(t, Split):
            if t.sizes is not None:
                x = np.split(x, np.cumsum(t.sizes)[:-1], axis=t.axis)[t.index]
            else:
                x = np.split(x, t.parts, axis=t.axis)[t.index]
        elif isinstance(t, Cast):
            x = x.astype(t.dtype)
        elif isinstance(t, Reshape):
            x = x.reshape(t.target)
        else:  # pragma: no cover
            raise TypeError(t)
    return x


def check_contract(transforms, x: np.ndarray, box) -> None:
    chain = Chain.build(transforms, x.shape)
    full = reference(transforms, x)
    assert chain.shape == full.shape
    assert len(box) == len(full.shape)

    regions = chain.regions(box)
    assert len(regions) == len(transforms) + 1
    assert regions[-1] == box
    for region, shape in zip(regions, chain.shapes):
        assert len(region) == len(shape), (region, shape)
        for (a, b), n in zip(region, shape):
            assert 0 <= a <= b <= n, (region, shape)

    got = chain.apply(x[_slices(regions[0])], regions)
    want = full[_slices(box)]
    assert isinstance(got, np.ndarray)
    assert got.dtype == want.dtype
    assert got.shape == want.shape
    assert np.ascontiguousarray(got).tobytes() == np.ascontiguousarray(want).tobytes()

    # Single transforms obey the same contract through their own methods.
    if len(transforms) == 1:
        (t,) = transforms
        region = t.region(x.shape, box)
        assert region == regions[0]
        single = t.apply(x[_slices(region)], x.shape, box)
        assert single.dtype == want.dtype and single.shape == want.shape
        assert np.ascontiguousarray(single).tobytes() == np.ascontiguousarray(want).tobytes()


# ------------------------------------------------------------------ random parameters


@st.composite
def transpose_for(draw, shape):
    return Transpose(tuple(draw(st.permutations(range(len(shape))))))


@st.composite
def composition(draw, n):
    """Positive sizes adding up to n."""
    cuts = draw(st.sets(st.integers(1, n - 1), max_size=min(n - 1, 5))) if n > 1 else set()
    points = [0, *sorted(cuts), n]
    return tuple(b - a for a, b in zip(points, points[1:]))


@st.composite
def split_for(draw, shape):
    ndim = len(shape)
    axis = draw(st.integers(-ndim, ndim - 1))
    n = shape[axis]
    if draw(st.booleans()):
        parts = draw(st.sampled_from(_divisors(n)))
        return Split(axis, draw(st.integers(0, parts - 1)), parts=parts)
    sizes = draw(composition(n))
    return Split(axis, draw(st.integers(0, len(sizes) - 1)), sizes=sizes)


@st.composite
def cast_for(draw, shape):
    return Cast(draw(st.sampled_from(FLOATS)))


@st.composite
def factors(draw, n):
    """n as a product of 2 or 3 factors in a random order (factors of 1 allowed)."""
    out = []
    for _ in range(draw(st.integers(1, 2))):
        f = draw(st.sampled_from(_divisors(n)))
        out.append(f)
        n //= f
    out.append(n)
    return draw(st.permutations(out))


@st.composite
def reshape_for(draw, shape):
    """A target reached by splitting axes, merging runs of axes, and dropping/inserting 1s."""
    target: list[int] = []
    i = 0
    while i < len(shape):
        m = draw(st.integers(1, len(shape) - i))
        if m > 1:  # merge a run of consecutive axes
            target.append(math.prod(shape[i : i + m]))
        elif shape[i] == 1 and draw(st.booleans()):  # drop a 1
            pass
        elif draw(st.booleans()):  # split an axis
            target.extend(draw(factors(shape[i])))
        else:
            target.append(shape[i])
        i += m
    for _ in range(draw(st.integers(0, 2))):  # insert 1s
        target.insert(draw(st.integers(0, len(target))), 1)
    if not target:
        target = [1]
    if draw(st.booleans()):
        target[draw(st.integers(0, len(target) - 1))] = -1
    return Reshape(tuple(target))


KINDS = {
    "transpose": transpose_for,
    "split": split_for,
    "cast": cast_for,
    "reshape": reshape_for,
}


def _source_dtype(data, kind):
    return data.draw(st.sampled_from(FLOATS), label="source dtype") if kind == "cast" else None


# ------------------------------------------------------------------ the slice contract


@pytest.mark.parametrize("kind", sorted(KINDS))
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_single_transform_contract(kind, data):
    shape = data.draw(shapes, label="shape")
    x = _source(data, shape, _source_dtype(data, kind))
    t = data.draw(KINDS[kind](shape), label="transform")
    out_shape = t.shape(shape)
    box = data.draw(out_box(out_shape), label="box")
    check_contract([t], x, box)


@settings(max_examples=250, deadline=None)
@given(data=st.data())
def test_random_chain_contract(data):
    shape = data.draw(shapes, label="shape")
    x = _source(data, shape, data.draw(st.sampled_from(FLOATS), label="source dtype"))
    n = data.draw(st.integers(1, 5), label="length")
    transforms, current = [], shape
    for _ in range(n):
        kind = data.draw(st.sampled_from(sorted(KINDS)))
        t = data.draw(KINDS[kind](current))
        transforms.append(t)
        current = t.shape(current)
    box = data.draw(out_box(current), label="box")
    check_contract(transforms, x, box)


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_gpt2_c_attn_chain_contract(data):
    """c_attn [E, 3E] -> split q/k/v -> transpose -> reshape to [H, D, E] (and casts)."""
    heads = data.draw(st.integers(1, 4), label="H")
    head_dim = data.draw(st.integers(1, 5), label="D")
    embed = heads * head_dim
    index = data.draw(st.integers(0, 2), label="q/k/v")
    x = _source(data, (embed, 3 * embed), data.draw(st.sampled_from(FLOATS)))
    target = data.draw(
        st.sampled_from([(heads, head_dim, embed), (heads, head_dim, -1), (-1, head_dim, embed)])
    )
    transforms = [Split(1, index, parts=3), Transpose((1, 0)), Reshape(target)]
    if data.draw(st.booleans()):
        transforms.insert(data.draw(st.integers(0, 3)), Cast(data.draw(st.sampled_from(FLOATS))))
    box = data.draw(out_box((heads, head_dim, embed)), label="box")
    check_contract(transforms, x, box)


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_gpt2_merge_heads_chain_contract(data):
    """c_proj-like: [H, D, E] -> reshape to [E, E] (merge) -> transpose, and the reverse."""
    heads = data.draw(st.integers(1, 4))
    head_dim = data.draw(st.integers(1, 5))
    embed = heads * head_dim
    x = _source(data, (heads, head_dim, embed))
    transforms = [Reshape((embed, embed)), Transpose((1, 0)), Split(0, 0, sizes=(embed,))]
    box = data.draw(out_box((embed, embed)))
    check_contract(transforms, x, box)


def test_empty_chain_is_identity():
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    chain = Chain.build([], x.shape)
    assert chain.shape == (2, 3, 4)
    box = ((1, 2), (0, 3), (1, 3))
    assert chain.regions(box) == [box]
    np.testing.assert_array_equal(chain.apply(x[_slices(box)], [box]), x[_slices(box)])


@pytest.mark.parametrize(
    "src, target",
    [
        ((6,), (2, 3)),
        ((2, 3), (6,)),
        ((2, 3, 4), (6, 4)),
        ((2, 3, 4), (2, 12)),
        ((24,), (2, 3, 4)),
        ((2, 3), (2, 1, 3)),
        ((2, 1, 3), (2, 3)),
        ((1, 6), (6, 1)),
        ((2, 3, 1), (1, 2, 3)),
        ((6, 4), (2, 1, 3, 4)),
        ((2, 1, 3), (6,)),
        ((6,), (2, 1, 3)),
        ((12, 5), (-1, 3, 5)),
        ((1,), (1, 1)),
        ((1, 1), (1,)),
    ],
)
def test_reshape_every_box(src, target):
    """Exhaustive over all non-empty boxes of small reshapes."""
    x = np.arange(math.prod(src), dtype=np.float32).reshape(src)
    out_shape = Reshape(target).shape(src)
    boxes = [()]
    for n in out_shape:
        boxes = [b + ((a, c),) for b in boxes for a in range(n) for c in range(a + 1, n + 1)]
    for box in boxes:
        check_contract([Reshape(target)], x, box)


# ------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "src, target",
    [((6, 4), (4, 6)), ((2, 6), (4, 3)), ((2, 3, 4), (3, 8)), ((4, 6), (3, 8)), ((2, 3), (3, 2))],
)
def test_regrouping_reshape_raises(src, target):
    with pytest.raises(ValueError, match="regroups"):
        Reshape(target).shape(src)
    with pytest.raises(ValueError):
        Chain.build([Reshape(target)], src)


@pytest.mark.parametrize(
    "src, target", [((6,), (4,)), ((6,), (-1, -1)), ((6,), (4, -1)), ((2, 3), (7,)), ((6,), (0, -1))]
)
def test_impossible_reshape_raises(src, target):
    with pytest.raises(ValueError):
        Reshape(target).shape(src)


@pytest.mark.parametrize("perm", [(0, 0), (0,), (1, 2), (0, 1, 2), (2, 0), (-1, 0)])
def test_wrong_transpose_perm_raises(perm):
    with pytest.raises(ValueError, match="transpose"):
        Transpose(perm).shape((3, 4))
    with pytest.raises(ValueError):
        Chain.build([Transpose(perm)], (3, 4))


@pytest.mark.parametrize(
    "split",
    [
        Split(1, 0, sizes=(2, 2)),  # adds up to 4, axis has 6
        Split(1, 0, sizes=(3, 4)),  # adds up to 7
        Split(0, 0, sizes=()),
        Split(1, 0, parts=4),  # 6 is not divisible by 4
        Split(1, 0, parts=0),
        Split(1, 0),  # neither parts nor sizes
        Split(1, 3, parts=3),  # index out of range
        Split(1, -1, sizes=(3, 3)),
        Split(2, 0, parts=1),  # axis out of range
        Split(-3, 0, parts=1),
    ],
)
def test_bad_split_raises(split):
    with pytest.raises(ValueError, match="split"):
        split.shape((4, 6))
    with pytest.raises(ValueError):
        Chain.build([split], (4, 6))


def test_negative_split_sizes_raise():
    # sizes (-1, 7) add up to 6 but are not a split: shape() gives (7,), larger than the axis.
    with pytest.raises(ValueError):
        Split(0, 1, sizes=(-1, 7)).shape((6,))


# ------------------------------------------------- reads only the bounding range


@settings(max_examples=200, deadline=None)
@given(
    heads=st.integers(1, 12),
    head_dim=st.integers(1, 12),
    data=st.data(),
)
def test_reshape_split_reads_only_whole_heads(heads, head_dim, data):
    """(E,) -> (H, D) with the D box whole needs exactly [h0*D, h1*D) of the source."""
    h0 = data.draw(st.integers(0, heads - 1))
    h1 = data.draw(st.integers(h0 + 1, heads))
    embed = heads * head_dim
    t = Reshape((heads, head_dim))
    assert t.region((embed,), ((h0, h1), (0, head_dim))) == ((h0 * head_dim, h1 * head_dim),)

    # With a trailing axis, that axis's box passes through unchanged.
    k = data.draw(st.integers(1, 6))
    c0 = data.draw(st.integers(0, k - 1))
    c1 = data.draw(st.integers(c0 + 1, k))
    t = Reshape((heads, head_dim, k))
    region = t.region((embed, k), ((h0, h1), (0, head_dim), (c0, c1)))
    assert region == ((h0 * head_dim, h1 * head_dim), (c0, c1))

    # A partial D box needs the bounding range, not the whole axis.
    d0 = data.draw(st.integers(0, head_dim - 1))
    d1 = data.draw(st.integers(d0 + 1, head_dim))
    region = Reshape((heads, head_dim)).region((embed,), ((h0, h1), (d0, d1)))
    assert region == ((h0 * head_dim + d0, (h1 - 1) * head_dim + d1),)


@settings(max_examples=100, deadline=None)
@given(heads=st.integers(1, 12), head_dim=st.integers(1, 12), index=st.integers(0, 2), data=st.data())
def test_gpt2_q_shard_reads_only_its_columns(heads, head_dim, index, data):
    """A head shard of q [H, D, E] from c_attn [E, 3E] needs only its own columns."""
    embed = heads * head_dim
    k = data.draw(st.sampled_from(_divisors(heads)))
    i = data.draw(st.integers(0, k - 1))
    h0, h1 = i * heads // k, (i + 1) * heads // k
    chain = Chain.build([Split(1, index, parts=3), Transpose((1, 0)), Reshape((heads, head_dim, embed))],
                        (embed, 3 * embed))
    regions = chain.regions(((h0, h1), (0, head_dim), (0, embed)))
    start = index * embed
    assert regions[0] == ((0, embed), (start + h0 * head_dim, start + h1 * head_dim))


def test_merge_reads_smallest_box():
    """(H, D) -> (E,): a flat range inside one head reads one row; across heads, whole rows."""
    t = Reshape((12,))
    assert t.region((3, 4), ((5, 7),)) == ((1, 2), (1, 3))
    assert t.region((3, 4), ((3, 6),)) == ((0, 2), (0, 4))
    assert t.region((3, 4), ((0, 12),)) == ((0, 3), (0, 4))


# ------------------------------------------------ empty boxes (edge case, see report)


def test_empty_box_on_inserted_axis():
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    check_contract([Reshape((2, 1, 3))], x, ((0, 2), (0, 0), (0, 3)))


def test_empty_box_on_merge():
    x = np.arange(12, dtype=np.float32).reshape(2, 3, 2)
    check_contract([Reshape((6, 2))], x, ((0, 0), (0, 0)))
