"""Every path for every quantized format: `port convert` then `port.restore`, HTTP, two processes.

Each format's own file (tests/test_quantized_<format>.py) checks its dequantization against
its reference and its bytes per device; FP8's paths are in tests/test_quantized_fp8.py. Here
one tiny checkpoint per other format, made by those files' writers (MXFP4 gpt-oss, GPTQ and
AWQ Llamas, a compressed-tensors Qwen3 in int4 and NVFP4, a bitsandbytes nf4 Llama), goes
through the paths the source layer shares: what `port convert` writes restores to exactly
what `port.load` gives, a URL serves exactly the local load, and two processes each read
exactly their share.
"""

import json
import sys
from pathlib import Path

import pytest

import port

from helpers import assert_same, run_port

KINDS = ["mxfp4", "gptq", "awq", "int4", "nvfp4", "nf4"]


def build(kind: str, directory: Path) -> Path:
    """The tiny checkpoint of `kind`, written by its format's test module, under `directory`."""
    if kind == "mxfp4":
        from test_quantized_mxfp4 import SIZES, quantize_checkpoint, torch_gpt_oss

        torch_gpt_oss(**SIZES).save_pretrained(directory / "source")
        return quantize_checkpoint(directory / "source", directory / "mxfp4")
    if kind in ("gptq", "awq"):
        from test_quantized_int4 import quantized_llama

        return quantized_llama(directory / kind, kind)[0]
    if kind in ("int4", "nvfp4"):
        from test_quantized_compressed import compressed_tensors, torch_qwen3, write_compressed

        compressed_tensors()
        return write_compressed(torch_qwen3(), directory / kind, kind)
    from test_quantized_bitsandbytes import quantize_model

    from helpers import torch_llama

    return quantize_model(torch_llama(), directory, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """get(kind): (its directory, `port.load` of it on 4x2), each made once."""
    made = {}

    def get(kind):
        if kind not in made:
            directory = build(kind, tmp_path_factory.mktemp(kind))
            made[kind] = directory, port.load(directory, mesh="4x2")
        return made[kind]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_convert_writes_what_load_gives_and_plan_shows_the_format(checkpoints, tmp_path, kind):
    directory, loaded = checkpoints(kind)
    planned = run_port("plan", str(directory), "--mesh", "4x2")
    assert planned.returncode == 0, planned.stderr
    assert "quantized: " in planned.stdout
    out = tmp_path / "out"
    converted = run_port("convert", str(directory), "--mesh", "4x2", "--out", str(out))
    assert converted.returncode == 0, converted.stderr
    assert_same(port.restore(out, port.make_mesh("4x2")), loaded)


@pytest.mark.parametrize("kind", KINDS)
def test_a_url_serves_exactly_the_local_load(checkpoints, kind):
    from test_remote import start_server

    directory, loaded = checkpoints(kind)
    httpd = start_server(directory.parent)
    try:
        assert_same(port.load(f"{httpd.base}/{directory.name}", mesh="4x2"), loaded)
    finally:
        httpd.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gptq", "nvfp4"])
def test_two_processes_each_read_their_share(checkpoints, tmp_path, kind):
    from test_multiprocess import expected_reads, free_port, run_processes

    directory, loaded = checkpoints(kind)
    out, address = tmp_path / "out", f"127.0.0.1:{free_port()}"
    command = [sys.executable, "-m", "port", "convert", str(directory), "--mesh", "4x2", "--out", str(out)]
    command += ["--report", str(tmp_path / "run.json"), "--coordinator", address, "--num-processes", "2"]
    run_processes(lambda i: command + ["--process-id", str(i)])
    reports = [json.loads((tmp_path / f"run.{i}.json").read_text()) for i in range(2)]
    assert [r["bytes_read"] for r in reports] == expected_reads(directory, port.mesh_shape("4x2"))
    assert_same(port.restore(out, port.make_mesh("4x2")), loaded)
