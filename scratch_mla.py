import torch
from engine.kernels import mla_decode as md
torch.manual_seed(0)
dev = "cuda"
H, C, R = 16, 512, 64
def timeit(f):
    f(); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(50): f()
    g.replay(); torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
    e0.record()
    for _ in range(10): g.replay()
    e1.record(); torch.cuda.synchronize()
    return e0.elapsed_time(e1) / 500 * 1e3
for ctx in (640, 1024):
    B = 1
    kv = torch.randn(B * ctx + 10, 1, C + R, device=dev, dtype=torch.bfloat16)
    q = torch.randn(B, H, C + R, device=dev, dtype=torch.bfloat16)
    r2t = torch.arange(B * ctx, device=dev, dtype=torch.int32).view(B, ctx) + 1
    rows = torch.arange(B, device=dev)
    lens = torch.full((B,), ctx, device=dev, dtype=torch.int32)
    for bn, st in ((64, 3), (32, 2), (32, 3), (16, 2)):
        cfg = md.MLADecodeConfig(16, bn, 4, st)
        line = []
        for s in (2, 4, 5, 8, 10, 16, 20):
            if ctx / s < bn: continue
            t = timeit(lambda: md.mla_decode(q, kv, r2t, rows, lens, C, 0.1, num_kv_splits=s, config=cfg))
            line.append(f"{s}:{t:.2f}")
        print(f"ctx={ctx} block_n={bn} stages={st}", " ".join(line), flush=True)
