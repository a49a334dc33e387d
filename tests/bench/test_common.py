"""What every offline benchmark prints and records besides its figures."""

from __future__ import annotations

import torch

from minivllm.bench.common import print_header
from minivllm.platforms.cpu import cpu_model_name


def test_the_result_header_names_the_device(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "NVIDIA H100 80GB HBM3")
    assert print_header("Throughput Benchmark Result", "cuda") == "NVIDIA H100 80GB HBM3"
    assert print_header("Latency Benchmark Result", "cpu") == cpu_model_name()
    lines = capsys.readouterr().out.splitlines()
    assert "Throughput Benchmark Result" in lines[0] and lines[0].startswith("=")
    assert lines[1].startswith("Device:") and lines[1].endswith("NVIDIA H100 80GB HBM3")
    assert lines[3].endswith(cpu_model_name())
