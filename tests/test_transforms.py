"""The slice contract, the inverse contract and the TOML round trip of every transform.

For a transform (or chain) `t`, a source `x` and any box `r` of the output:

    chain.apply(x[box(chain.regions(r)[0])], chain.regions(r)) == full(x)[box(r)]

with the same shape, the same dtype and bit-identical values, where `full` is computed
with plain numpy (`np.transpose`, `np.split`, `ndarray.reshape`, `ndarray.astype`).

The way back: `inverse(full(x)) == x` bit for bit (a split from every part's output),
and `parse_transform(render(t)) == t`, config names included.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import port
from port._transforms import REGISTRY, Cast, Chain, Reshape, Split, Stride, Transform, Transpose, parse_transform

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
    target = data.draw(st.sampled_from([(heads, head_dim, embed), (heads, head_dim, -1), (-1, head_dim, embed)]))
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
    chain = Chain.build(
        [Split(1, index, parts=3), Transpose((1, 0)), Reshape((heads, head_dim, embed))], (embed, 3 * embed)
    )
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


# ------------------------------------------------------------ the inverse contract


def _exact_source(data, shape, dtype) -> np.ndarray:
    """Values every dtype of FLOATS holds exactly (k/4, |k| <= 256), so casts lose nothing."""
    seed = data.draw(st.integers(0, 2**32 - 1), label="seed")
    k = np.random.default_rng(seed).integers(-256, 257, size=shape)
    return (k / 4).astype(np.float32).astype(dtype)


def _same_bits(got: np.ndarray, want: np.ndarray) -> None:
    assert isinstance(got, np.ndarray)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert np.ascontiguousarray(got).tobytes() == np.ascontiguousarray(want).tobytes()


@pytest.mark.parametrize("kind", sorted(KINDS))
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_single_transform_inverse(kind, data):
    shape = data.draw(shapes, label="shape")
    x = _exact_source(data, shape, data.draw(st.sampled_from(FLOATS), label="source dtype"))
    t = data.draw(KINDS[kind](shape), label="transform")
    if t.fused:  # a split: every part's output, concatenated, gives x back
        outs = [reference([s], x) for s in t.siblings(shape)]
        assert t in t.siblings(shape)
        _same_bits(t.inverse(outs, shape, x.dtype), x)
    else:
        _same_bits(t.inverse(reference([t], x), shape, x.dtype), x)


@settings(max_examples=250, deadline=None)
@given(data=st.data())
def test_random_chain_inverse(data):
    """A chain's inverse undoes it; with a split, from its siblings' outputs too."""
    shape = data.draw(shapes, label="shape")
    x = _exact_source(data, shape, data.draw(st.sampled_from(FLOATS), label="source dtype"))
    n = data.draw(st.integers(1, 5), label="length")
    transforms, current, split_at = [], shape, None
    for i in range(n):
        kinds = sorted(KINDS) if split_at is None else sorted(set(KINDS) - {"split"})
        t = data.draw(KINDS[data.draw(st.sampled_from(kinds))](current))
        if t.fused:
            split_at = i
        transforms.append(t)
        current = t.shape(current)
    chain = Chain.build(transforms, shape)
    siblings = []
    if split_at is not None:
        prefix, split, suffix = transforms[:split_at], transforms[split_at], transforms[split_at + 1 :]
        for other in split.siblings(chain.shapes[split_at]):
            if other == split:
                continue
            steps = [*prefix, other, *suffix]
            try:  # a sibling with the same later steps, or (parts of other sizes) none
                sibling = Chain.build(steps, shape)
            except ValueError:
                steps = [*prefix, other]
                sibling = Chain.build(steps, shape)
            siblings.append((sibling, reference(steps, x)))
    _same_bits(chain.inverse(reference(transforms, x), x.dtype, siblings=siblings), x)


def test_gpt2_c_attn_inverse_from_q_k_v():
    """c_attn [E, 3E] back from q, k, v [H, D, E], whatever order they come in."""
    heads, head_dim = 3, 4
    embed = heads * head_dim
    x = np.arange(embed * 3 * embed, dtype=np.float32).reshape(embed, 3 * embed)
    chains = [
        Chain.build([Split(1, i, parts=3), Transpose((1, 0)), Reshape((heads, head_dim, -1))], x.shape)
        for i in range(3)
    ]
    outs = [reference(c.transforms, x) for c in chains]
    _same_bits(chains[1].inverse(outs[1], x.dtype, siblings=[(chains[2], outs[2]), (chains[0], outs[0])]), x)
    with pytest.raises(ValueError, match="needs every part; missing \\[2\\]"):
        chains[0].inverse(outs[0], x.dtype, siblings=[(chains[1], outs[1])])
    with pytest.raises(ValueError, match="given twice"):
        chains[0].inverse(outs[0], x.dtype, siblings=[(chains[0], outs[0]), (chains[1], outs[1])])
    with pytest.raises(ValueError, match="no sibling"):
        other = Chain.build([Split(1, 1, parts=2)], x.shape)
        chains[0].inverse(outs[0], x.dtype, siblings=[(other, reference(other.transforms, x))])


def test_chain_without_split_takes_no_siblings():
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    chain = Chain.build([Transpose((1, 0)), Cast(np.dtype(np.float64))], x.shape)
    y = reference(chain.transforms, x)
    _same_bits(chain.inverse(y, x.dtype), x)
    assert chain.dtypes(x.dtype) == [np.dtype(np.float32)] * 2 + [np.dtype(np.float64)]
    with pytest.raises(ValueError, match="takes no siblings"):
        chain.inverse(y, x.dtype, siblings=[(chain, y)])
    with pytest.raises(ValueError, match="expected \\[3, 2\\]"):
        chain.inverse(y.T, x.dtype)


def test_split_inverse_needs_every_part():
    x = np.arange(12, dtype=np.float32).reshape(2, 6)
    t = Split(1, 0, sizes=(2, 4))
    with pytest.raises(ValueError, match="all 2 parts"):
        t.inverse([x[:, :2]], x.shape, x.dtype)
    with pytest.raises(ValueError, match="part 1"):
        t.inverse([x[:, :2], x[:, :3]], x.shape, x.dtype)


# ------------------------------------------------------- parse, render and resolve

NAMES = ("n_head", "n_embd", "hidden_size", "head_dim")


@st.composite
def named_transform(draw):
    """A resolved transform, the same transform with some sizes as config names, and the config."""
    shape = draw(shapes)
    t = draw(KINDS[draw(st.sampled_from(sorted(KINDS)))](shape))
    config: dict[str, int] = {}

    def name(size: int):
        if size < 0 or not draw(st.booleans()):
            return size
        key = draw(st.sampled_from(NAMES))
        if config.setdefault(key, size) != size:
            return size
        return key

    if isinstance(t, Reshape):
        return t, Reshape(tuple(name(d) for d in t.target)), config
    if isinstance(t, Split) and t.sizes is not None:
        return t, Split(t.axis, t.index, sizes=tuple(name(d) for d in t.sizes)), config
    return t, t, config


def _parse_text(text: str) -> Transform:
    return parse_transform(tomllib.loads(f"t = {text}")["t"])


@settings(max_examples=300, deadline=None)
@given(case=named_transform())
def test_render_parse_round_trip(case):
    resolved, named, config = case
    assert _parse_text(named.render()) == named
    assert _parse_text(resolved.render()) == resolved
    assert named.resolve(config) == resolved
    assert parse_transform(named.toml()) == named


@settings(max_examples=50, deadline=None)
@given(cases=st.lists(named_transform(), min_size=1, max_size=4))
def test_render_parse_round_trip_in_a_mapping(cases):
    ops = [named for _, named, _ in cases]
    text = 'model = "m:C"\n[[params]]\nkey = "a"\npath = "b"\naxes = []\n'
    text += "transforms = [" + ", ".join(t.render() for t in ops) + "]\n"
    (param,) = port.parse_mapping(text).params
    assert param.transforms == tuple(ops)


@pytest.mark.parametrize(
    "text, rendered",
    [
        ("{ transpose = [1, 0] }", Transpose((1, 0))),
        ('{ reshape = ["n_head", -1, "n_embd"] }', Reshape(("n_head", -1, "n_embd"))),
        ("{ split = { axis = 1, parts = 3, index = 0 } }", Split(1, 0, parts=3)),
        ('{ split = { axis = -1, sizes = ["hidden_size", 4], index = 1 } }', Split(-1, 1, sizes=("hidden_size", 4))),
        ('{ cast = "bfloat16" }', Cast(np.dtype(ml_dtypes.bfloat16))),
    ],
)
def test_render_text(text, rendered):
    assert rendered.render() == text
    assert _parse_text(text) == rendered


def test_registry_holds_every_transform_once():
    assert list(REGISTRY) == ["transpose", "reshape", "split", "cast", "stride"]
    assert all(cls.name == name and issubclass(cls, Transform) for name, cls in REGISTRY.items())
    assert [name for name, cls in REGISTRY.items() if cls.fused] == ["split", "stride"]


@pytest.mark.parametrize(
    "table, message",
    [
        ({"rotate": 1}, "rotate: unknown transform \\(expected transpose, reshape, split, cast or stride\\)"),
        ({"transpose": [1, 0], "cast": "float32"}, "one-key table"),
        ([1, 0], "one-key table"),
        ({"transpose": [True, False]}, "transpose takes a permutation"),
        ({"transpose": "01"}, "transpose takes a permutation"),
        ({"reshape": [2.5, -1]}, "reshape takes a list of sizes"),
        ({"split": {"axis": 0, "index": 0, "parts": 2, "extra": 1}}, "split takes"),
        ({"split": {"axis": 0, "parts": 2}}, "needs integer 'axis' and 'index'"),
        ({"split": {"axis": 0, "index": 0}}, "exactly one of 'parts' or 'sizes'"),
        ({"split": {"axis": 0, "index": 0, "parts": 2, "sizes": [1, 1]}}, "exactly one of 'parts' or 'sizes'"),
        ({"split": {"axis": 0, "index": 0, "parts": "3"}}, "'parts' must be an integer"),
        ({"split": {"axis": 0, "index": 0, "sizes": [1.5]}}, "'sizes' must be a list"),
        ({"cast": "float12"}, "cast: unknown dtype 'float12'"),
        ({"cast": 32}, "cast: unknown dtype"),
    ],
)
def test_parse_errors(table, message):
    with pytest.raises(ValueError, match=message):
        parse_transform(table)


def test_unresolved_names_raise():
    with pytest.raises(ValueError, match="resolve"):
        Reshape(("n_head", -1)).shape((6,))
    with pytest.raises(ValueError, match="resolve"):
        Split(0, 0, sizes=("n_embd", 2)).shape((6,))
    with pytest.raises(port.PortError, match="config.json has no integer 'n_head'"):
        Reshape(("n_head", -1)).resolve({"n_head": "12"})


def test_a_new_transform_is_one_class():
    """A subclass with a name is parsed from a mapping, rendered, applied and inverted."""

    @dataclass(frozen=True)
    class Flip(Transform, name="flip"):  # reverse one axis
        axis: int

        @classmethod
        def parse(cls, arg):
            if not isinstance(arg, int) or isinstance(arg, bool):
                raise ValueError("flip takes an axis")
            return cls(arg)

        def arg(self):
            return self.axis

        def shape(self, in_shape):
            return in_shape

        def region(self, in_shape, out):
            a, b = out[self.axis]
            n = in_shape[self.axis]
            return out[: self.axis] + ((n - b, n - a),) + out[self.axis + 1 :]

        def apply(self, block, in_shape, out):
            return np.flip(block, self.axis)

        def inverse(self, out, in_shape, in_dtype):
            return np.flip(out, self.axis)

    try:
        text = 'model = "m:C"\n[[params]]\nkey = "a"\npath = "b"\naxes = []\ntransforms = [{ flip = 1 }]\n'
        (param,) = port.parse_mapping(text).params
        assert param.transforms == (Flip(1),) and Flip(1).render() == "{ flip = 1 }"
        x = np.arange(12, dtype=np.float32).reshape(3, 4)
        chain = Chain.build(param.build({}), x.shape)
        box = ((0, 3), (1, 3))
        regions = chain.regions(box)
        np.testing.assert_array_equal(chain.apply(x[_slices(regions[0])], regions), x[:, ::-1][_slices(box)])
        np.testing.assert_array_equal(chain.inverse(x[:, ::-1], x.dtype), x)
    finally:
        del REGISTRY["flip"]


def test_transform_is_abstract_and_each_transform_final():
    """Equinox's abstract/final pattern: `Transform` declares what every transform answers
    (abstract methods), a transform lacking one cannot be made, and a registered transform
    cannot be subclassed."""
    with pytest.raises(TypeError, match="abstract"):
        Transform()
    assert {"parse", "arg", "shape", "region", "apply", "inverse"} <= Transform.__abstractmethods__

    class Partial(Transform):  # no name: not registered; no inverse: cannot be made
        def parse(cls, arg): ...
        def arg(self): ...
        def shape(self, in_shape): ...
        def region(self, in_shape, out): ...
        def apply(self, block, in_shape, out): ...

    with pytest.raises(TypeError, match="inverse"):
        Partial()
    assert "partial" not in REGISTRY
    with pytest.raises(TypeError, match="transform 'transpose' is final"):

        class Reversed(Transpose):  # noqa: F841
            pass

    assert list(REGISTRY) == ["transpose", "reshape", "split", "cast", "stride"]


# ------------------------------------------------------------ stride (a de-interleave)


@st.composite
def stride_for(draw, shape):
    """Every `step`-th element of an axis from an offset; the step divides the axis."""
    ndim = len(shape)
    axis = draw(st.integers(-ndim, ndim - 1))
    step = draw(st.sampled_from(_divisors(shape[axis])))
    return Stride(axis, step, draw(st.integers(0, step - 1)))


def reference_strided(transforms, x: np.ndarray) -> np.ndarray:
    """`reference`, with `x[..., offset::step]` (plain numpy) for a stride."""
    for t in transforms:
        if isinstance(t, Stride):
            x = np.moveaxis(np.moveaxis(x, t.axis, 0)[t.offset :: t.step], 0, t.axis)
        else:
            x = reference([t], x)
    return x


@st.composite
def chain_with_stride(draw, shape, others=("transpose", "cast", "reshape")):
    """Up to two transforms, one stride, up to two more: the stride's siblings have the same steps."""
    transforms, current = [], shape
    for _ in range(draw(st.integers(0, 2))):
        t = draw(KINDS[draw(st.sampled_from(sorted(others)))](current))
        transforms.append(t)
        current = t.shape(current)
    at = len(transforms)
    transforms.append(draw(stride_for(current)))
    current = transforms[-1].shape(current)
    for _ in range(draw(st.integers(0, 2))):
        t = draw(KINDS[draw(st.sampled_from(sorted(others)))](current))
        transforms.append(t)
        current = t.shape(current)
    return transforms, at


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_stride_contract(data):
    """apply(x[region(box)]) == full(x)[box] for every box, and the region is the whole groups
    of `step` elements the box's elements are in: `step` times the box along the axis, the
    same for every offset (the parts share one read)."""
    shape = data.draw(shapes, label="shape")
    x = _source(data, shape)
    t = data.draw(stride_for(shape), label="transform")
    box = data.draw(out_box(t.shape(shape)), label="box")
    region = t.region(shape, box)
    want = reference_strided([t], x)[_slices(box)]
    got = t.apply(x[_slices(region)], shape, box)
    assert got.shape == want.shape and got.tobytes() == np.ascontiguousarray(want).tobytes()
    axis = t.axis % len(shape)
    (a, b), (lo, hi) = box[axis], region[axis]
    assert (lo, hi) == ((t.step * a, t.step * b) if b > a else (0, 0))
    assert all(s.region(shape, box) == region for s in t.siblings(shape))
    assert region[:axis] + region[axis + 1 :] == box[:axis] + box[axis + 1 :]


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_stride_in_a_chain_contract(data):
    shape = data.draw(shapes, label="shape")
    x = _source(data, shape, data.draw(st.sampled_from(FLOATS), label="source dtype"))
    transforms, _ = data.draw(chain_with_stride(shape), label="chain")
    chain = Chain.build(transforms, shape)
    box = data.draw(out_box(chain.shape), label="box")
    regions = chain.regions(box)
    for region, s in zip(regions, chain.shapes):
        assert all(0 <= a <= b <= n for (a, b), n in zip(region, s))
    got = chain.apply(x[_slices(regions[0])], regions)
    want = reference_strided(transforms, x)[_slices(box)]
    assert got.dtype == want.dtype and got.shape == want.shape
    assert np.ascontiguousarray(got).tobytes() == np.ascontiguousarray(want).tobytes()


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_stride_inverse_interleaves_every_part(data):
    shape = data.draw(shapes, label="shape")
    x = _exact_source(data, shape, data.draw(st.sampled_from(FLOATS), label="source dtype"))
    t = data.draw(stride_for(shape), label="transform")
    family = t.siblings(shape)
    assert t in family and [s.offset for s in family] == list(range(t.step))
    _same_bits(t.inverse([reference_strided([s], x) for s in family], shape, x.dtype), x)


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_stride_chain_inverse_from_its_siblings(data):
    """Chain.inverse of a chain holding a stride rebuilds the source bit for bit from every
    offset's chain (equal before the stride, each with the same later steps)."""
    shape = data.draw(shapes, label="shape")
    x = _exact_source(data, shape, data.draw(st.sampled_from(FLOATS), label="source dtype"))
    transforms, at = data.draw(chain_with_stride(shape), label="chain")
    chain = Chain.build(transforms, shape)
    siblings = []
    for other in transforms[at].siblings(chain.shapes[at]):
        if other != transforms[at]:
            steps = [*transforms[:at], other, *transforms[at + 1 :]]
            siblings.append((Chain.build(steps, shape), reference_strided(steps, x)))
    _same_bits(chain.inverse(reference_strided(transforms, x), x.dtype, siblings=siblings), x)
    if siblings:
        with pytest.raises(ValueError, match="needs every part"):
            chain.inverse(reference_strided(transforms, x), x.dtype, siblings=siblings[1:])


def test_gpt_oss_gate_up_de_interleave():
    """gpt-oss's `gate_up_proj` [experts, hidden, 2 inter]: gate = columns 0, 2, ..., up = 1, 3, ...;
    a quarter of the gate's rows (after the transpose) and the same quarter of up's need one
    region, the columns of their pairs: 4 of 16, read once for both."""
    x = np.arange(2 * 3 * 16, dtype=np.float32).reshape(2, 3, 16)
    gate = Chain.build([Stride(2, 2, 0), Transpose((0, 2, 1))], x.shape)
    up = Chain.build([Stride(2, 2, 1), Transpose((0, 2, 1))], x.shape)
    box = ((1, 2), (4, 6), (0, 3))  # expert 1, gate rows 4-5 of 8
    regions = gate.regions(box)
    assert regions[0] == ((1, 2), (0, 3), (8, 12))  # gate columns 8, 10 and up's 9, 11
    np.testing.assert_array_equal(gate.apply(x[_slices(regions[0])], regions), x[1:2, :, 8:12:2].transpose(0, 2, 1))
    up_regions = up.regions(box)
    assert up_regions[0] == regions[0]
    np.testing.assert_array_equal(up.apply(x[_slices(up_regions[0])], up_regions), x[1:2, :, 9:12:2].transpose(0, 2, 1))
    back = gate.inverse(x[..., ::2].transpose(0, 2, 1), x.dtype, siblings=[(up, x[..., 1::2].transpose(0, 2, 1))])
    _same_bits(back, x)


@pytest.mark.parametrize(
    "arg, message",
    [
        ({"axis": 0}, "stride takes"),
        ({"axis": 0, "step": 2, "every": 1}, "stride takes"),
        ({"axis": 0, "step": 2.0}, "integer"),
        ({"axis": 0, "step": 2, "offset": 2}, "offset"),
        ({"axis": 0, "step": 0}, "step"),
    ],
)
def test_stride_parse_errors(arg, message):
    with pytest.raises(ValueError, match=message):
        parse_transform({"stride": arg})


def test_stride_render_and_bad_shapes():
    t = Stride(2, 2, 1)
    assert t.render() == "{ stride = { axis = 2, step = 2, offset = 1 } }"
    assert _parse_text(t.render()) == t and parse_transform({"stride": {"axis": 2, "step": 2}}) == Stride(2, 2, 0)
    with pytest.raises(ValueError, match="step must divide"):
        t.shape((2, 3, 5))
    with pytest.raises(ValueError, match="does not fit"):
        t.shape((4, 4))
