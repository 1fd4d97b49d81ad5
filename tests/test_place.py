"""Each device block is built from only the source bytes it needs, read once, straight into place."""

import math
from pathlib import Path

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

import port
import port._files
import port._place

from helpers import assert_blocks_read_exactly, element_bytes, place_on, recorded_reads

# The tiny GPT-2 example: save_pretrained's layout (tied, no lm_head) written with NumPy; vocab 1021,
# not divisible by model=2, is replicated on it
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tiny-gpt2"


@pytest.mark.parametrize("band_bytes", [port._place.BAND_BYTES, 1000])
def test_each_block_reads_exactly_its_region(reads, monkeypatch, band_bytes):
    """Also when tensors are read in bands by several jobs (small bands here: every tensor)."""
    monkeypatch.setattr(port._place, "BAND_BYTES", band_bytes)
    jobs, real_bands = [], port._place._bands
    monkeypatch.setattr(port._place, "_bands", lambda parts: jobs.extend(real_bands(parts)) or real_bands(parts))
    mesh = port.make_mesh("4x2")
    recipe, total, infos = place_on(EXAMPLE, mesh)
    per_block, elsewhere = reads()
    # No transpose or cast in GPT-2's mapping: every byte is read straight into its block.
    assert len(elsewhere) == 0
    assert_blocks_read_exactly(per_block, recipe, infos, mesh.shape)
    assert total == recipe.read_bytes == sum(len(files) for _, _, files in per_block)
    # One job per source key, or per band of it: wte (1021 x 64 float32) in bands of ~1000 bytes (3 rows).
    wte = [job for job in jobs if job[0].key == "transformer.wte.weight"]
    assert len(wte) == (1 if band_bytes > 1021 * 64 * 4 else math.ceil(1021 / (1000 // (64 * 4))))


def test_fused_and_replicated_tensors_are_read_once(reads):
    with port.open_checkpoint(EXAMPLE) as ckpt:
        port.load(EXAMPLE, mesh=port.make_mesh("4x2"))
        infos = ckpt.tensors
    per_block, elsewhere = reads()
    read = {}
    for leaf, _, files in per_block:
        read[leaf.path] = read.get(leaf.path, 0) + len(files)
    c_attn = infos["transformer.h.0.attn.c_attn.weight"].nbytes * 2  # two layers
    # q, k and v each read their own third of the fused c_attn, nothing more.
    assert read["blocks.attn.wq"] == read["blocks.attn.wk"] == read["blocks.attn.wv"] == c_attn // 3
    # wte is replicated on `model` (vocab 1021): 8 devices, 4 distinct blocks, each byte read once.
    assert read["wte"] == infos["transformer.wte.weight"].nbytes
    # Every source byte is read exactly once in all.
    assert sum(read.values()) == sum(i.nbytes for i in infos.values()) and len(elsewhere) == 0


def test_fused_tensor_is_read_end_to_end():
    """q, k and v cut from one c_attn are read together: each layer's c_attn in few preadv calls,
    not one per row of each block."""
    mesh = port.make_mesh("4x2")
    with port.open_checkpoint(EXAMPLE) as ckpt, recorded_reads() as calls:
        mapping = port.mapping_for(ckpt.config)
        recipe = port.plan(port.skeleton(mapping, ckpt.config), mapping, ckpt.tensors, ckpt.config, mesh.shape)
        attention = [
            leaf for leaf in recipe.leaves if leaf.path in ("blocks.attn.wq", "blocks.attn.wk", "blocks.attn.wv")
        ]
        port.place(port._plan.Plan(tuple(attention), recipe.mesh_shape, (), ()), ckpt, mesh)
        info = ckpt.tensors["transformer.h.0.attn.c_attn.weight"]
    rows = info.shape[0]
    # Each row of c_attn is 3 parts x 2 model blocks = 6 runs, end to end: 2 layers x rows x 6
    # runs, IOV_MAX (1024 on Linux) per call.
    assert sum(len(iov) for _, iov, _ in calls) == 2 * rows * 6
    assert len(calls) == 2 * math.ceil(rows * 6 / port._files.IOV_MAX)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_cast_blocks_read_their_region_once(reads, dtype):
    """With a cast the region goes through a staging buffer, still read once and only it."""
    mesh = port.make_mesh("4x2")
    with port.open_checkpoint(EXAMPLE) as ckpt:
        mapping = port.mapping_for(ckpt.config)
        recipe = port.plan(port.skeleton(mapping, ckpt.config), mapping, ckpt.tensors, ckpt.config, mesh.shape, dtype)
        arrays = port.place(recipe, ckpt, mesh)
        total = ckpt.bytes_read
    per_block, elsewhere = reads()
    assert len(elsewhere) == total == recipe.read_bytes
    assert len(set(elsewhere.tolist())) == len(elsewhere)  # each source byte once
    assert all(len(files) == 0 for _, _, files in per_block)
    wanted = set().union(
        *(
            element_bytes(ckpt.tensors[k], leaf.source_region(box)[0])
            for leaf, box, _ in per_block
            for k in leaf.source_region(box)[1]
        )
    )
    assert set(elsewhere.tolist()) == wanted
    wte = load_file(EXAMPLE / "model.safetensors")["transformer.wte.weight"]
    np.testing.assert_array_equal(np.asarray(arrays["wte"]), wte.astype(port._dtypes.dtype(dtype)))


def test_replicas_share_one_aligned_buffer_that_donation_never_writes():
    """A replicated block is read once and its devices share that one buffer (no copy); a donated
    step that gives each of them a different result of the same shape (the case in which writing
    into a shared buffer would mix them up) still gives each device its own result."""
    model = port.load(EXAMPLE, mesh=port.make_mesh("4x2"))
    shards = model.wte.addressable_shards  # vocab 1021 replicated on `model`
    pointers = [s.data.unsafe_buffer_pointer() for s in shards]
    assert len(set(pointers)) == 4  # one buffer per distinct block, each held by 2 devices
    assert all(p % port._place.ALIGN == 0 for p in pointers)
    by_index = {}
    for s in shards:
        by_index.setdefault(str(s.index), set()).add(s.data.unsafe_buffer_pointer())
    assert all(len(v) == 1 for v in by_index.values())
    wte = np.asarray(model.wte)
    assert model.wte.sharding.spec == jax.sharding.PartitionSpec(None, "data")
    offset = jax.shard_map(  # each device's block plus its index on `model`, side by side in data-model order
        lambda a: a + jax.lax.axis_index("model").astype(a.dtype),
        mesh=model.wte.sharding.mesh,
        in_specs=jax.sharding.PartitionSpec(None, "data"),
        out_specs=jax.sharding.PartitionSpec(None, ("data", "model")),
    )
    out = np.asarray(jax.jit(offset, donate_argnums=0)(model.wte))
    w = wte.shape[1] // 4
    for d in range(4):
        for m in range(2):
            k = 2 * d + m
            np.testing.assert_array_equal(out[:, k * w : (k + 1) * w], wte[:, d * w : (d + 1) * w] + m)
