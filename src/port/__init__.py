"""port: stream PyTorch / Hugging Face safetensors checkpoints into sharded Equinox models.

The pipeline: source -> mapping -> skeleton -> plan -> place -> fill -> save.

```python
import port

mesh = port.make_mesh("4x2")                  # axes data x model
model = port.load("gpt2", mesh=mesh)           # every leaf a sharded jax.Array
model = port.restore("gpt2-jax", mesh="2x4")   # a `port convert` output, onto any mesh
```

Names are imported when first used, so `port --help` and `port --version` answer
without starting JAX, and the command line catches Ctrl-C before JAX starts threads.
"""

from importlib import import_module
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    # source -> mapping -> skeleton -> plan -> place -> fill -> save
    "open_checkpoint": "._sources",
    "Checkpoint": "._sources",
    "load_mapping": "._mapping",
    "mapping_for": "._mapping",
    "parse_mapping": "._mapping",
    "Mapping": "._mapping",
    "Param": "._mapping",
    "skeleton": "._skeleton",
    "plan": "._plan",
    "Plan": "._plan",
    "LeafPlan": "._plan",
    "place": "._place",
    "fill": "._fill",
    "save": "._output",
    "restore": "._output",
    "restore_plan": "._output",
    "RestorePlan": "._output",
    "export": "._export",
    "ExportReport": "._export",
    # adapters: PEFT LoRA adapters attached (`port.nn.LoRA`) and written back
    "lora": "._adapters._lora",
    "export_adapter": "._adapters._export",
    # the whole pipeline, meshes, runs
    "convert": "._convert",
    "load": "._convert",
    "Conversion": "._convert",
    "Report": "._convert",
    "Progress": "._convert",
    "make_mesh": "._runtime",
    "mesh_shape": "._meshes",
    "initialize": "._runtime",
    "agree": "._runtime",
    # using a loaded model: generation (the layers themselves are `port.nn`)
    "generate": ".nn",
    # what a model class answers (`from_config(config, *, key)`, `input_kind`)
    "Model": "._model",
    # mapping authors
    "scaffold": ".authoring",
    "check": ".authoring",
    "verify": ".authoring",
    "Verification": ".authoring",
    # errors: one base, a subclass per kind
    "PortError": "._errors",
    "CheckpointError": "._errors",
    "MappingError": "._errors",
    "ConfigError": "._errors",
    "PlanError": "._errors",
    "OutputError": "._errors",
    "RunError": "._errors",
}

if TYPE_CHECKING:  # what the names are, for type checkers and IDEs; at run time they are imported when first used
    from ._adapters._export import export_adapter
    from ._adapters._lora import lora
    from ._convert import Conversion, Progress, Report, convert, load
    from ._errors import CheckpointError, ConfigError, MappingError, OutputError, PlanError, PortError, RunError
    from ._export import ExportReport, export
    from ._fill import fill
    from ._mapping import Mapping, Param, load_mapping, mapping_for, parse_mapping
    from ._meshes import mesh_shape
    from ._model import Model
    from ._output import RestorePlan, restore, restore_plan, save
    from ._place import place
    from ._plan import LeafPlan, Plan, plan
    from ._runtime import agree, initialize, make_mesh
    from ._skeleton import skeleton
    from ._sources import Checkpoint, open_checkpoint
    from .authoring import Verification, check, scaffold, verify
    from .nn import generate

__all__ = [  # the names of _EXPORTS, sorted: a literal list, so type checkers and IDEs read it
    "Checkpoint",
    "CheckpointError",
    "ConfigError",
    "Conversion",
    "ExportReport",
    "LeafPlan",
    "Mapping",
    "MappingError",
    "Model",
    "OutputError",
    "Param",
    "Plan",
    "PlanError",
    "PortError",
    "Progress",
    "Report",
    "RestorePlan",
    "RunError",
    "Verification",
    "agree",
    "check",
    "convert",
    "export",
    "export_adapter",
    "fill",
    "generate",
    "initialize",
    "load",
    "load_mapping",
    "lora",
    "make_mesh",
    "mapping_for",
    "mesh_shape",
    "open_checkpoint",
    "parse_mapping",
    "place",
    "plan",
    "restore",
    "restore_plan",
    "save",
    "scaffold",
    "skeleton",
    "verify",
]


def __getattr__(name: str) -> Any:
    if name == "__version__":  # the installed package's, read when asked for
        from importlib.metadata import PackageNotFoundError, version

        try:
            value: Any = version("port")
        except PackageNotFoundError:  # a source tree that was never installed
            value = "unknown"
    elif name in _EXPORTS:
        value = getattr(import_module(_EXPORTS[name], __name__), name)
    elif not name.startswith("__"):  # a submodule, as `port.models` or `port._plan`
        try:
            value = import_module(f".{name}", __name__)
        except ModuleNotFoundError:
            raise AttributeError(f"module 'port' has no attribute '{name}'") from None
    else:
        raise AttributeError(f"module 'port' has no attribute '{name}'")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
