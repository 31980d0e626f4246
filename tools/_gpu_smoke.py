import os, time, sys
pass
import torch
from miniinfer.model.transformer import ModelConfig, Transformer
from miniinfer.worker.paged_cache import PagedKVCache
from miniinfer.kernels.persistent import PersistentDecode
torch.manual_seed(0)
kind = sys.argv[1] if len(sys.argv) > 1 else "llama"
cfg = ModelConfig(vocab_size=200, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=16, rope_theta=10000.0, qkv_bias=kind == "qwen2", qk_norm=kind == "qwen3", rms_norm_eps=1e-6)
m = Transformer(cfg)
with torch.no_grad():
    for p in m.parameters():
        p.normal_(0, 0.3) if p.dim() > 1 else p.copy_(1 + 0.1 * torch.randn_like(p))
m.eval()
bs = 3
m = m.cuda(); cache = PagedKVCache(cfg, 16, bs, device="cuda")
table = [5, 2, 9, 7, 1]
prompt = [3, 17, 42, 8, 99, 120, 7]
with torch.no_grad():
    logits = cache.run(m, [prompt], [table], [0])
    pd = PersistentDecode(m, cache.k, cache.v, bs, programs=int(sys.argv[2]), tile=256, num_warps=4)
    tok = int(logits[0].argmax())
    n = len(prompt)
    for i in range(4):
        slot = table[n // bs] * bs + n % bs
        t0 = time.time()
        got = pd.step(torch.tensor([tok], dtype=torch.int32, device="cuda"), torch.tensor([n], dtype=torch.int32, device="cuda"), torch.tensor([slot], dtype=torch.int32, device="cuda"),
                      torch.tensor([n + 1], dtype=torch.int32, device="cuda"), torch.tensor(table, dtype=torch.int32, device="cuda")).clone()
        dt = time.time() - t0
        kp = cache.k.clone()
        want = cache.run(m, [[tok]], [table], [n])
        print(kind, i, f"{(got - want).abs().max().item():.2e}", got.argmax().item() == want.argmax().item(), f"{dt:.1f}s",
              f"k diff {(kp - cache.k).abs().max().item():.1e}")
        tok = int(want[0].argmax()); n += 1
