import torch, sys
from tests.distributed.test_graphed_blocks import config, twins, batch, BATCH, SEQ
from tpflash.models import GPT
dev = torch.device("cuda")
for amp_on in (False, True):
  for n_embd, n_head in ((32, 4), (256, 4)):
    for mbs in (1, 2):
        cfg = config(False)
        cfg = type(cfg)(**{**cfg.__dict__, "n_embd": n_embd, "n_head": n_head}) if n_embd != 32 else cfg
        g, e = twins(cfg, dev)
        ctx = lambda: torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp_on)
        with ctx():
            g.capture_cuda_graphs(BATCH, SEQ)
        for m in (g, e):
            for mb in range(mbs):
                idx, t = batch(mb, dev)
                with ctx():
                    loss = m(idx, t)
                loss.backward()
                print(f"  loss {loss.item():.6f}", end="")
        torch.cuda.synchronize()
        errs = []
        for (n, p), q in zip(g.named_parameters(), e.parameters()):
            err = ((p.grad.double() - q.grad.double()).norm() / q.grad.double().norm()).item()
            errs.append((err, n, p.grad.norm().item(), q.grad.norm().item()))
        bad = [x for x in errs if x[0] > 1e-2]
        print(f"\namp={amp_on} n_embd={n_embd} mbs={mbs}: {len(bad)}/{len(errs)} bad; worst {max(errs)[:4]}")
        for x in bad[:6]:
            print("   ", x)
