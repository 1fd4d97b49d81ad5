"""Each device block is built from only the source bytes it needs, read once."""

import math
import threading

import numpy as np
import pytest

import port
import port._place
import port._source
from conftest import view_offsets


@pytest.fixture
def reads(monkeypatch):
    """Every view read, as (leaf, box, [(key, file byte offsets)]) per block built.

    Blocks are built on worker threads; a thread-local list collects each block's views.
    """
    blocks, local = [], threading.local()
    real_view, real_read_block = port._source.Checkpoint.view, port._place.read_block

    def view(self, key, region):
        out = real_view(self, key, region)
        local.views.append((key, view_offsets(self, key, out)))
        return out

    def read_block(leaf, checkpoint, box):
        local.views = []
        out = real_read_block(leaf, checkpoint, box)
        blocks.append((leaf, box, local.views))
        return out

    monkeypatch.setattr(port._source.Checkpoint, "view", view)
    monkeypatch.setattr(port._place, "read_block", read_block)
    return blocks


def element_bytes(info, region):
    """The file offsets of every byte of `region` of tensor `info`."""
    index = np.arange(math.prod(info.shape)).reshape(info.shape)[tuple(slice(a, b) for a, b in region)]
    starts = info.offset + index.reshape(-1) * info.dtype.itemsize
    return set((starts[:, None] + np.arange(info.dtype.itemsize)[None, :]).reshape(-1).tolist())


def test_each_block_reads_exactly_its_region(gpt2_checkpoints, reads):
    directories, _ = gpt2_checkpoints
    mesh = port.make_mesh("4x2")
    with port.open_checkpoint(directories["lm"]) as ckpt:
        mapping = port.mapping_for(ckpt.config)
        recipe = port.plan(port.skeleton(mapping, ckpt.config), mapping, ckpt.tensors, ckpt.config, mesh.shape)
        port.place(recipe, ckpt, mesh)
        total = ckpt.bytes_read
    by_leaf = {}
    for leaf, box, views in reads:
        by_leaf.setdefault(leaf.path, []).append(box)
        region, keys = leaf.source_region(box)
        assert [k for k, _ in views] == list(keys)
        wanted = set().union(*(element_bytes(ckpt.tensors[k], region) for k in keys))
        got = np.concatenate([offsets for _, offsets in views]).tolist()
        assert len(got) == len(set(got)), f"{leaf.path}: a byte read twice"
        assert set(got) == wanted, f"{leaf.path} {box}: read bytes outside its region"
    for leaf in recipe.leaves:  # one read per distinct block, though 8 devices ask
        boxes = by_leaf[leaf.path]
        assert len(boxes) == len(set(boxes)) == len(leaf.shards(mesh.shape)), leaf.path
    assert total == recipe.read_bytes


def test_fused_and_replicated_tensors_are_read_once(gpt2_checkpoints, reads):
    directories, _ = gpt2_checkpoints
    mesh = port.make_mesh("4x2")
    with port.open_checkpoint(directories["lm"]) as ckpt:
        port.load(directories["lm"], mesh=mesh)
        infos = ckpt.tensors
    read = {}
    for leaf, _, views in reads:
        read[leaf.path] = read.get(leaf.path, 0) + sum(len(offsets) for _, offsets in views)
    c_attn = infos["transformer.h.0.attn.c_attn.weight"].nbytes * 2  # two layers
    # q, k and v each read their own third of the fused c_attn, nothing more.
    assert read["blocks.attn.wq"] == read["blocks.attn.wk"] == read["blocks.attn.wv"] == c_attn // 3
    # wte is replicated on `model` (vocab 101): 8 devices, 4 distinct blocks, each byte read once.
    assert read["wte"] == infos["transformer.wte.weight"].nbytes
    # Every source byte is read exactly once in all.
    assert sum(read.values()) == sum(i.nbytes for i in infos.values())


def test_every_device_owns_an_aligned_buffer(gpt2_checkpoints):
    """Replicated blocks are read once but copied per device: no two devices share memory
    (a donated buffer must not change another device's copy)."""
    directories, _ = gpt2_checkpoints
    model = port.load(directories["lm"], mesh=port.make_mesh("4x2"))
    shards = model.wte.addressable_shards  # vocab 101 replicated on `model`
    pointers = [s.data.unsafe_buffer_pointer() for s in shards]
    assert len(set(pointers)) == 8
    assert all(p % port._place.ALIGN == 0 for p in pointers)
    by_index = {}
    for s in shards:
        by_index.setdefault(str(s.index), []).append(np.asarray(s.data))
    assert all(len(v) == 2 and np.array_equal(*v) for v in by_index.values())
