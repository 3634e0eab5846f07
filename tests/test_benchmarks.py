"""The benchmark pipeline without running a benchmark: charts and RESULTS.md from canned JSON."""

from __future__ import annotations

import json
import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCH)

pytest.importorskip("matplotlib")

import run_all  # noqa: E402

MACHINE = "x86_64, 2 cores, Python 3.11.7, torch 2.13.0+cpu, 2 threads"


def _cold_rows(models: list[str], base: float) -> list[dict]:
    rows = []
    for i, model in enumerate(models):
        scale = base * (1 + i)
        rows.append({"model": model, "strategy": "eager", "scenario": "first call",
                     "ttfo_s": 0.2 * scale, "process_s": 6.0, "fxgraph_miss": 0, "fxgraph_hit": 0})
        for strategy, cold in (("full", 32.0), ("accelerate", 26.0), ("regional", 20.0)):
            for scenario, factor in (("cold", 1.0), ("torch warm", 0.2), ("megacache node", 0.9)):
                rows.append({"model": model, "strategy": strategy, "scenario": scenario,
                             "ttfo_s": cold * factor * scale / base, "process_s": 40.0,
                             "fxgraph_miss": 3, "fxgraph_hit": 0})
        for scenario, value in (("cc publish", 21.0), ("cc node", 3.1),
                                ("cc plain publish", 22.0), ("cc plain node", 3.4)):
            rows.append({"model": model, "strategy": "regional", "scenario": scenario,
                         "ttfo_s": value * scale / base, "process_s": 9.0,
                         "fxgraph_miss": 0, "fxgraph_hit": 3})
    return rows


COLD = {
    "benchmark": "cold_start", "machine": MACHINE, "seq": 128, "arch": "gpt2", "device": "cpu",
    "dtype": "float32", "models": ["4x256", "12x768"], "torch": "2.13.0+cpu",
    "rows": _cold_rows(["4x256", "12x768"], 1.0),
    "ratios": [{"model": "4x256", "against": "regional", "node_vs_warm": 0.78,
                "node_vs_cold": 0.16, "plain_vs_warm": 0.48, "node_vs_megacache": 0.2}],
    "run": {"command": "python benchmarks/bench_cold_start.py --json", "machine": MACHINE,
            "torch": "2.13.0+cpu", "date": "2025-01-01", "wall_s": 700.0, "smoke": False},
}
GPU = {**COLD, "arch": "llama", "device": "cuda", "dtype": "bfloat16", "models": ["16x2048"],
       "rows": [r for r in _cold_rows(["16x2048"], 1.0)
                if r["scenario"] not in ("cc plain node", "cc plain publish")],
       "ratios": [], "run": {}, "command": "bash benchmarks/gpu_check.sh", "date": "2025-01-02"}
FINGERPRINT = {
    "benchmark": "fingerprint", "api_backend": "native", "repeats": 50, "torch": "2.13.0",
    "rows": [
        {"model": m, "modules": t + 30, "tensors": t, "python_ms": t * 0.015, "native_ms": t * 0.001,
         "api_ms": t * 0.0015, "python_us_per_tensor": 15.0, "native_us_per_tensor": 1.0,
         "speedup": 15.0}
        for m, t in (("gpt2-small", 148), ("llama3-70b-shape/8L", 77), ("llama3-70b-shape/20L", 185),
                     ("llama3-70b-shape/40L", 365), ("llama3-70b-shape/80L", 725))
    ],
}
REGIONS = {
    "config": {"layers": 6, "width": 384, "heads": 6, "seq": 128, "iters": 30, "warmup": 3},
    "results": [
        {"variant": "eager", "ttfo_s": 0.1, "steady_ms": 20.0, "unique_graphs": 0},
        {"variant": "full", "ttfo_s": 30.0, "steady_ms": 18.0, "unique_graphs": 1,
         "ttfo_vs_full": 1.0, "steady_vs_full": 1.0},
        {"variant": "ours", "error": ["Traceback", "RuntimeError: boom"]},
    ],
}
RANKS = {
    "benchmark": "ranks", "layers": 4, "width": 256,
    "rows": [
        {"ranks": n, "compile_cache": cc, "total_compile_cpu_s": (8.0 if cc else 30.0) * n,
         "slowest_ttfo_s": 9.0 if cc else 35.0 + n}
        for n in (2, 4) for cc in (False, True)
    ],
}

RANKS_REAL = {  # bench_ranks.py's own layout
    "config": {"layers": 4, "width": 256, "heads": 4, "seq": 128, "threads": 1},
    "uncached": {"ranks": [{"rank": i, "role": "compiled", "cpu_s": 30.0, "ttfo_s": 33.0,
                            "waited_s": 0.0, "counters": {"fxgraph_miss": 3, "fxgraph_hit": 0}}
                           for i in (0, 1)], "total_cpu_s": 60.0, "slowest_ttfo_s": 33.0},
    "cached": {"ranks": [{"rank": 0, "role": "leader", "cpu_s": 30.0, "ttfo_s": 33.0,
                          "waited_s": 0.0, "counters": {"fxgraph_miss": 3, "fxgraph_hit": 0}},
                         {"rank": 1, "role": "follower", "cpu_s": 4.0, "ttfo_s": 34.0,
                          "waited_s": 28.0, "counters": {"fxgraph_miss": 0, "fxgraph_hit": 3}}],
               "total_cpu_s": 34.0, "slowest_ttfo_s": 34.0},
    "cpu_ratio": 34 / 60, "ttfo_ratio": 34 / 33, "goal_cpu": True, "goal_ttfo": False,
}


def test_ranks_real_layout(tmp_path):
    (tmp_path / "ranks.json").write_text(json.dumps(RANKS_REAL))
    md = tmp_path / "RESULTS.md"
    assert run_all.main(["--from-json", str(tmp_path), "--results-md", str(md), "--charts-dir",
                         str(tmp_path / "charts")]) == 0
    text = md.read_text()
    assert "| cached | 1 | follower | 4.0 | 34.0 | 28.0 | 0/3 |" in text
    assert "0.57× (goal ≤ 0.6×: **met**)" in text and "(goal ≤ 1.0×: **not met**)" in text
    assert (tmp_path / "charts" / "ranks.png").stat().st_size > 10_000


def test_ranks_hooks_measure_is_rendered(tmp_path):
    hooks = {"steps": [{"step": 0, "seq": 16, "step_s": 80.0, "hook_ms": 79.6, "published": 1,
                        "publishing": True},
                       {"step": 1, "seq": 16, "step_s": 0.2, "hook_ms": 0.1, "published": 0,
                        "publishing": False}],
             "store_packs": 2003, "max_hook_ms_publishing": 79.6, "goal_hooks": False,
             "size_walk_ms": 190.0, "size_counter_ms": 0.2, "walk_vs_counter": 950.0,
             "read_all_headers_ms": 436.0}
    data = {**RANKS_REAL, "goal_cpu_max": 0.55, "goal_cpu": False, "hooks": hooks}
    (tmp_path / "ranks.json").write_text(json.dumps(data))
    md = tmp_path / "RESULTS.md"
    assert run_all.main(["--from-json", str(tmp_path), "--results-md", str(md), "--charts-dir",
                         str(tmp_path / "charts")]) == 0
    text = md.read_text()
    assert "(goal ≤ 0.55×: **not met**)" in text
    assert "| 0 | 16 | 80.00 | 79.60 | 1 | yes |" in text and "2003 packs" in text
    assert "| 1 | 16 | 0.20 | 0.10 | 0 | no |" in text
    assert "(goal < 5 ms: **not met**)" in text


@pytest.fixture
def results_dir(tmp_path):
    root = tmp_path / "results"
    (root / "gpu").mkdir(parents=True)
    for name, data in (("cold_start", COLD), ("fingerprint", FINGERPRINT), ("regions", REGIONS),
                       ("ranks", RANKS)):
        (root / f"{name}.json").write_text(json.dumps(data))
    (root / "gpu" / "cold_start.json").write_text(json.dumps(GPU))
    return root


def test_from_json_renders_the_whole_page(results_dir, tmp_path):
    md = tmp_path / "RESULTS.md"
    md.write_text("# Benchmark results\n\n## Reliability\n\nHand-written text that must go.\n")
    charts = tmp_path / "charts"
    assert run_all.main(["--from-json", str(results_dir), "--results-md", str(md),
                         "--charts-dir", str(charts)]) == 0
    text = md.read_text()
    assert text.startswith("# Benchmark results\n\nGenerated by `python benchmarks/run_all.py")
    assert "Hand-written text that must go." not in text  # the page is rendered whole
    for heading in ("## Regional compilation", "## Fingerprint", "## Cold start (CPU)",
                    "## Cold start (GPU)", "## Ranks"):
        assert text.count(f"\n{heading}\n") == 1, heading
    # Scenarios whose JSON is missing are left out, not shown empty.
    assert "## Object storage" not in text and "## Generation" not in text
    assert text.index("## Cold start (CPU)") < text.index("## Cold start (GPU)") < text.index("## Ranks")
    assert "(#cold-start-gpu)" in text  # the contents link to each section
    assert "Command: `python benchmarks/bench_cold_start.py --json`" in text
    assert "2025-01-01" in text and MACHINE in text
    assert "JSON: `benchmarks/results/cold_start.json`." in text
    assert "Definition change: `cc node` is compile_cache with precompile" in text
    assert "RuntimeError: boom" in text  # a failed variant is shown, not dropped
    assert "15.9" in text and "3.10 s / 4.00 s = **0.78×: not met**" in text  # GPU goal
    for name in ("cold_start.png", "cold_start_gpu.png", "fingerprint.png", "ranks.png"):
        assert (charts / name).stat().st_size > 10_000, name
    # Rendering is idempotent: the same JSON gives the same file.
    run_all.main(["--from-json", str(results_dir), "--results-md", str(md), "--charts-dir",
                  str(charts), "--no-charts"])
    assert md.read_text() == text


def test_committed_results_page_is_what_the_committed_json_renders():
    """benchmarks/RESULTS.md is generated: a hand edit, or JSON committed without rendering the
    page again (python benchmarks/run_all.py --render-only), fails here."""
    with open(os.path.join(BENCH, "RESULTS.md"), encoding="utf-8") as f:
        committed = f.read()
    rendered = run_all.render_page(os.path.join(BENCH, "results"))
    assert committed == rendered, "run python benchmarks/run_all.py --render-only"
    assert len(committed.splitlines()) < 600
    for section in committed.split("\n## ")[1:]:
        assert "Command: `" in section and "; run 20" in section, section.splitlines()[0]


def test_gpu_json_found_by_device(tmp_path):
    (tmp_path / "cold_start.json").write_text(json.dumps(GPU))  # gpu_check.sh's $OUT layout
    data = run_all.load_results(str(tmp_path))
    assert list(data) == ["cold_start_gpu"]
    node, warm, ratio = run_all.gpu_goal(data["cold_start_gpu"])
    assert (node, warm) == (3.1, pytest.approx(4.0)) and ratio == pytest.approx(0.775)


def test_missing_benchmark_script_is_reported(monkeypatch, tmp_path):
    monkeypatch.setitem(run_all.BENCHMARKS, "ranks", {**run_all.BENCHMARKS["ranks"],
                                                      "script": "bench_does_not_exist.py"})
    error = run_all.run_benchmark("ranks", True, str(tmp_path), 10)
    assert error and "does not exist yet" in error


GENERATE = {
    "benchmark": "generate",
    "config": {"layers": 4, "width": 256, "prompt": 32, "new": 64, "warm_runs": 3, "rounds": 3,
               "dtype": "bfloat16", "threads": 0},
    "results": [
        {"variant": "eager", "runs": 3, "cold_ttft_s": 0.05, "cold_generate_s": 0.84,
         "warm_generate_s": 0.86, "decode_tok_s": 76.1, "unique_graphs": 0, "fxgraph_hit": 0,
         "fxgraph_miss": 0, "same_tokens_as_eager": True},
        {"variant": "full", "runs": 3, "cold_ttft_s": 30.0, "cold_generate_s": 51.4,
         "warm_generate_s": 0.77, "decode_tok_s": 85.7, "unique_graphs": 3, "fxgraph_hit": 0,
         "fxgraph_miss": 3, "same_tokens_as_eager": False},
        {"variant": "hf_static", "error": ["RuntimeError: boom"]},
    ],
    "ratios": {"cold_generate_vs_full": 0.45, "decode_vs_full": 0.98,
               "decode_vs_full_per_process": 0.91,
               "store_node_vs_eager_budget": 3.1, "ours_break_decode_vs_ours": 0.8,
               "per_round": [{"cold_generate_vs_full": 0.44, "decode_vs_full": 1.02,
                              "store_node_vs_eager_budget": 3.0}]},
    "paired": {"variant": "paired", "pairs": 3, "ours_vs_full_per_pair": [0.96, 1.01, 0.98],
               "ours_vs_full": 0.98, "decode_tok_s": {"eager": [70.0, 71.0, 72.0],
                                                       "full": [80.0, 81.0, 82.0],
                                                       "ours": [78.0, 82.0, 80.0]}},
    "run": {"command": "python benchmarks/bench_generate.py --width 256 --rounds 3 --json",
            "machine": MACHINE, "torch": "2.13.0+cpu", "date": "2025-01-03", "wall_s": 900.0,
            "smoke": False},
}


def test_generate_section_shows_each_variant_and_each_goal(tmp_path):
    (tmp_path / "generate.json").write_text(json.dumps(GENERATE))
    md = tmp_path / "RESULTS.md"
    assert run_all.main(["--from-json", str(tmp_path), "--results-md", str(md), "--no-charts"]) == 0
    text = md.read_text()
    assert "\n## Generation\n" in text
    assert "4 layers × 256, bfloat16" in text and "RuntimeError: boom" in text
    assert "| full | 30.00 | 51.40 | 0.770 | 85.7 | 3 | 0/3 | no | 3 |" in text
    assert "full compile's: **0.45** (goal <= 0.5: met)" in text
    # the decode goal is the A/B run's median pair, and the per-process figure is shown beside it
    assert "(median of the A/B pairs): **0.98** (goal >= 0.95: met)" in text
    assert "ours / full per pair): 0.96, 1.01, 0.98; median tok/s eager 71.0, full 81.0" in text
    assert "per-process medians above: 0.91" in text
    assert "round 1 alone: cold generate 0.44, decode 1.02, store node 3.00" in text
    assert "(1.2 x eager's + 2 s): **3.10** (goal <= 1.0: not met)" in text
    assert "--width 256 --rounds 3 --json" in text


def _remote_section(tmp_path, data: dict) -> str:
    """RESULTS.md as run_all writes it from ``data``, a bench_remote JSON."""
    (tmp_path / "remote.json").write_text(json.dumps(data))
    md = tmp_path / "RESULTS.md"
    assert run_all.main(["--from-json", str(tmp_path), "--results-md", str(md), "--no-charts"]) == 0
    return md.read_text()


def test_remote_section_shows_both_stores_bytes_and_the_ratio(tmp_path):
    side = {"ttfo_s": 2.0, "ttfo_samples": [2.0], "process_s": 9.0, "fxgraph_miss": 0,
            "fxgraph_hit": 3, "bytes_moved": 1234567, "remote_errors": 0}
    data = {"benchmark": "remote", "machine": MACHINE, "seq": 128, "repeats": 3, "goal": 1.1,
            "run": {"command": "python benchmarks/bench_remote.py --json", "date": "2025-01-01"},
            "rows": [{"model": "4x256", "cold_ttfo_s": 30.0, "dir": side,
                      "s3": {**side, "ttfo_s": 2.4}, "ratio": 1.2, "goal_met": False}]}
    text = _remote_section(tmp_path, data)
    assert "\n## Object storage\n" in text
    assert "S3 (moto, 127.0.0.1)" in text and "directory store" in text
    assert "1,234,567" in text and "**1.20x** (not met)" in text


def test_remote_section_shows_compressed_against_uncompressed_and_the_client_import(tmp_path):
    side = {"ttfo_s": 2.0, "ttfo_samples": [2.0], "process_s": 9.0, "fxgraph_miss": 0,
            "fxgraph_hit": 3, "bytes_moved": 100000, "remote_errors": 0}
    data = {"benchmark": "remote", "machine": MACHINE, "seq": 128, "repeats": 3, "goal": 1.05,
            "bytes_goal": 3.0, "run": {"command": "python benchmarks/bench_remote.py --json", "date": "2025-01-01"},
            "rows": [{"model": "4x256", "cold_ttfo_s": 30.0, "dir": side, "s3": {**side, "ttfo_s": 2.05},
                      "s3_raw": {**side, "ttfo_s": 2.2, "bytes_moved": 480000}, "ratio": 1.025,
                      "raw_ratio": 1.1, "goal_met": True, "bytes_fewer": 4.8, "bytes_goal_met": True}],
            "client_import": {"client": "small S3 client", "import_s": 0.01, "make_s": 0.02,
                              "first_request_s": 0.03, "s3fs_imported": False}}
    text = _remote_section(tmp_path, data)
    assert "S3, packs uncompressed" in text and "480,000" in text
    assert "**4.80x** (goal >= 3.0: met)" in text and "**1.02x** (met)" in text
    assert "import 0.010 s, make 0.020 s, first request 0.030 s (s3fs imported: no)" in text


def test_cold_start_ratios_per_mode_and_the_training_rows_in_results(tmp_path):
    import bench_cold_start

    rows = []
    for mode, scale in (("forward", 1.0), ("train", 2.0)):
        for strategy, scenario, ttfo, process in (
            ("eager", "first call", 0.1, 5.0), ("regional", "cold", 20.0, 25.0),
            ("regional", "torch warm", 4.0, 9.0), ("full", "cold", 30.0, 35.0),
            ("full", "torch warm", 5.0, 10.0), ("regional", "cc node", 2.0, 6.0),
            ("regional", "cc node (warm)", 2.2, 6.2),
        ):
            rows.append({"model": "2x64", "mode": mode, "strategy": strategy, "scenario": scenario,
                         "ttfo_s": ttfo * scale, "process_s": process, "fxgraph_miss": 0,
                         "fxgraph_hit": 1})
    ratios = bench_cold_start.ratios(rows)
    train = {r["against"]: r for r in ratios if r["mode"] == "train"}
    assert train["regional"]["node_vs_warm"] == pytest.approx(0.5)
    assert train["full"]["node_vs_cold"] == pytest.approx(4.0 / 60.0)
    assert train["regional"]["process_vs_eager"] == pytest.approx(6.0 / 5.0)
    assert train["regional"]["warm_publisher_node_vs_warm"] == pytest.approx(0.55)
    (tmp_path / "cold_start.json").write_text(json.dumps({**COLD, "rows": rows, "ratios": ratios}))
    md = tmp_path / "RESULTS.md"
    assert run_all.main(["--from-json", str(tmp_path), "--results-md", str(md), "--no-charts"]) == 0
    text = md.read_text()
    assert "| train | compile_cache regional | cc node (warm) | 4.40 |" in text
    assert "| 2x64 | train | regional | 0.50 | 0.10 | 1.20 | 0.55 |" in text


def test_cold_start_process_ratio_compares_median_whole_processes():
    """One slow eager start (imports, model building) must not decide the process goal."""
    import bench_cold_start

    eager = bench_cold_start._median_of(
        [{"ttfo_s": t, "process_s": p} for t, p in ((0.1, 9.0), (0.2, 5.0), (0.3, 6.0))])
    assert eager["ttfo_s"] == 0.2 and eager["process_s"] == 5.0  # the median run by TTFO...
    assert eager["process_median_s"] == 6.0  # ...and the median of all three whole processes
    node = bench_cold_start._median_of(
        [{"ttfo_s": t, "process_s": p} for t, p in ((1.0, 7.2), (1.1, 7.0), (1.4, 8.0))])
    base = {"model": "2x64", "mode": "forward", "fxgraph_miss": 0, "fxgraph_hit": 0}
    rows = [{**base, "strategy": "eager", "scenario": "first call", **eager},
            {**base, "strategy": "regional", "scenario": "cc node", **node},
            {**base, "strategy": "regional", "scenario": "cold", "ttfo_s": 20.0, "process_s": 25.0},
            {**base, "strategy": "regional", "scenario": "torch warm", "ttfo_s": 3.0,
             "process_s": 9.0}]
    ratio = bench_cold_start.ratios(rows)[0]
    assert ratio["process_vs_eager"] == pytest.approx(7.2 / 6.0)
    assert ratio["plain_vs_warm"] is None  # no cc plain node in this run


def test_kernel_counters_tell_compiled_kernels_from_restored_ones(tmp_path, monkeypatch):
    """gpu_check's per-row counts, with stand-ins: a kernel directory torch's bundler writes is
    restored, one that appears otherwise was compiled; benchmark_all_configs calls are counted."""
    import _common
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner
    from torch._inductor.triton_bundler import TritonBundler

    triton = tmp_path / "triton"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(triton))
    (triton / "old").mkdir(parents=True)
    (triton / "old" / "k.cubin").write_bytes(b"from before")

    def emit(bundle):  # stands for torch writing a carried kernel into Triton's cache
        (triton / "carried").mkdir()
        (triton / "carried" / "k.cubin").write_bytes(b"restored")

    monkeypatch.setattr(TritonBundler, "read_and_emit", staticmethod(emit))
    monkeypatch.setattr(CachingAutotuner, "benchmark_all_configs", lambda self: {"cfg": 1.0})
    counters = _common.KernelCounters()
    assert counters.missing == []
    TritonBundler.read_and_emit(None)
    (triton / "built").mkdir()
    (triton / "built" / "k.cubin").write_bytes(b"compiled here")
    (triton / "tmp.123").mkdir()  # Triton's unfinished writes do not count
    (triton / "tmp.123" / "k.cubin").write_bytes(b"half")
    assert CachingAutotuner.benchmark_all_configs(object()) == {"cfg": 1.0}
    read = counters.read()
    assert (read["triton_compiled"], read["triton_restored"], read["autotune_benchmarks"]) == (1, 1, 1)


def test_remote_section_shows_the_emulator_rows_paired_ratios_and_their_clients(tmp_path):
    side = {"ttfo_s": 2.0, "ttfo_samples": [2.0], "process_s": 9.0, "fxgraph_miss": 0,
            "fxgraph_hit": 3, "bytes_moved": 100000, "remote_errors": 0}
    gcs = {**side, "ttfo_s": 2.2, "ratio": 1.1, "paired_ratio": 1.08, "paired_ratios": [1.05, 1.08, 1.2],
           "goal_met": False}
    azure = {**side, "ttfo_s": 2.06, "ratio": 1.03, "paired_ratio": 1.01, "paired_ratios": [1.01],
             "goal_met": True, "bytes_moved": 77777}
    probe = {"client": "gcsfs", "import_s": 0.4, "make_s": 0.05, "first_request_s": 0.03, "s3fs_imported": False}
    data = {"benchmark": "remote", "machine": MACHINE, "seq": 128, "repeats": 3, "goal": 1.05,
            "run": {"command": "python benchmarks/bench_remote.py --json", "date": "2025-01-01"},
            "rows": [{"model": "4x256", "cold_ttfo_s": 30.0, "dir": side, "s3": {**side, "ttfo_s": 2.05},
                      "gcs": gcs, "azure": azure, "ratio": 1.025, "goal_met": True}],
            "client_imports": {"gcs": probe, "azure": {**probe, "client": "adlfs", "import_s": 0.7}}}
    text = _remote_section(tmp_path, data)
    assert "GCS (gcp-storage-emulator, 127.0.0.1)" in text and "Azure Blob (Azurite, 127.0.0.1)" in text
    assert "77,777" in text and "1.100 / 1.080" in text
    assert "GCS emulator / directory TTFO, 4x256: **1.10x** (not met)" in text
    assert "median of the paired ratios 1.08 (1.05, 1.08, 1.2)" in text
    assert "Azurite / directory TTFO, 4x256: **1.03x** (met)" in text
    assert "gcs client on a fresh node (gcsfs): import 0.400 s" in text
    assert "azure client on a fresh node (adlfs): import 0.700 s" in text
