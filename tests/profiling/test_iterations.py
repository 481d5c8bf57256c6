"""Real training iterations measured on this machine (CPU here; the same code runs on one GPU)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tagplan.cli import main
from tagplan.datasets.traces.bundle import read_bundle
from tagplan.errors import SpecError
from tagplan.frontends.catalog import lookup_device
from tagplan.frontends.cluster_file import parse_cluster_data
from tagplan.frontends.cpu import gpu_cluster
from tagplan.ir.workload import DType
from tagplan.profiling.device import cpu_device_spec
from tagplan.profiling.iterations import CUDA_CASES, IterationCase, iteration_records, measure_iteration
from tagplan.training.iteration_fit import rebuild_cases

TINY = IterationCase(layers=2, hidden=64, heads=2, vocab=128, seq_len=16, global_batch=4, micro_batches=2)
BIG = IterationCase(layers=2, hidden=64, heads=2, vocab=128, seq_len=16, global_batch=4, micro_batches=1)
H200_BUNDLE = Path(__file__).resolve().parents[2] / "bench" / "data" / "gpu" / "h200" / "iterations"


def _no_memory_for_big(monkeypatch: pytest.MonkeyPatch) -> None:
    """`measure_iteration` as on a device that has no memory for `BIG` (every other case runs for real)."""
    import torch

    from tagplan.profiling import iterations

    real = iterations.measure_iteration

    def measured(case: IterationCase, **kwargs: object) -> iterations.IterationTiming:
        if case == BIG:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return real(case, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(iterations, "measure_iteration", measured)


@pytest.mark.parametrize("dtype", [DType.FP32, DType.BF16])
def test_an_iteration_record_names_what_ran_and_rebuilds(dtype: DType) -> None:
    spec = cpu_device_spec()
    (record,) = iteration_records(spec, [TINY], steps=2, dtype=dtype)
    assert record.measured_s > 0 and record.repeats == 2 and record.peak_memory_bytes is None  # no GPU allocator
    assert record.peak_reserved_bytes is None
    assert record.workload.dtype is dtype and f"({dtype.value}, " in record.source
    assert record.plan["micro_batches"] == 2 and record.plan["stages"][0]["layers"] == [0, 4]  # embedding, 2, head
    (case,) = rebuild_cases([record])
    assert case.cluster.devices[0].spec.name == spec.name and len(case.model.layers) == 4


def test_a_case_the_device_has_no_memory_for_is_skipped_and_named(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from tagplan.profiling import iterations

    _no_memory_for_big(monkeypatch)
    big = BIG
    skipped: list[IterationCase] = []
    said: list[str] = []
    records = list(iteration_records(cpu_device_spec(), [TINY, big, TINY], steps=1, out_of_memory=skipped,
                                     progress=said.append))
    assert len(records) == 2 and skipped == [big]
    assert sum("out of memory, skipped" in line for line in said) == 1
    assert iterations.out_of_memory_note(skipped) == "; out of memory: gpt?layers=2&hidden=64&heads=2&vocab=128 " \
        "seq 16 batch 4 x1" and iterations.out_of_memory_note([]) == ""  # what the manifest's notes gain
    with pytest.raises(torch.OutOfMemoryError):  # without the list nothing is skipped silently
        list(iteration_records(cpu_device_spec(), [big], steps=1))


def test_a_precision_the_loop_cannot_run_is_refused_by_name() -> None:
    with pytest.raises(SpecError, match="'fp8'"):
        measure_iteration(TINY, steps=1, warmup=0, dtype=DType.FP8)


def test_a_gpu_host_is_described_as_one_node_of_its_catalog_device() -> None:
    h200 = lookup_device("H200-SXM")
    cluster = parse_cluster_data(gpu_cluster(h200))
    assert [d.spec for d in cluster.devices] == [h200]
    assert all(case.global_batch % case.micro_batches == 0 for case in CUDA_CASES)  # whole micro-batches


def test_the_committed_gpu_bundle_rebuilds_with_its_peak_memory() -> None:
    records = read_bundle(H200_BUNDLE).iterations()
    assert len(records) == len(CUDA_CASES)
    cases = rebuild_cases(records)
    assert {d.spec.name for c in cases for d in c.cluster.devices} == {"H200-SXM"}
    assert all(r.peak_memory_bytes and r.workload.dtype is DType.BF16 for r in records)


def test_profile_iterations_on_cuda_without_a_gpu_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a host without a GPU, on any host
    assert main(["profile", "--device", "cuda", "--iterations", "--out", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert "device 'cuda'" in err and "sees no CUDA GPU" in err
    assert not (tmp_path / "b").exists()  # nothing half-written


def test_profile_iterations_names_the_cases_the_device_had_no_memory_for(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    import tagplan.profiling
    from tagplan.datasets.traces.bundle import Manifest, host_fingerprint, write_bundle
    from tagplan.profiling import iterations

    def ops_profile(out: Path, **kwargs: object) -> Path:  # the op grid, which this test does not need
        return write_bundle(out, Manifest(created="2026-01-01T00:00:00+00:00", source="tagplan profile",
                                          fingerprint=host_fingerprint("cpu-test"), device=cpu_device_spec(),
                                          notes="ops"), [])

    monkeypatch.setattr(tagplan.profiling, "profile", ops_profile)
    monkeypatch.setattr(iterations, "QUICK_CASES", (TINY, BIG))
    _no_memory_for_big(monkeypatch)
    assert main(["profile", "--iterations", "--threads", "1", "--out", str(tmp_path / "b")]) == 0
    bundle = read_bundle(tmp_path / "b")
    assert len(bundle.iterations()) == 1  # the case that fits was measured, the other skipped
    assert bundle.manifest.notes == "ops; out of memory: gpt?layers=2&hidden=64&heads=2&vocab=128 seq 16 batch 4 x1"
