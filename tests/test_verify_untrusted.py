"""Issue 32 rows 5, 7 and 11: `port verify` refuses, in one line naming the key, flag or file, what
its checkpoint, mapping or flags ask that it cannot do, before it converts or builds anything; and
its reference is built from the very weights port converted.

Each case is the tiny GPT-2 of `examples/tiny-gpt2` (vocabulary 1021, 64 positions) changed in one
way. The sizes asked are far beyond any machine's memory: each refusal comes before anything is
allocated, so no test allocates them.
"""

import json

import pytest

import port

from helpers import REPO, one_line, run_port, transformers_or_skip, write_sparse_checkpoint

GPT2 = (REPO / "mappings" / "gpt2.toml").read_text()


@pytest.mark.slow
def test_labels_beyond_memory_are_refused(tiny):
    """transformers builds a label for each of config.json's `num_labels` (without `id2label`)."""
    model = tiny(config={"num_labels": 10**12})
    one_line(run_port("verify", model), "config.json: 'num_labels' is 1000000000000", "available")
    model = tiny(config={"num_labels": "many"})
    one_line(run_port("verify", model), "config.json: 'num_labels' must be an integer >= 0")


@pytest.mark.slow
def test_a_batch_beyond_memory_is_refused(tiny):
    line = one_line(run_port("verify", tiny(), "--batch", "50000000"), "--batch 50000000 and --length 16: ")
    assert "[50000000, 16, 1021]" in line and "available" in line


def test_the_library_names_batch_and_length_as_arguments(tiny):
    transformers_or_skip()
    with pytest.raises(port.PortError, match=r"^batch=50000000 and length=16: .*\[50000000, 16, 1021\]"):
        port.verify(tiny(), batch=50_000_000)
    with pytest.raises(port.PortError, match=r"^length=65: more than the model's 64 positions"):
        port.verify(tiny(), length=65)


@pytest.mark.slow
def test_parameters_beyond_memory_are_refused(tmp_path):
    """The reference holds the checkpoint's parameters in float32, port's model its own copy: a
    checkpoint of 640 GB of float32 (a hole on disk) is refused before either is built."""
    config = json.loads((REPO / "examples" / "tiny-gpt2" / "config.json").read_text())
    write_sparse_checkpoint(tmp_path / "big", config, {"transformer.wte.weight": ("F32", [400_000, 400_000])})
    one_line(
        run_port("verify", tmp_path / "big"), f"{tmp_path / 'big'}: the reference's parameters in float32 (640.0 GB)"
    )


@pytest.mark.slow
def test_a_length_beyond_the_positions_is_refused(tiny):
    line = one_line(run_port("verify", tiny(), "--length", "65"), "--length 65: ")
    assert line == "port: error: --length 65: more than the model's 64 positions (config.json's 'n_positions')"


@pytest.mark.slow
def test_a_quantized_checkpoint_is_refused(tiny):
    model = tiny(config={"quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True}})
    line = one_line(run_port("verify", model))
    assert line == (
        "port: error: config.json: 'quantization_config' (quant_method 'bitsandbytes'): "
        "port verify does not handle quantized checkpoints"
    )


@pytest.mark.slow
def test_a_reference_output_that_is_no_tensor_is_refused(tiny, tmp_path):
    model = tiny()
    dunder = tmp_path / "dunder.toml"
    dunder.write_text(GPT2.replace('output = "logits"', 'output = "__class__"'))
    one_line(run_port("verify", model, "--mapping", dunder), f"{dunder}: 'reference.output' '__class__'")
    loss = tmp_path / "loss.toml"  # a field of the output, but None without labels
    loss.write_text(GPT2.replace('output = "logits"', 'output = "loss"'))
    line = one_line(run_port("verify", model, "--mapping", loss))
    assert line.startswith(
        f"port: error: {loss}: 'reference.output' 'loss' is not a tensor of GPT2LMHeadModel's output "
        "(it gives 'logits'"  # and the cache, by a name that depends on transformers' version
    )


@pytest.mark.slow
def test_the_reference_is_built_from_the_weights_port_converted(tiny):
    """A safetensors file of another name beside a `pytorch_model.bin` of other weights: port converts
    the safetensors file, and transformers, left to itself, would load the `.bin`."""
    import torch
    from safetensors.numpy import load_file

    model = tiny(config={"transformers_weights": "elsewhere.safetensors"})
    (model / "model.safetensors").rename(model / "weights.safetensors")
    tensors = load_file(model / "weights.safetensors")
    torch.save({k: torch.from_numpy(v + 1) for k, v in tensors.items()}, model / "pytorch_model.bin")
    before = sorted(p.name for p in model.iterdir())
    result = run_port("verify", model, "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    assert json.loads(result.stdout)["max_abs_difference"] < 1e-4
    assert sorted(p.name for p in model.iterdir()) == before  # nothing written beside it
