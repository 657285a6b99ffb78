"""Registers, shared memory and main-loop instructions of the grouped W4A4 GEMM at the batch-64
rollout's MoE (64 tokens x top-8 over 64 experts, rows gathered, RAC 0.5) for the kernel
registry's tile variants, compiled offline for sm_90, and the programs (and warps) an H100 SM
can hold with them: 64K registers and 228 KB of shared memory an SM.
Usage: PYTHONPATH=. JAX_PLATFORMS=cpu python occupancy.py TRITON_PYTHON"""
import subprocess
import sys
import tempfile

sys.path.insert(0, "benchmarks")
import sass_offline as S  # noqa: E402

SHARED = ("import sys, triton\nfrom triton.backends.compiler import GPUTarget\n"
          "k = triton.compile(sys.argv[1], target=GPUTarget('cuda', 90, 32), options={'num_warps': int(sys.argv[2]), 'num_stages': int(sys.argv[3])})\n"
          "print(k.metadata.shared)")
captured = S.capture_ttir()
import jax  # noqa: E402

variants = {"default (bm16 bn128 bk128 w8 s4)": {}, "bn128 w4 s4": dict(num_warps=4), "bn128 w8 s3": dict(num_stages=3),
            "bn128 w4 s2": dict(num_warps=4, num_stages=2), "bn256 w8 s3": dict(block_n=256, num_stages=3),
            "bn128 bk256 w4 s3": dict(block_k=256, num_warps=4, num_stages=3), "bn64 w4 s4": dict(block_n=64, num_warps=4)}
tmp = tempfile.mkdtemp()
print("| tiles | registers | shared KB | loop instructions | per value | programs / SM by registers | by shared memory | warps / SM |")
print("|---|---|---|---|---|---|---|---|")
for i, (name, ov) in enumerate(variants.items()):
    [(case, lower, cfg, values)] = [c for c in S.cases(ov) if c[0] == "grouped 64 tok 1024x1024 rho0.5, rows gathered"]
    jax.clear_caches()
    lower()
    path = f"{tmp}/k{i}.ttir"
    err, regs, stack, sass = S.compile_ttir(sys.argv[1], captured[-1], path, cfg.num_warps, cfg.num_stages)
    if err:
        print(f"| {name} | error: {err[-200:]} |")
        continue
    # the dynamic shared memory Triton launches the kernel with (the pipeline's buffers)
    shared = int(subprocess.run([sys.argv[1], "-c", SHARED, path, str(cfg.num_warps), str(cfg.num_stages)],
                                capture_output=True, text=True).stdout.split()[-1])
    n, body = S.main_loop(sass)
    threads = 32 * cfg.num_warps
    by_regs = 65536 // (max(regs, 24) * threads)
    by_smem = 228 * 1024 // (shared + 1024)  # 1 KB reserved a block
    progs = min(by_regs, by_smem, 64 // cfg.num_warps)
    print(f"| {name} | {regs} | {shared / 1024:.1f} | {n} | {n / values:.2f} | {by_regs} | {by_smem} | {progs * cfg.num_warps} |", flush=True)
