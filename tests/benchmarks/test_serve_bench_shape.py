"""serve_bench's ``--model-shape`` (issue 27): an 8B-class model's KV bytes per token, the plan
sized from it, and the KV bytes per token stated in the results."""

from __future__ import annotations

from benchmarks import common
from benchmarks.serve import report, workload
from tests.benchmarks.test_serve_bench import payload_for, quick_spec


def test_8b_kv_shape_has_128_kib_of_kv_per_token_and_sizes_the_plan(tmp_path):
    shape = workload.MODEL_SHAPES["8b-kv"]
    assert common.kv_bytes_per_token(shape, workload.DTYPE_BYTES) == 128 * 1024
    assert common.kv_bytes_per_token(workload.MODEL_SHAPES["tiny"], workload.DTYPE_BYTES) == 4096
    tiny = workload.make_plan(quick_spec(), (1, 4), 1, tmp_path)
    big = workload.make_plan(quick_spec(), (1, 4), 1, tmp_path, model=shape)
    assert big.block_bytes == 32 * 128 * 1024 == 32 * tiny.block_bytes
    assert big.chunk_bytes == 32 * tiny.chunk_bytes and big.host_all == 32 * tiny.host_all
    assert big.device_blocks == tiny.device_blocks  # blocks come from the conversations


def test_results_state_kv_bytes_per_token(tmp_path):
    payload = payload_for(tmp_path)
    payload.update(model=workload.MODEL_SHAPES["8b-kv"], model_shape="8b-kv",
                   kv_bytes_per_token=131072)
    json_path, md_path, _ = report.write_outputs(payload, tmp_path / "a")
    # Its own files: the tiny default's results are not overwritten.
    assert (json_path.name, md_path.name) == ("serve_bench_8b-kv.json", "serve_bench_8b-kv.md")
    md = md_path.read_text()
    assert "32 layers, 4 KV heads, head dim 128), shape `8b-kv`, **131,072 bytes (128 KiB) of KV per token**" in md
