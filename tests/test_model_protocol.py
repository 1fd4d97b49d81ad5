"""The model protocol, the abstract/final pattern, the axis vocabulary and the run-time checks.

- Every shipped model class answers `port.Model` (`is_model`), and what is not a model
  class does not.
- No class of port's layers, models or transforms subclasses a concrete class of port
  (Equinox's abstract/final pattern: abstract bases, final concrete classes).
- One axis vocabulary: every axis a mapping names, and every axis an annotation of
  `port.nn` / `port.models` names, is in `port.nn.AXES` (or, for annotations only,
  `REFINED` / `SHAPES`).
- conftest.py turns on jaxtyping's run-time checks: a call whose shapes disagree with
  the annotations fails, where without them it would run (or fail later, elsewhere).
"""

import importlib
import inspect
import pkgutil
import re
import tomllib
from pathlib import Path

import jax.numpy as jnp
import jaxtyping
import numpy as np
import pytest

import port
import port._transforms
import port.models
import port.nn
from port._model import input_kind, is_model
from port.authoring._verify import INPUTS

ROOT = Path(__file__).resolve().parents[1]
MAPPINGS = sorted((ROOT / "mappings").glob("*.toml"))
SOURCES = sorted((ROOT / "src" / "port" / "nn").glob("*.py")) + sorted((ROOT / "src" / "port" / "models").glob("*.py"))
ANNOTATION = re.compile(
    r"""\b(?:Float|Int|Bool|Shaped|Num|Real|Inexact|Integer|UInt|Key)\[[\w.]+, *["']([^"']*)["']\]"""
)


def _modules(package):
    return [importlib.import_module(f"{package.__name__}.{m.name}") for m in pkgutil.iter_modules(package.__path__)]


def _port_classes():
    """Every class defined in port.nn, port.models and port._transforms, by module."""
    for module in [*_modules(port.nn), *_modules(port.models), port._transforms]:
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ == module.__name__:
                yield cls


# ------------------------------------------------------------------ the model protocol


@pytest.mark.parametrize("path", MAPPINGS, ids=lambda p: p.stem)
def test_every_shipped_model_answers_the_protocol(path):
    cls = port.load_mapping(path).model_class()
    assert is_model(cls) and isinstance(cls, port.Model)
    assert input_kind(cls) in INPUTS


def test_what_is_not_a_model_class_is_refused():
    from port.models.gpt2 import GPT2

    class NoBuilder:
        pass

    class Builder:
        @classmethod
        def from_config(cls, config, *, key):
            return cls()

    assert is_model(Builder) and input_kind(Builder) == "input_ids"
    for obj in (NoBuilder, Builder(), GPT2.from_config, len, None, "port.models.gpt2:GPT2"):
        assert not is_model(obj), obj
    with pytest.raises(port.PortError, match="has no from_config"):
        port.skeleton(NoBuilder, {})
    with pytest.raises(port.PortError, match="`model`: expected a class with from_config"):
        port.restore("/nonexistent", model=NoBuilder)


# ------------------------------------------------------------------ abstract or final


def test_no_class_subclasses_a_concrete_class_of_port():
    """Every base a port class has in port is abstract: shared behaviour is composed (a
    function, a module field), or declared by an abstract base (`Decoder`, `Transform`)."""
    classes = list(_port_classes())
    assert {"Decoder", "Moe", "MoeConfig", "Transform", "Split"} <= {c.__name__ for c in classes}
    for cls in classes:
        for base in cls.__mro__[1:]:
            if base.__module__.startswith("port."):
                assert inspect.isabstract(base), (
                    f"{cls.__module__}.{cls.__qualname__} subclasses concrete {base.__qualname__}"
                )


def test_concrete_classes_are_final():
    for cls in _port_classes():
        if not inspect.isabstract(cls) and not issubclass(cls, Exception):
            assert getattr(cls, "__final__", False), f"{cls.__module__}.{cls.__qualname__} is concrete but not @final"


# ------------------------------------------------------------------ one axis vocabulary


def _mapping_axes():
    for path in MAPPINGS:
        data = tomllib.loads(path.read_text())
        for name in data.get("rules", {}):
            yield path.name, name
        for param in data.get("params", []):
            for name in param.get("axes", []):
                yield path.name, name


def _annotation_axes():
    for path in SOURCES:
        for match in ANNOTATION.finditer(path.read_text()):
            for name in match[1].split():
                name = name.lstrip("*#_")
                if name and name != "..." and not name.isdigit():
                    yield path.name, name


def test_the_vocabulary_is_one_table():
    assert not (set(port.nn.AXES) & set(port.nn.REFINED)) and not (set(port.nn.AXES) & set(port.nn.SHAPES))
    assert not (set(port.nn.REFINED) & set(port.nn.SHAPES))
    assert set(port.nn.REFINED.values()) <= set(port.nn.AXES)


def test_every_axis_a_mapping_names_is_in_the_vocabulary():
    found = set(_mapping_axes())
    assert found
    unknown = sorted((f, n) for f, n in found if n not in port.nn.AXES)
    assert not unknown, f"axes not in port.nn.AXES: {unknown}"


def test_every_axis_an_annotation_names_is_in_the_vocabulary():
    vocabulary = {**port.nn.AXES, **port.nn.REFINED, **port.nn.SHAPES}
    found = set(_annotation_axes())
    assert {"embed", "heads", "kv_heads", "mlp", "vocab", "experts"} <= {n for _, n in found}
    unknown = sorted((f, n) for f, n in found if n not in vocabulary)
    assert not unknown, f"annotation axes not in port.nn.AXES / REFINED / SHAPES: {unknown}"
    assert not {n for _, n in found} & {"layers", "embd", "inner", "head", "inter"}


def _configs():
    """A small config.json of every family: the decoders' contract configs, BERT's and ViT-B/16's."""
    transformers = pytest.importorskip("transformers")
    from test_decoders import FAMILIES
    from test_vit import VIT_B16

    from helpers import BERT_CONFIG

    configs = {
        name: getattr(transformers, config)(**kwargs).to_dict() for name, (_, config, kwargs) in FAMILIES.items()
    }
    return {**configs, "bert": transformers.BertConfig(**BERT_CONFIG).to_dict(), "vit": VIT_B16}


def _annotated(module, path):
    """The axes the annotation of the leaf at `path` names (None when the leaf or its owner is absent)."""
    *owners, field = path.split(".")
    for name in owners:
        module = getattr(module, name)
        if module is None:
            return None
    if getattr(module, field) is None:
        return None
    hints = {}
    for cls in reversed(type(module).__mro__):
        hints.update(getattr(cls, "__annotations__", {}))
    matches = ANNOTATION.findall(str(hints.get(field, "")))
    assert matches, f"{type(module).__qualname__}.{field} ({path}) has no jaxtyping annotation"
    # A union (`Float[Array, " head_dim"] | Float[Array, "heads head_dim"]`): every alternative.
    return [[port.nn.REFINED.get(n, n) for n in (n.lstrip("*#_") for n in m.split())] for m in matches]


def _stacked(axes: list, annotated: list) -> int:
    """How many leading axes of `axes` a mapping stacks (`layers`, `experts`) in front of `annotated`."""
    front = axes[: max(len(axes) - len(annotated), 0)]
    return len(front) if set(front) <= {"layers", "experts"} else -1


def test_each_leaf_s_annotation_names_the_axes_its_mapping_gives_it():
    """The annotation of every leaf a shipped mapping fills names, axis for axis, the logical
    axes the mapping gives it (a refined name standing for its logical axis), after the
    stacking axes (`layers`, `experts`) the mapping adds in front. A model without
    grouped-query attention (BERT, ViT) has as many key/value heads as query heads: its
    mapping may call `port.nn.Attention`'s `kv_heads` `heads`."""
    checked = set()
    for _name, config in _configs().items():
        mapping = port.mapping_for(config)
        skeleton = port.skeleton(mapping, config)
        for param in mapping.params:
            alternatives = _annotated(skeleton, param.path)
            if alternatives is None:
                continue
            axes = list(param.axes)
            # The alternative the leaf is: the one with as many axes as it has besides stacking ones.
            leaf = skeleton
            for name in param.path.split("."):
                leaf = getattr(leaf, name)
            annotated = next((a for a in alternatives if len(a) == leaf.ndim - _stacked(axes, a)), alternatives[0])
            stacking, own = axes[: len(axes) - len(annotated)], axes[len(axes) - len(annotated) :]
            where = f"{mapping.source}: {param.path}"
            assert set(stacking) <= {"layers", "experts"}, f"{where}: {axes} against the annotation {annotated}"
            same = lambda a, b: a is None or a == b or (a, b) == ("heads", "kv_heads")  # noqa: E731
            assert all(same(a, b) for a, b in zip(own, annotated)), f"{where}: {axes} against {annotated}"
            checked.add(Path(str(mapping.source)).name)
    assert len(checked) >= 15, checked


def test_the_scaffold_proposes_axes_of_the_vocabulary():
    from port.authoring._axes import _AXIS_KEYS

    assert set(_AXIS_KEYS) <= set(port.nn.AXES)


# ------------------------------------------------------------------ run-time checks


def test_a_call_with_mismatched_shapes_fails_its_annotation():
    """`attend`'s mask must be `[batch, seq, keys]`: a `[batch, 1, keys]` mask would broadcast
    and run, attending with the wrong mask; checked, it is refused. So is a key head whose
    size is not the query head's."""
    q = jnp.zeros((2, 5, 4, 8))
    k = v = jnp.zeros((2, 5, 2, 8))
    mask = jnp.ones((2, 5, 5), bool)
    assert port.nn.attend(q, k, v, mask, scale=0.5).shape == (2, 5, 4, 8)
    with pytest.raises(jaxtyping.TypeCheckError, match="mask"):
        port.nn.attend(q, k, v, mask[:, :1], scale=0.5)
    with pytest.raises(jaxtyping.TypeCheckError):
        port.nn.attend(q, jnp.zeros((2, 5, 2, 16)), v, mask, scale=0.5)
    with pytest.raises(jaxtyping.TypeCheckError):  # the weight of another width than x's embed axis
        port.nn.rms_norm(np.ones((2, 5, 64), np.float32), jnp.ones((32,)), 1e-6)


def test_a_module_built_with_mismatched_fields_fails_its_annotation():
    """A module's fields are checked when it is built: a `Cache`'s `mask` is `[batch, length]`
    and its `next_position` `[batch]`, so a cache whose two batch sizes differ is refused."""
    keys = values = jnp.zeros((1, 2, 4, 1, 8))
    cache = port.nn.Cache(keys, values, jnp.zeros((2, 4), bool), jnp.zeros((2,), jnp.int32), jnp.array(0))
    assert cache.size == 4
    with pytest.raises(jaxtyping.TypeCheckError):
        port.nn.Cache(keys, values, jnp.zeros((2, 4), bool), jnp.zeros((3,), jnp.int32), jnp.array(0))
