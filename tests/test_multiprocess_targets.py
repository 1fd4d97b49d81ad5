"""Two processes of 4 CPU devices each load one checkpoint into a Flax NNX target (issue 34).

The worked example's NNX Llama (`examples/nnx_llama`: layers in an `nnx.List`, built by
the mapping's factory) is loaded with the Python API, `port.load(..., mapping=...,
mesh=...)`, on a mesh over both processes' 8 devices: each process reads exactly the
distinct blocks of its own devices (the plan's share, about half), every parameter is
one global array with 4 shards in each process, and the logits a jitted forward of the
global model computes equal transformers'.
"""

import json
import sys
import textwrap

import numpy as np
import pytest

import port

from helpers import INPUT_IDS, REPO, torch_llama, torch_logits
from test_multiprocess import expected_reads, free_port, run_processes

pytestmark = pytest.mark.slow  # every test runs two processes

EXAMPLE = REPO / "examples" / "nnx_llama"
MAPPING = EXAMPLE / "llama.toml"

SCRIPT = textwrap.dedent("""
    import json, sys
    import numpy as np
    import port

    directory, mapping, example, tests, address, process, logits_out, ids = sys.argv[1:9]
    assert port.initialize(address, num_processes=2, process_id=int(process), local_devices=4)
    sys.path[:0] = [example, tests]  # the mapping's factory, llama:build; the tests' helpers
    import jax
    from flax import nnx
    from jax.experimental import multihost_utils
    from helpers import recorded_reads

    with recorded_reads() as calls:
        model = port.load(directory, mesh=port.make_mesh("4x2"), mapping=mapping)
    params = jax.tree.leaves(nnx.state(model, nnx.Param))
    logits = nnx.jit(lambda m, x: m(x))(model, np.asarray(json.loads(ids)))
    gathered = multihost_utils.process_allgather(logits, tiled=True)
    if jax.process_index() == 0:
        np.save(logits_out, np.asarray(gathered))
    print(json.dumps({
        "read": sum(got for _, _, got in calls),
        "module": type(model).__module__ + "." + type(model).__qualname__,
        "leaves": len(params),
        "global": sorted({(a.sharding.mesh.size, len(a.addressable_shards)) for a in params}),
    }))
""")


@pytest.fixture(scope="module")
def llama_checkpoint(tmp_path_factory):
    """A transformers Llama (2 layers, grouped-query attention) saved in several files, and its logits."""
    pytest.importorskip("flax.nnx")
    model = torch_llama()
    directory = tmp_path_factory.mktemp("llama")
    model.save_pretrained(directory, max_shard_size="50KB")
    assert (directory / "model.safetensors.index.json").exists()
    return directory, torch_logits(model)


def test_two_processes_load_into_an_nnx_target_and_read_only_their_share(llama_checkpoint, tmp_path, monkeypatch):
    directory, expected_logits = llama_checkpoint
    address, out = f"127.0.0.1:{free_port()}", tmp_path / "logits.npy"
    results = run_processes(
        lambda i: [
            sys.executable,
            "-c",
            SCRIPT,
            str(directory),
            str(MAPPING),
            str(EXAMPLE),
            str(REPO / "tests"),
            address,
            str(i),
            str(out),
            json.dumps(INPUT_IDS.tolist()),
        ]
    )
    figures = [json.loads(stdout.strip().splitlines()[-1]) for _, stdout, _ in results]

    monkeypatch.syspath_prepend(str(EXAMPLE))  # the plan builds the example's skeleton here too
    shares = expected_reads(directory, port.mesh_shape("4x2"), mapping=MAPPING)
    total = sum(t.nbytes for t in port.open_checkpoint(directory).tensors.values())
    for figure, share in zip(figures, shares):
        assert figure["module"] == "llama.Llama"
        assert figure["leaves"] == 2 + 2 * 9 + 1  # embedding, head, per layer 9 weights, final norm
        assert figure["global"] == [[8, 4]]  # every parameter one array over 8 devices, 4 of them here
        assert figure["read"] == share, (figures, shares)
        assert 0.3 * total < figure["read"] < 0.7 * total, (figures, total)
    assert sum(f["read"] for f in figures) >= total
    assert np.abs(np.load(out) - expected_logits).max() < 1e-4
