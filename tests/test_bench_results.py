"""The benchmarks' plumbing (no timing here: speed targets live in benchmarks/ only): the result
lines every benchmark writes, the final table `make bench` prints from them, and the process
environments bench_step gives its contenders."""
from __future__ import annotations

import io
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import _settings  # noqa: E402
import _targets  # noqa: E402
import summary  # noqa: E402
from accelerate_c import host_malloc  # noqa: E402


def test_targets_are_written_as_json_lines_only_when_asked(tmp_path, monkeypatch):
    monkeypatch.delenv(_targets.ENV, raising=False)
    assert _targets.target("bench_x", "a", 1.2, 1.0)
    assert not list(tmp_path.iterdir())
    monkeypatch.setenv(_targets.ENV, str(tmp_path))
    assert _targets.target("bench_x", "speed vs them", 1.2, 1.0, limit="10 GB/s")
    assert not _targets.target("bench_x", "share of the limit", 0.5, 0.7, unit="%")
    _targets.info("bench_x", "vs torch", 0.97, note="why")
    rows = [json.loads(ln) for ln in (tmp_path / "bench_x.jsonl").read_text().splitlines()]
    assert [r["status"] for r in rows] == ["PASS", "MISS", "INFO"]
    assert rows[0]["limit"] == "10 GB/s" and rows[2]["goal"] is None and rows[2]["note"] == "why"


def test_only_the_latest_run_of_a_benchmark_counts(tmp_path):
    lines = [{"bench": "b", "run": run, "what": w, "value": 1.0, "unit": "x", "goal": 1.0, "status": "PASS",
              "limit": "", "note": ""} for run, w in (("1", "old"), ("2", "new"), ("2", "new too"))]
    (tmp_path / "b.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert [r["what"] for r in _targets.load(str(tmp_path))] == ["new", "new too"]


def test_the_summary_lists_every_target_and_every_failed_benchmark(tmp_path, monkeypatch):
    monkeypatch.setenv(_targets.ENV, str(tmp_path))
    _targets.target("bench_ok", "ratio", 1.25, 1.0, limit="21.3 GB/s read+write")
    _targets.target("bench_crashed", "ratio", 0.9, 1.0)
    _targets.info("bench_ok", "vs torch", 0.95, note="the gap, explained")
    for bench, rc in (("bench_ok", 0), ("bench_crashed", 1), ("bench_silent", 0)):
        (tmp_path / f"{bench}{summary.STATUS_SUFFIX}").write_text(json.dumps({"exit": rc, "seconds": 3.0, "cmd": ""}))
    out = io.StringIO()
    assert summary.summarize(str(tmp_path), file=out) == 2  # bench_crashed (exit 1), bench_silent (no targets)
    text = out.getvalue()
    assert "1 PASS, 1 MISS, 2 benchmark(s) failed" in text
    ok_row = next(ln for ln in text.splitlines() if ln.startswith("bench_ok") and "ratio" in ln)
    assert "1.250x" in ok_row and ">= 1.00x" in ok_row and "21.3 GB/s" in ok_row and ok_row.endswith("PASS")
    assert "[1] the gap, explained" in text
    assert "ERROR: exit status 1" in text and "ERROR: recorded no target" in text


def test_the_tables_environments_differ_only_in_the_malloc_settings():
    base = {"PATH": "/bin", "MALLOC_ARENA_MAX": "2", "MALLOC_TRIM_THRESHOLD_": "5",
            "GLIBC_TUNABLES": "glibc.malloc.top_pad=1:glibc.cpu.hwcaps=-AVX512F", host_malloc.ENV: "1"}
    defaults = _settings.process_env("defaults", base)
    tuned = _settings.process_env("tuned", base)
    assert defaults == {"PATH": "/bin", "GLIBC_TUNABLES": "glibc.cpu.hwcaps=-AVX512F", host_malloc.ENV: "0"}
    assert tuned == {**defaults, **{k: str(v) for k, v in host_malloc.GLIBC_ENV.items()}}
    assert _settings.process_env("defaults", {"GLIBC_TUNABLES": "glibc.malloc.top_pad=1"}) == {host_malloc.ENV: "0"}
    assert _settings.parse("tuned,defaults") == ("defaults", "tuned")
    with pytest.raises(ValueError, match="--settings"):
        _settings.parse("fast")


def test_the_glibc_variables_are_the_opt_ins_values():
    assert list(host_malloc.GLIBC_ENV.values()) == list(host_malloc.SETTINGS.values())
    assert set(host_malloc.GLIBC_ENV) == {"MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_"}
