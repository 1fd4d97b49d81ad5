"""Two processes of 4 CPU devices each, on JAX's own runtime (jax.distributed, gloo).

Each process reads only the blocks of its own devices; together they write one
Orbax checkpoint that restores in a single process with the same logits; and, the
way back, each writes its devices' blocks of one Hugging Face export.
"""

import json
import math
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import port

from helpers import INPUT_IDS, logits

pytestmark = pytest.mark.slow  # every test runs two processes


def free_port() -> int:
    """A free port P for a run's coordinator, with P + 1 (where process 0 serves port's store) free too."""
    while True:
        with socket.socket() as s, socket.socket() as after:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
            try:
                after.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port


def run_processes(argv_for, env_for=lambda i: {}, timeout=240):
    """Start the two processes (never fork: fresh interpreters), wait, return their results."""
    base = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES", "PORT_DEBUG")}
    base["JAX_PLATFORMS"] = "cpu"
    procs = [
        subprocess.Popen(argv_for(i), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=base | env_for(i))
        for i in range(2)
    ]
    results = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        results.append((p.returncode, out, err))
    for code, _, err in results:
        assert code == 0, err
    return results


def expected_reads(directory, mesh_shape: dict, processes: int = 2, mapping=None) -> list[int]:
    """Bytes each process must read: the distinct blocks of its devices, through the plan
    (of `mapping`, a mapping file; default the shipped one).

    Devices are laid out as port.make_mesh does: jax.devices() order, process 0's first,
    filling the mesh in row-major order over (data, model).
    """
    with port.open_checkpoint(directory) as ckpt:
        mapping = port.mapping_for(ckpt.config, mapping)
        recipe = port.plan(port.skeleton(mapping, ckpt.config), mapping, ckpt.tensors, ckpt.config, mesh_shape)
    names = list(mesh_shape)
    per_process = math.prod(mesh_shape.values()) // processes
    reads = [0] * processes
    for leaf in recipe.leaves:
        boxes = [set() for _ in range(processes)]
        for device, coords in enumerate(np.ndindex(*mesh_shape.values())):
            position = dict(zip(names, coords))
            box = []
            for dim, entry in zip(leaf.shape, tuple(leaf.spec) + (None,) * len(leaf.shape)):
                n, i = (1, 0) if entry is None else (mesh_shape[entry], position[entry])
                box.append((i * dim // n, (i + 1) * dim // n))
            boxes[device // per_process].add(tuple(box))
        for p, distinct in enumerate(boxes):
            for box in distinct:
                region, keys = leaf.source_region(box)
                reads[p] += leaf.region_nbytes(region) * len(keys)  # a quantized source: packed bytes and scales
    return reads


@pytest.mark.parametrize("mesh_spec, via_env", [("4x2", False), ("8x1", True)])
def test_two_processes_convert_and_read_only_their_share(gpt2_checkpoints, tmp_path, mesh_spec, via_env):
    directories, expected_logits = gpt2_checkpoints
    source, out, address = directories["sharded"], tmp_path / "out", f"127.0.0.1:{free_port()}"
    command = [
        sys.executable,
        "-m",
        "port",
        "convert",
        str(source),
        "--mesh",
        mesh_spec,
        "--out",
        str(out),
        "--report",
        str(tmp_path / "run.json"),
    ]
    if via_env:  # JAX's own variables
        results = run_processes(
            lambda i: command,
            lambda i: {"JAX_COORDINATOR_ADDRESS": address, "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": str(i)},
        )
    else:
        results = run_processes(
            lambda i: command + ["--coordinator", address, "--num-processes", "2", "--process-id", str(i)]
        )
    for i, (_, _, err) in enumerate(results):
        assert f"simulating 4 CPU devices in each of 2 processes for --mesh {mesh_spec}" in err
        assert f"process {i}/2: converted" in err

    reports = [json.loads((tmp_path / f"run.{i}.json").read_text()) for i in range(2)]
    total = sum(t.nbytes for t in port.open_checkpoint(source).tensors.values())
    shares = expected_reads(source, port.mesh_shape(mesh_spec))
    for i, report in enumerate(reports):
        assert report["process"] == i and report["num_processes"] == 2
        assert len(report["device_bytes"]) == 4  # its own devices only
        assert report["bytes_read"] == shares[i]
        assert report["bytes_read"] < 0.6 * total  # about half: parameters split across processes
    assert sum(r["bytes_read"] for r in reports) >= total

    # One process restores the collectively written checkpoint: same logits.
    assert sorted(os.listdir(out)) == ["_CHECKPOINT_METADATA", "commit_success.txt", "params", "port"]
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".out")]
    model = port.restore(out, port.make_mesh("4x2"))
    restored = np.asarray(logits(model, INPUT_IDS))
    single = port.load(source, mesh=port.make_mesh(mesh_spec))
    np.testing.assert_allclose(restored, np.asarray(logits(single, INPUT_IDS)), atol=1e-5)
    assert np.abs(restored - expected_logits).max() < 1e-4


def test_two_processes_export_each_its_share(tmp_path):
    """A convert output exported by 2 processes x 4 devices: complete files, each process writing its blocks."""
    from safetensors.numpy import load_file

    example = Path(__file__).resolve().parents[1] / "examples" / "tiny-gpt2"
    converted, out, address = tmp_path / "jax", tmp_path / "hf", f"127.0.0.1:{free_port()}"
    port.convert(example, mesh="1x1", out=converted)
    command = [
        sys.executable,
        "-m",
        "port",
        "export",
        str(converted),
        "--mesh",
        "4x2",
        "--out",
        str(out),
        "--max-shard-size",
        "200KB",
        "--report",
        str(tmp_path / "run.json"),
    ]
    results = run_processes(
        lambda i: command + ["--coordinator", address, "--num-processes", "2", "--process-id", str(i)]
    )
    shares = []
    for i, (_, _, err) in enumerate(results):
        line = next(line for line in err.splitlines() if "exported" in line)
        assert line.startswith(f"port: process {i}/2: exported "), err
        shares.append(int(line.split("this process wrote ")[1].split("(")[1].split(" bytes")[0]))
    source = load_file(example / "model.safetensors")
    files = sorted(p.name for p in out.iterdir())
    assert files[-1] == "model.safetensors.index.json" and len(files) > 3, files
    index = json.loads((out / "model.safetensors.index.json").read_text())
    exported = {}
    for name in set(index["weight_map"].values()):
        exported.update(load_file(out / name))
    assert exported.keys() == source.keys()
    for key, value in source.items():
        assert exported[key].dtype == value.dtype and np.array_equal(exported[key], value), key
    total = sum(v.nbytes for v in source.values())
    assert sum(shares) == total == index["metadata"]["total_size"]
    assert 0 < shares[1] < shares[0] < total  # process 1 writes the blocks only its devices hold
    reports = [json.loads((tmp_path / f"run.{i}.json").read_text()) for i in range(2)]  # each process its own
    assert [(r["schema"], r["process"], r["num_processes"]) for r in reports] == [
        ("port.export/1", i, 2) for i in range(2)
    ]
    assert [r["bytes_written"] for r in reports] == shares
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "hf",
        "jax",
        "run.0.json",
        "run.1.json",
    ]  # nothing half-written


def test_two_processes_export_without_mesh_on_all_their_devices(tmp_path):
    """No --mesh: the run's devices (one CPU device each, 1x2), each process writing its share;
    the files are the one-process export's, byte for byte."""
    example = Path(__file__).resolve().parents[1] / "examples" / "tiny-gpt2"
    converted, out, address = tmp_path / "jax", tmp_path / "hf", f"127.0.0.1:{free_port()}"
    port.convert(example, mesh="1x1", out=converted)
    single = port.export(port.restore(converted), tmp_path / "one", converted)
    command = [sys.executable, "-m", "port", "export", str(converted), "--out", str(out), "--json"]
    results = run_processes(
        lambda i: command + ["--coordinator", address, "--num-processes", "2", "--process-id", str(i)]
    )
    documents = [json.loads(stdout) for _, stdout, _ in results]
    assert [(d["process"], d["num_processes"], d["mesh"]) for d in documents] == [
        (i, 2, {"data": 1, "model": 2}) for i in range(2)
    ]
    shares = [d["bytes_written"] for d in documents]
    assert all(share > 0 for share in shares) and sum(shares) == single.bytes_written
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in single.out.iterdir())
    for path in single.out.iterdir():
        assert (out / path.name).read_bytes() == path.read_bytes(), path.name


SCRIPT = textwrap.dedent("""
    import sys
    import equinox as eqx
    import numpy as np
    import port

    directory, address, process, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    assert port.initialize(address, num_processes=2, process_id=process, local_devices=4)
    import jax
    from jax.experimental import multihost_utils

    model = port.load(directory, mesh=port.make_mesh("4x2"))
    ids = np.asarray(eval(sys.argv[5]))
    logits = eqx.filter_jit(lambda m, x: m(x))(model, ids)
    gathered = multihost_utils.process_allgather(logits, tiled=True)
    if jax.process_index() == 0:
        np.save(out, np.asarray(gathered))
""")


def test_python_api_in_two_processes(gpt2_checkpoints, tmp_path):
    directories, expected_logits = gpt2_checkpoints
    address, out = f"127.0.0.1:{free_port()}", tmp_path / "logits.npy"
    ids = repr(INPUT_IDS.tolist())
    run_processes(lambda i: [sys.executable, "-c", SCRIPT, str(directories["lm"]), address, str(i), str(out), ids])
    assert np.abs(np.load(out) - expected_logits).max() < 1e-4


RESTORE_SCRIPT = textwrap.dedent("""
    import json, sys
    import equinox as eqx
    import numpy as np
    import port, port._sources._local

    out, address, process, mesh, logits_out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
    assert port.initialize(address, num_processes=2, process_id=process, local_devices=4)
    import jax
    from jax.experimental import multihost_utils

    read, real = [0], port._sources._local._preadv
    def counted(fd, iov, offset):
        got = real(fd, iov, offset)
        read[0] += got
        return got
    port._sources._local._preadv = counted
    model = port.restore(out, mesh)
    # Its share: the distinct blocks its own devices hold, each once.
    share = sum(
        sum(np.prod([s.indices(n)[1] - s.indices(n)[0] for s, n in zip(index, a.shape)], dtype=np.int64)
            for index in {tuple((s.start, s.stop) for s in sh.index): sh.index for sh in a.addressable_shards}.values())
        * a.dtype.itemsize
        for a in jax.tree.leaves(model)
    )
    ids = np.asarray(eval(sys.argv[6]))
    logits = multihost_utils.process_allgather(eqx.filter_jit(lambda m, x: m(x))(model, ids), tiled=True)
    if process == 0:
        np.save(logits_out, np.asarray(logits))
    print(json.dumps({"read": read[0], "share": int(share)}))
""")


@pytest.mark.parametrize("mesh_spec", ["4x2", "2x4"])
def test_two_processes_restore_and_read_only_their_share(gpt2_checkpoints, tmp_path, mesh_spec):
    """An output written from 4x2 in one process, restored by two processes of 4 devices:
    each reads exactly the bytes of its own devices' distinct blocks, about half of all."""
    directories, expected_logits = gpt2_checkpoints
    out, address = tmp_path / "out", f"127.0.0.1:{free_port()}"
    port.convert(directories["sharded"], mesh="4x2", out=out)
    ids = repr(INPUT_IDS.tolist())
    results = run_processes(
        lambda i: [
            sys.executable,
            "-c",
            RESTORE_SCRIPT,
            str(out),
            address,
            str(i),
            mesh_spec,
            str(tmp_path / "logits.npy"),
            ids,
        ]
    )
    figures = [json.loads(stdout.strip().splitlines()[-1]) for _, stdout, _ in results]
    total = sum(
        f.stat().st_size
        for f in (out / "params").rglob("*")
        if f.is_file() and f.parent != out / "params" and f.name != ".zarray"
    )
    for figure in figures:
        assert figure["read"] == figure["share"], figures
        assert 0.3 * total < figure["read"] < 0.7 * total, (figures, total)
    assert np.abs(np.load(tmp_path / "logits.npy") - expected_logits).max() < 1e-4
