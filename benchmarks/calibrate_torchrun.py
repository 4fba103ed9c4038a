"""`attnopt.calibrate` under torchrun: every rank passes the same batches and trains on its share.

    torchrun --nproc_per_node=2 benchmarks/calibrate_torchrun.py                 # 2 CPU processes, gloo
    torchrun --nproc_per_node=8 benchmarks/calibrate_torchrun.py --backend nccl  # one 8-GPU node

On real MiniLM (256-token passages of benchmarks/data/passages.txt, first half calibration, second half
held out) it checks that every rank ends with identical trained tensors and the same held-out mean
embedding cosine, and rank 0 writes the current result, benchmarks/results/calibrate_torchrun/<machine>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", default="linear+window:64")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--backend", default="gloo")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--out", default=None, help="JSON path (default: the current result file, "
                    "benchmarks/results/calibrate_torchrun/<machine>.json)")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import torch.distributed as dist

    import attnopt
    from attnopt.calibration.targets import site_modules
    from attnopt.calibration.train import trainable_tensors

    sys.path.insert(0, str(ROOT))
    import fidelity

    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(args.threads)
    model, cal, held = fidelity.minilm_data(40, 40)
    ref = fidelity.embeddings(model, held)
    opt = attnopt.compile(model, args.policy, example_inputs=cal[0], tolerance=10.0, e2e_tolerance=None)
    before = fidelity.encoder_scores(ref, fidelity.embeddings(opt, held))
    start = time.perf_counter()
    attnopt.calibrate(opt, cal, held_out=held[:1], steps=args.steps, lr=args.lr, progress=rank == 0)
    seconds = time.perf_counter() - start
    after = fidelity.encoder_scores(ref, fidelity.embeddings(opt, held))
    # Largest difference of any trained tensor from rank 0's copy, over all ranks.
    worst = torch.zeros(1, dtype=torch.float64)
    for m in site_modules(opt).values():
        for t in trainable_tensors(m).values():
            mine = t.detach().clone()
            dist.broadcast(mine, src=0)
            worst = torch.maximum(worst, (t.detach() - mine).abs().max().double().reshape(1))
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    per_rank = [None] * world
    dist.all_gather_object(per_rank, {"rank": rank, "after": after, "seconds": round(seconds, 1)})
    if rank == 0:
        result = {"policy": args.policy, "world_size": world, "backend": args.backend, "steps": args.steps,
                  "threads_per_rank": args.threads, "calibration_texts": 4 * len(cal), "held_out_texts": 4 * len(held),
                  "before": before, "per_rank_after": per_rank, "max_abs_tensor_difference_across_ranks": float(worst)}
        from resultfile import write_result  # benchmarks/ is on sys.path when run as a script

        print(json.dumps(result, indent=1))
        # The launcher's other options (--standalone, --nnodes) are not visible from here.
        print("wrote", write_result("calibrate_torchrun", result, path=args.out,
                                    launcher=f"torchrun --nproc_per_node={world}"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
