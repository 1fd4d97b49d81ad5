"""Skeleton: the target module's shapes and dtypes, built with no memory.

A mapping's `model` names what to build, in one of three forms, and port builds it
under `eval_shape` (nothing initialised, no parameter memory):

- a model class with `from_config(config, *, key)` (port's own, or an Equinox module
  of yours): `cls.from_config(config, key=...)`;
- a Flax NNX module class whose constructor takes the `config.json` dict and `rngs`:
  `cls(config, rngs=nnx.Rngs(0))`;
- a factory, any function that takes the `config.json` dict and returns the module
  (Equinox, NNX), a pytree of arrays, or a pytree of `jax.ShapeDtypeStruct` (a Linen
  model's `jax.eval_shape(model.init, ...)`), with whatever config object and arguments
  that module needs: `build(config)`. The module need not know port.

```python
model = skeleton(mapping, config)     # leaves are jax.ShapeDtypeStruct
leaves(model)["blocks.attn.wq"]        # ShapeDtypeStruct((12, 12, 64, 768), float32)

def build(config):                     # mypkg/llama.py; the mapping says model = "mypkg.llama:build"
    return Llama(LlamaConfig.from_hf(config), rngs=nnx.Rngs(0))
```
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Callable, Iterator
from collections.abc import Mapping as AnyMapping
from typing import Any

import equinox as eqx
import jax
from jax.core import Tracer

from ._errors import ConfigError, MappingError, PortError
from ._mapping import Mapping
from ._model import is_model, is_nnx_class
from ._targets import is_nnx, nnx, path_str, target_of
from ._targets import leaves as leaves  # every leaf by its path, for a skeleton's reader
from ._text import one_line


def describe_model(model: Any) -> str:
    """How messages name a model class or factory: `module:qualname`."""
    return f"{getattr(model, '__module__', '?')}:{getattr(model, '__qualname__', type(model).__name__)}"


def builder(model: Any, config: AnyMapping[str, Any]) -> Callable[[], Any]:
    """The call that builds `model` (a model class, an NNX module class or a factory) from `config`.

    ```python
    builder(GPT2, config)()        # GPT2.from_config(config, key=jax.random.key(0))
    builder(build, config)()       # build(config)
    ```
    """
    config = dict(config)
    if is_model(model):
        return lambda: model.from_config(dict(config), key=jax.random.key(0))
    if is_nnx_class(model):
        return lambda: model(dict(config), rngs=nnx().Rngs(0))
    if isinstance(model, type):
        raise MappingError(
            f"model '{describe_model(model)}' is a class port cannot build: it has no from_config(config, *, key) "
            "and is not a Flax NNX module; name a factory instead (a function taking the config.json dict "
            "and returning the module)"
        )
    if not callable(model):
        raise MappingError(f"model {describe_model(model)} is not a class or a function")
    return lambda: model(dict(config))


@contextlib.contextmanager
def _no_eager_sharding() -> Iterator[None]:
    """Flax NNX variables annotated with sharding names are built unsharded (Flax 0.12 shards them
    as they are made, which needs a mesh): port places them itself."""
    module = sys.modules.get("flax.nnx")
    if module is None or not hasattr(module, "use_eager_sharding"):
        yield
        return
    with module.use_eager_sharding(False):
        yield


def _shapes_only() -> contextlib.AbstractContextManager[None]:
    """`port.nn.shapes_only()` where port's layers are imported (the model may use them: their
    initialisers then make zeros, not random numbers, which only the shapes of are kept);
    otherwise the model uses none of them, and nothing is needed."""
    layers = sys.modules.get("port.nn")
    return contextlib.nullcontext() if layers is None else layers.shapes_only()


def skeleton(model: Mapping | Any, config: AnyMapping[str, Any]) -> Any:
    """The module built from `config` as shapes only, under `eval_shape`: no memory used.

    **Arguments:**

    - `model`: a `Mapping` (its `model`), a model class (`from_config(config, *, key)`), a
      Flax NNX module class (`cls(config, rngs=...)`), or a factory (`build(config)`
      returning an Equinox module, an NNX module or a pytree of arrays).
    - `config`: the checkpoint's `config.json` as a dict.

    Raises `MappingError` naming the class or factory when it cannot be built, raises,
    returns something that is not a module or pytree of arrays, or returns arrays it
    did not make under `eval_shape` (real memory).

    ```python
    from port.models.gpt2 import GPT2

    skel = port.skeleton(GPT2, ckpt.config)
    skel.blocks.attn.wq          # ShapeDtypeStruct(shape=(12, 768, 12, 64), dtype=float32)
    ```
    """
    if isinstance(model, Mapping):
        config = model.model_config(config)  # a wrapper's language model: its text_config
    target = model.model_object() if isinstance(model, Mapping) else model
    make = builder(target, config)
    name = describe_model(target)
    kept: dict[str, Any] = {}

    def traced() -> Any:
        out = make()
        if is_nnx(out):
            kept["nnx"], arrays = nnx().split(out)
        elif _all_shapes(out):  # a pytree of ShapeDtypeStruct: the skeleton itself
            kept["static"] = out
            return None
        else:
            arrays, kept["static"] = eqx.partition(out, eqx.is_array)
        if is_model(target):  # port's protocol: its leaves are checked against the mapping and the output
            return arrays
        found = jax.tree_util.tree_leaves_with_path(arrays)
        real = [path_str(p) for p, leaf in found if not isinstance(leaf, Tracer)]
        if real:
            raise _Refused(
                f"factory {name} returned real arrays (at '{real[0]}'): it must make every array inside "
                "the call port makes under eval_shape, not before it or with NumPy"
            )
        if not found:
            raise _Refused(
                f"model {name} returned a {type(out).__name__} with no arrays: expected a module or a pytree of arrays"
            )
        return arrays

    try:
        with _no_eager_sharding(), _shapes_only():
            shapes = jax.eval_shape(traced)
    except _Refused as e:
        raise MappingError(str(e)) from None
    except (ConfigError, PortError):
        raise
    except jax.errors.ConcretizationTypeError as e:
        raise MappingError(
            f"model {name} needs concrete values ({one_line(str(e).splitlines()[0], 200)}); port builds it "
            "under eval_shape, where arrays have shapes only"
        ) from None
    except Exception as e:
        if is_model(target):
            raise
        where = _raised_at(e)
        raise MappingError(
            f"model {name} raised {type(e).__name__}: {one_line(str(e).strip().splitlines()[0] if str(e).strip() else '', 200)}{where}"
        ) from None
    if "nnx" in kept:
        return nnx().merge(kept["nnx"], shapes)
    if shapes is None:
        return kept["static"]
    return eqx.combine(shapes, kept["static"])


def _all_shapes(tree: Any) -> bool:
    """Whether `tree` is a pytree whose leaves are all `jax.ShapeDtypeStruct` (and it has some)."""
    found = jax.tree_util.tree_leaves(tree)
    return bool(found) and all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in found)


class _Refused(Exception):
    """A factory's result port will not use (raised inside the trace, told as a MappingError)."""


def _raised_at(error: BaseException) -> str:
    """` (file.py:12)`: where in the user's code an exception was raised, or ''."""
    frames = inspect.getinnerframes(error.__traceback__) if error.__traceback__ else []
    for frame in reversed(frames):
        if "/jax/" not in frame.filename and "/port/" not in frame.filename:
            return f" ({frame.filename.rsplit('/', 1)[-1]}:{frame.lineno})"
    return ""


def own_state(model: Mapping | Any, config: AnyMapping[str, Any], paths: list[str], sharding: Any) -> dict[str, Any]:
    """The values of a module's own state at `paths` (an NNX module's RNG keys and counts), as its
    constructor makes them, placed under `sharding` (replicated on the mesh).

    The constructor runs under `jax.jit` with only those variables as its output: the
    parameters' initialisation is dead code that XLA drops, so it costs no memory.

    ```python
    own_state(mapping, config, ["rngs.default.key"], NamedSharding(mesh, PartitionSpec()))
    ```
    """
    if isinstance(model, Mapping):
        config = model.model_config(config)  # a wrapper's language model: its text_config
    target = model.model_object() if isinstance(model, Mapping) else model
    make = builder(target, config)
    wanted = set(paths)

    def state() -> dict[str, Any]:
        built = make()
        return {p: v for p, v in target_of(built).leaves(built).items() if p in wanted}

    with _no_eager_sharding():
        return jax.jit(state, out_shardings=sharding)()
