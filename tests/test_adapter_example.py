"""The adapter the README loads (`examples/tiny-gpt2-lora`): what its script writes, byte for
byte, and PEFT's own reading of it, merged and kept by port alike."""

import numpy as np
import pytest

import port

from helpers import REPO, script_module, transformers_or_skip

BASE, ADAPTER = REPO / "examples" / "tiny-gpt2", REPO / "examples" / "tiny-gpt2-lora"
IDS = np.array([[15, 42, 7, 300], [1, 2, 3, 4]])


def test_the_shipped_adapter_is_what_its_script_writes(tmp_path):
    script_module(REPO / "examples" / "make_tiny_gpt2_lora.py").main(tmp_path)
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        assert (tmp_path / name).read_bytes() == (ADAPTER / name).read_bytes(), name


@pytest.mark.parametrize("mode", ["merge", "keep"])
def test_port_reads_the_shipped_adapter_as_peft_does(mode):
    transformers = transformers_or_skip()
    import peft
    import torch

    base = transformers.GPT2LMHeadModel.from_pretrained(BASE)
    with torch.no_grad():
        plain = base(torch.tensor(IDS)).logits.numpy()
        expected = peft.PeftModel.from_pretrained(base, ADAPTER)(torch.tensor(IDS)).logits.numpy()
    model = port.load(BASE, adapter=ADAPTER, adapter_mode=mode, mesh="4x2")
    got = np.asarray(model(IDS))
    np.testing.assert_allclose(got, expected, atol=2e-5)
    assert np.abs(expected - plain).max() > 0.1  # the adapter changes the logits


def test_progress_counts_the_base_s_bytes_against_the_plan_s_total():
    events = []
    done = port.convert(BASE, mesh="4x2", adapter=ADAPTER, progress=events.append)
    reads = [e for e in events if e.phase == "read"]
    assert reads and all(e.done <= e.total for e in reads)
    assert reads[-1].done == reads[-1].total  # every base byte the plan counts, and no more
    assert done.report.adapter_bytes_read > 0  # the adapter's bytes, reported apart
