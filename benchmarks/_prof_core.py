import torch, sys, os
sys.path.insert(0, os.getcwd())
from vllm_ddtree.tree import build_tree, walk_tree, tree_layout
from torch.profiler import profile, ProfilerActivity
V, D = 151936, 15
for R, B in [(1, 64), (64, 64)]:
    logits = torch.randn(R, D, V, device="cuda").bfloat16()
    tgt = torch.randint(0, V, (R, B + 1), device="cuda")
    root = torch.zeros(R, dtype=torch.long, device="cuda")
    def step():
        t = build_tree(logits, B); walk_tree(t, tgt); tree_layout(t, root)
    for _ in range(3): step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step(); torch.cuda.synchronize()
    ev = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    tot = sum(e.device_time_total for e in ev)
    n = sum(e.count for e in ev)
    print(f"R={R} B={B}: {n} kernels, GPU busy {tot/1000:.3f} ms")
    for e in sorted(ev, key=lambda e: -e.device_time_total)[:12]:
        print(f"  {e.device_time_total/1000:8.3f} ms  x{e.count:4d}  {e.key[:90]}")
