"""Shared pieces of the model benchmarks (bench/train.py, bench/decode.py, bench/moe.py).

- `peak_memory()`: start sampling this process's anonymous resident memory (`RssAnon`
  in /proc/self/status) from a separate process; the returned `stop()` gives the peak
  above the value at the start, in bytes (as bench/bench.py measures it).
- `rss()`: this process's `RssAnon` now.
- `CONFIGS`, `build(name, layers)`: the benchmarked decoders (Hugging Face config dicts),
  randomly initialised in float32.
- `started(mesh, devices)`: JAX on `devices` simulated CPU devices (unless a GPU is there),
  port's pipeline and model modules imported (they load lazily), the mesh made: a fresh
  process's start-up, done before any clock starts.
- `back_memory(nbytes)`: touch and free `nbytes`, so that the VM's first touch of guest
  memory is paid before the clock (every method alike).
- `isolated(script, spec)`: run `python script --measure JSON` in a fresh process and
  return the JSON object its last stdout line holds, or a one-line error.
- `median(values)`, `machine()`, `markdown(header, rows)`, `write(path, title, sections)`.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

_SAMPLER = """
import select, sys
status, interval = f"/proc/{sys.argv[1]}/status", float(sys.argv[2])
def rss():
    with open(status) as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0
start = peak = rss()
print("ready", flush=True)
while not select.select([sys.stdin], [], [], interval)[0]:
    peak = max(peak, rss())
print(max(peak, rss()) - start, flush=True)
"""


def rss() -> int:
    """This process's anonymous resident memory now, in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def peak_memory(interval: float = 0.005) -> Callable[[], int]:
    """Start sampling this process's `RssAnon` every `interval` seconds; `stop()` -> peak above start (bytes).

    A separate process, not a thread: a thread stalls while a library holds the GIL.
    """
    sampler = subprocess.Popen(
        [sys.executable, "-c", _SAMPLER, str(os.getpid()), str(interval)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert sampler.stdout.readline().strip() == "ready"

    def stop() -> int:
        out, _ = sampler.communicate("")
        return int(out.strip())

    return stop


CONFIGS = {
    # GPT-2 small (124M parameters, tied head).
    "gpt2": {
        "model_type": "gpt2",
        "n_embd": 768,
        "n_layer": 12,
        "n_head": 12,
        "vocab_size": 50257,
        "n_positions": 1024,
    },
    # A Llama of about the same size (125M: untied head, GQA 12/4, SwiGLU 2048).
    "llama": {
        "model_type": "llama",
        "hidden_size": 768,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "num_key_value_heads": 4,
        "intermediate_size": 2048,
        "vocab_size": 32000,
        "max_position_embeddings": 2048,
    },
}
_LAYERS = {"gpt2": "n_layer", "llama": "num_hidden_layers"}


def build(name: str, layers: int | None = None):
    """`CONFIGS[name]` randomly initialised (float32), with `layers` layers if given: (model, vocab size)."""
    import jax

    config = dict(CONFIGS[name])
    if layers:
        config[_LAYERS[name]] = layers
    if name == "gpt2":
        from port.models.gpt2 import GPT2 as cls
    else:
        from port.models.llama import Llama as cls
    return cls.from_config(config, key=jax.random.key(0)), config["vocab_size"]


def parameters(model) -> int:
    """How many parameters (array elements) `model` holds."""
    import equinox as eqx
    import jax

    return sum(leaf.size for leaf in jax.tree.leaves(eqx.filter(model, eqx.is_array)))


def back_memory(nbytes: int) -> None:
    """Touch and free `nbytes`: a VM backs fresh guest memory on first touch, slowly.

    Without this, whichever method first touches memory the VM never backed pays for
    it (0.9 s per 656 MB seen on the development VM, 0.06 s once backed). Every
    method gets the same treatment.
    """
    import numpy as np

    buffer = np.empty(nbytes, np.uint8)
    buffer[::4096] = 1
    del buffer


def started(mesh: str, devices: int | None = 8):
    """The mesh `mesh` ("4x2") in this fresh process, everything `port.load` imports already
    imported: JAX (on `devices` simulated CPU devices where the backend is the CPU), port's
    pipeline, its remote reader and its model families. Start-up, not the method measured."""
    import importlib
    import pkgutil

    import jax

    if devices:
        jax.config.update("jax_num_cpu_devices", devices)
    import port
    import port.models

    for name in (
        "open_checkpoint",
        "mapping_for",
        "skeleton",
        "plan",
        "place",
        "fill",
        "load",
        "restore",
        "convert",
        "export",
    ):
        getattr(port, name)
    for module in (
        "port._sources._remote",
        "port._sources._pytorch",
        *(f"port.models.{m.name}" for m in pkgutil.iter_modules(port.models.__path__)),
    ):
        importlib.import_module(module)
    return port.make_mesh(mesh)


def isolated(script: str | Path, spec: dict, timeout: float | None = None) -> dict | str:
    """`python script --measure JSON(spec)` in a fresh process: its last stdout line as JSON, else the error."""
    command = [sys.executable, str(script), "--measure", json.dumps(spec)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return f"timed out after {timeout:.0f} s"
    if done.returncode != 0:
        lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
        # The exception line, not the last frame of a traceback.
        error = next((line for line in reversed(lines) if "Error" in line or "Exception" in line), None)
        return (error or (lines[-1] if lines else f"exit {done.returncode}")).strip()[:160]
    return json.loads(done.stdout.strip().splitlines()[-1])


def device_bytes(tree) -> tuple[int, int]:
    """(the most bytes on one device, the bytes of distinct buffers on all devices) of the arrays in
    `tree`: shards that share one buffer (a replicated block's copies, where the backend lets them
    alias one host buffer) count once."""
    import jax

    per_device: dict = {}
    buffers: dict = {}
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array):
            for shard in leaf.addressable_shards:
                per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
                buffers[(shard.device.platform, shard.data.unsafe_buffer_pointer())] = shard.data.nbytes
    return (max(per_device.values()), sum(buffers.values())) if per_device else (0, 0)


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def machine() -> str:
    """This machine as the tables name it: `2 CPU cores (AMD EPYC ...), 24 GiB`, plus the JAX backend."""
    with open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{os.cpu_count()} CPU cores ({cpu}), {memory:.0f} GiB"


def devices() -> str:
    """The JAX devices a fresh process sees, e.g. `cpu: TFRT_CPU_0` or `gpu: NVIDIA H100 80GB HBM3`."""
    code = "import jax; d = jax.devices()[0]; print(f'{jax.default_backend()}: {len(jax.devices())} x {d.device_kind}')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    return done.stdout.strip() or "unknown"


def mb(n: float) -> str:
    return f"{n / 1e6:,.0f} MB"


def markdown(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A Markdown table; a row shorter than the header (an error message) is padded with empty cells."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        row = list(row) + [""] * (len(header) - len(row))
        lines.append("| " + " | ".join(str(cell) for cell in row) + " |")
    return "\n".join(lines)


def write(path: Path, title: str, script: str, sections: Sequence[str], notes: Sequence[str] = ()) -> None:
    """The Markdown file for `--out`: the title, the machine, the command, the notes, then the tables."""
    import jax

    header = [
        f"# {title}",
        "",
        f"Machine: {machine()}; JAX {jax.__version__} on {devices()}; Python {platform.python_version()}.",
        "",
        f"Command: `python bench/{script} " + " ".join(sys.argv[1:]) + "`",
        "",
    ]
    for note in notes:
        header += [note, ""]
    path.write_text("\n".join(header) + "\n" + "\n\n".join(sections).rstrip() + "\n")
