"""Variants: disable_eagle_block_drop=True, and k=3 (num_speculative_blocks=3); block 256."""
import random, sys
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
from eagle_hits import Engine
rng = random.Random(1)
for pmu in (None, 64):
    for n in (300, 768, 1000, 1024, 1100):
        row = []
        for label, kw in (("off", dict(eagle=False)), ("mtp k=1", dict(eagle=True)),
                          ("mtp k=3", dict(eagle=True, k=3)),
                          ("mtp k=1 disable_eagle_block_drop", dict(eagle=True, block_drop=False))):
            eng = Engine(pmu=pmu, ckpt=False, budget=2048, **kw)
            p = [rng.randrange(1, 30000) for _ in range(n)]
            eng.run(p)
            h, _ = eng.run(p)
            row.append(f"{label}={h}")
        print(f"pmu={pmu or 256} N={n}: " + ", ".join(row), flush=True)
