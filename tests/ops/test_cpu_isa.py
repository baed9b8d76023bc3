"""ISA tiers (kvserve.ops.cpu_isa): detection, KVSERVE_CPU_ISA, the fallback without a compiler,
and every kernel + dtype="auto" on every tier the host supports (the host's best tier runs in
this process; each other one in a pytest subprocess). Tiers above the host's are compile-checked
(built, not loaded) where the compiler can target them."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from kvserve.config import resolve_weight_dtype
from kvserve import envs
from kvserve.ops import build, cpu_isa

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HAS_COMPILER = shutil.which(os.environ.get("CXX", "c++")) is not None
AVX2 = {"avx2", "fma", "f16c"}
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
HAS_ONEDNN = torch.backends.mkldnn.is_available()
x86_only = pytest.mark.skipif(not cpu_isa.is_x86_64(), reason="ISA tiers are for x86-64")


@x86_only
def test_tiers_from_flags() -> None:
    assert cpu_isa.supported_tiers(frozenset({"sse2"})) == ["generic"]
    assert cpu_isa.supported_tiers(frozenset(AVX2 - {"f16c"})) == ["generic"]   # all three
    assert cpu_isa.supported_tiers(frozenset(AVX2)) == ["generic", "avx2"]
    assert cpu_isa.supported_tiers(frozenset(AVX512 | {"avx512_bf16", "avx512_vnni"})) == \
        list(cpu_isa.TIERS)
    # The bf16 tier builds the int8 kernels with vpdpbusd: VNNI is part of it.
    assert cpu_isa.supported_tiers(frozenset(AVX512 | {"avx512_bf16"}))[-1] == "avx512"
    assert cpu_isa.supported_tiers(frozenset(AVX2 | {"avx512f"})) == ["generic", "avx2"]


@x86_only
def test_forced_tier(monkeypatch: pytest.MonkeyPatch) -> None:
    host = cpu_isa.supported_tiers()
    for tier in host:
        monkeypatch.setenv(cpu_isa.ISA_ENV, tier)
        assert cpu_isa.selected_tier() == tier
    monkeypatch.setenv(cpu_isa.ISA_ENV, "avx3")
    with pytest.raises(ValueError, match="KVSERVE_CPU_ISA must be one of auto, generic"):
        cpu_isa.selected_tier()
    with pytest.raises(ValueError, match="not a CPU ISA tier"):
        cpu_isa.resolve_tier("avx3")
    above = [t for t in cpu_isa.TIERS if t not in host]
    if above:
        monkeypatch.setenv(cpu_isa.ISA_ENV, above[0])
        with pytest.raises(ValueError, match="asks for more than this CPU has"):
            cpu_isa.selected_tier()
        from kvserve.ops import load_cpu_kernels     # an error at start-up, not a fallback
        with pytest.raises(ValueError, match=above[0]):
            load_cpu_kernels()
    monkeypatch.delenv(cpu_isa.ISA_ENV)
    assert cpu_isa.selected_tier() == host[-1]


@x86_only
def test_configured_settings_win_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker applies the engine config's CpuConfig: its tier and kernel switch, not the
    variables (read only as the config's defaults)."""
    from kvserve.config import CpuConfig
    from kvserve.ops import linear
    monkeypatch.setenv(cpu_isa.ISA_ENV, "generic")
    monkeypatch.setenv(build.DISABLE_ENV, "true")
    assert cpu_isa.selected_tier() == "generic" and not cpu_isa.kernels_enabled()
    assert not linear.packing_works(torch.float32)      # one switch: no oneDNN packing either
    cfg = CpuConfig(cpu_isa="auto", disable_cpu_kernels=False)
    assert cfg.cpu_huge_pages == "auto"                 # the variable's default
    try:
        cpu_isa.configure(cfg)
        assert cpu_isa.selected_tier() == cpu_isa.supported_tiers()[-1]
        assert cpu_isa.kernels_enabled() and linear.packing_works(torch.float32) == HAS_ONEDNN
    finally:
        cpu_isa.configure(None)
    with pytest.raises(ValueError, match="cpu_huge_pages must be one of auto, on, off"):
        CpuConfig(cpu_isa="auto", disable_cpu_kernels=False, cpu_huge_pages="1")


@x86_only
def test_auto_dtype_follows_the_tier(monkeypatch: pytest.MonkeyPatch) -> None:
    bf16_ckpt, f32_ckpt = {"torch_dtype": "bfloat16"}, {"torch_dtype": "float32"}
    monkeypatch.setenv(cpu_isa.ISA_ENV, "generic")       # no bf16 math
    assert resolve_weight_dtype("auto", bf16_ckpt, "cpu") == torch.bfloat16
    assert resolve_weight_dtype("auto", {"torch_dtype": "float16"}, "cpu") == torch.float16
    assert resolve_weight_dtype("auto", f32_ckpt, "cpu") is None
    assert resolve_weight_dtype("bfloat16", bf16_ckpt, "cpu") is None   # explicit: as before
    assert resolve_weight_dtype("auto", bf16_ckpt, "cuda") is None
    if "avx512_bf16" in cpu_isa.supported_tiers():
        monkeypatch.setenv(cpu_isa.ISA_ENV, "avx512_bf16")
        assert resolve_weight_dtype("auto", bf16_ckpt, "cpu") is None
        # The config's tier (--cpu-isa), not the process's.
        assert resolve_weight_dtype("auto", bf16_ckpt, "cpu", "avx2") == torch.bfloat16


NO_COMPILER_SCRIPT = textwrap.dedent("""
    import logging, sys, torch
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    from kvserve import LLM, SamplingParams
    from kvserve.ops import fused, linear, load_cpu_kernels, paged_attention, prefill_attention
    load_cpu_kernels()
    assert all(get() is None for get in (fused.cpu_kernel, linear.cpu_kernel,
               paged_attention.cpu_kernel, prefill_attention.cpu_kernel))
    x, w = torch.randn(3, 64), torch.randn(64)
    assert torch.equal(fused.rms_norm(x, w, 1e-6), fused.rms_norm_torch(x, w, 1e-6))
    out = LLM(sys.argv[1], dtype="auto", max_model_len=128, kv_cache_memory=8 << 20).generate(
        {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=4, temperature=0.0),
        use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    print("NO_COMPILER_OK")
""")


def test_no_compiler_one_warning_and_torch_fallbacks(make_checkpoint, tmp_path) -> None:
    """CXX pointing at a missing binary (a user without a compiler): one warning per process for
    all the kernels, the torch paths, a working engine -- never a crash."""
    path = make_checkpoint("llama", save_dtype=torch.bfloat16)
    env = dict(os.environ, CXX=str(tmp_path / "no-such-c++"),
               KVSERVE_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=REPO)
    env.pop("TORCH_EXTENSIONS_DIR", None)
    env.pop(build.DISABLE_ENV, None)
    proc = subprocess.run([sys.executable, "-c", NO_COMPILER_SCRIPT, path], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "NO_COMPILER_OK" in proc.stdout, proc.stderr[-3000:]
    warnings = [ln for ln in proc.stderr.splitlines() if "C++ CPU kernels unavailable" in ln]
    # Once per process that loads kernels: this script's and the engine core's.
    engine = [ln for ln in warnings if "EngineCore" in ln]
    assert len(engine) == 1 and len(warnings) == 2, proc.stderr[-3000:]
    assert all("no C++ compiler" in ln and "no-such-c++" in ln for ln in warnings)


ALL_OTHER_TIERS = [t for t in cpu_isa.supported_tiers() if t != cpu_isa.selected_tier()] \
    if cpu_isa.is_x86_64() and not os.environ.get(cpu_isa.ISA_ENV) else []
# Each tier rebuilds every kernel (~2 min on 2 cores): by default the one most CPUs below this
# host run (avx2, else generic); every lower tier with KVSERVE_TEST_FULL=1.
OTHER_TIERS = ALL_OTHER_TIERS if envs.get("KVSERVE_TEST_FULL") else \
    [t for t in ("avx2", "generic") if t in ALL_OTHER_TIERS][:1]


@pytest.mark.timeout(1500)     # builds every kernel for that tier first (~10-30 s each)
@pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler")
@pytest.mark.parametrize("tier", OTHER_TIERS or [pytest.param(None, marks=pytest.mark.skip(
    reason="the host supports one tier only, or KVSERVE_CPU_ISA is set"))])
def test_other_tier_runs_every_kernel(tier: str) -> None:
    """The kernels' and dtype="auto"'s tests once more on a lower tier (forced with
    KVSERVE_CPU_ISA) -- what an AVX2 or older CPU runs."""
    env = dict(os.environ, **{cpu_isa.ISA_ENV: tier})
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
         "tests/ops/test_tier_kernels.py", "tests/test_auto_dtype.py",
         "tests/model/test_tiled_weights.py::test_tiled_kernel_matches_plain"],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and " failed" not in proc.stdout


ALL_ABOVE_HOST = [t for t in cpu_isa.TIERS if t not in cpu_isa.supported_tiers()] \
    if cpu_isa.is_x86_64() else []
# The top tier's flags are a superset of the ones below it: by default only it is compiled.
ABOVE_HOST = ALL_ABOVE_HOST if envs.get("KVSERVE_TEST_FULL") else ALL_ABOVE_HOST[-1:]


@pytest.mark.timeout(900)
@pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler")
@pytest.mark.parametrize("tier", ABOVE_HOST or [pytest.param(None, marks=pytest.mark.skip(
    reason="the host runs every tier: they are tested, not only compiled"))])
def test_tiers_above_the_host_compile(tier: str) -> None:
    """This CPU cannot run these tiers (their tests skip here), but their code must still
    compile: every kernel source with the tier's flags, no linking or loading."""
    from torch.utils import cpp_extension
    incs = [f"-I{p}" for p in cpp_extension.include_paths()]

    def compile_one(source) -> tuple[str, subprocess.CompletedProcess]:
        cmd = [os.environ.get("CXX", "c++"), "-std=c++17", "-fsyntax-only", "-fopenmp",
               *cpu_isa.tier_cflags(tier), *incs, f"-D_GLIBCXX_USE_CXX11_ABI="
               f"{int(torch._C._GLIBCXX_USE_CXX11_ABI)}", str(source)]
        return source.name, subprocess.run(cmd, capture_output=True, text=True, timeout=300)

    # One compiler per core: the sources are independent.
    with ThreadPoolExecutor(max(1, min(4, os.cpu_count() or 1))) as pool:
        for name, proc in pool.map(compile_one, sorted(build.CSRC_DIR.glob("*.cpp"))):
            assert proc.returncode == 0, f"{name} [{tier}]: {proc.stderr[-3000:]}"
