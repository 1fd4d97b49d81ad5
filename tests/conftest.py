"""Fixtures: eight simulated CPU devices, and GPT-2 checkpoints written by `transformers`.

Helpers that are not fixtures live in `helpers.py` (`from helpers import ...`).
"""

import jax

jax.config.update("jax_num_cpu_devices", 8)

import pytest  # noqa: E402

from helpers import torch_gpt2, torch_logits  # noqa: E402


@pytest.fixture(scope="session")
def gpt2_checkpoints(tmp_path_factory):
    """Three layouts of one GPT-2, and its PyTorch logits; skips without PyTorch.

    - `lm`: GPT2LMHeadModel.save_pretrained (keys with `transformer.`, no lm_head: tied)
    - `base`: GPT2Model.save_pretrained (no prefix)
    - `sharded`: GPT2LMHeadModel saved in many files with an index
    """
    model = torch_gpt2()
    root = tmp_path_factory.mktemp("gpt2")
    model.save_pretrained(root / "lm")
    model.transformer.save_pretrained(root / "base")
    model.save_pretrained(root / "sharded", max_shard_size="20KB")
    assert (root / "sharded" / "model.safetensors.index.json").exists()
    return {name: root / name for name in ("lm", "base", "sharded")}, torch_logits(model)
