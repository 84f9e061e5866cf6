"""Pinned host <-> GPU copy bandwidth, and how much of a copy on a side stream hides behind matmuls: the bound on
activation offloading (BENCHMARKS.md, "The image's kernels"). 2.7 GiB is what one kept 27B-width layer adds
at a 32k block (the levers section: +5.4 GiB for two kept layers).

H200: python3 benchmarks/host_copy_gpu.py     (the code run on 2026-12-01 13:53 UTC, there inline)
"""

import time

import torch


def main() -> None:
    n = int(2.7 * 2**30) // 2
    g = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    h = torch.empty(n, dtype=torch.bfloat16, pin_memory=True)

    def t(fn, r=5):
        fn()
        torch.cuda.synchronize()
        s = time.perf_counter()
        for _ in range(r):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - s) / r

    d2h = t(lambda: h.copy_(g, non_blocking=True))
    h2d = t(lambda: g.copy_(h, non_blocking=True))
    a = torch.randn(16384, 16384, device="cuda", dtype=torch.bfloat16)
    mm = t(lambda: a @ a)
    side = torch.cuda.Stream()

    def both():
        with torch.cuda.stream(side):
            h.copy_(g, non_blocking=True)
        for _ in range(8):
            a @ a

    over = t(both)
    print(f"2.7 GiB pinned: D2H {d2h*1e3:.1f} ms ({2.7/d2h:.1f} GiB/s), H2D {h2d*1e3:.1f} ms ({2.7/h2d:.1f} GiB/s); "
          f"16k^3 bf16 matmul {mm*1e3:.2f} ms; 8 matmuls + one D2H on a side stream {over*1e3:.1f} ms vs "
          f"{8*mm*1e3:.1f} + {d2h*1e3:.1f} apart")


if __name__ == "__main__":
    main()
