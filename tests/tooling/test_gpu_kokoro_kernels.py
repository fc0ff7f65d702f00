"""benchmarks/gpu_kokoro.py's kernel breakdown, on the CPU: a profiled decode's kernels
sorted into what a cheaper vocoder would have to save on (convolutions, GEMMs, the iSTFT's
FFT, Inductor's fused kernels, the rest), with the top kernels by time."""

from __future__ import annotations

import bench_scripts


def test_a_decodes_kernels_are_told_apart_by_kind_with_the_top_ones_named() -> None:
    gk = bench_scripts.load("gpu_kokoro", beside=True)
    kernels = [
        ("sm90_xmma_fprop_implicit_gemm_tf32f32_tf32f32_f32_nhwckrsc_nchw", 40.0, 100),
        ("void cudnn::engines_precompiled::nchwToNhwcKernel<float>", 10.0, 300),
        ("triton_poi_fused_add_leaky_relu_mul_0", 30.0, 500),
        ("sm90_xmma_gemm_f32f32_tf32f32_f32_tn_n_tilesize64x64", 5.0, 20),
        ("void regular_fft<256u, EPT_16>", 5.0, 4),
        ("void at::native::elementwise_kernel<128, 2>", 10.0, 50),
    ]
    got = gk.kernel_breakdown(kernels, top=3)
    assert got["kinds_ms"] == {"conv": 50.0, "triton": 30.0, "other": 10.0, "gemm": 5.0, "fft": 5.0}
    assert got["kinds_pct"]["conv"] == 50.0 and sum(got["kinds_pct"].values()) == 100.0
    assert [k["kind"] for k in got["top"]] == ["conv", "triton", "conv"]
    assert got["top"][0] == {"name": kernels[0][0], "ms": 40.0, "calls": 100, "kind": "conv"}
    assert gk.kernel_breakdown([]) == {"kinds_ms": {}, "kinds_pct": {}, "top": []}
    # The decode table shows each kind's share beside the variant's figures.
    row = {"variant": "compile+graphs", "clauses": 32, "groups": 3, "audio_s": 120.8, "decode_ms": 104.3,
           "kernel_ms": 97.0, "audio_s_per_s": 1158.0, "captures": 3, "kernels": got}
    assert "conv 50.0% triton 30.0%" in gk.decode_table([row])
