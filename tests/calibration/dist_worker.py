"""Run by test_calibrate_distributed.py under `python -m torch.distributed.run --nproc_per_node=2` (gloo, CPU).

Each rank compiles the trained tiny LM, calibrates it on its share of the same batches, and writes
its trained tensors and held-out numbers to OUT/rank<r>.*; rank 0 also writes the checkpoint.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

import attnopt
from attnopt.calibration.distributed import average_gradients_, current_world
from attnopt.calibration.targets import site_modules
from attnopt.calibration.train import trainable_tensors

TINY_LM = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "tiny_lm"


def main(out: Path) -> None:
    import transformers

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    world = current_world()
    # The averaging itself: rank r contributes r + 1, every rank must read the mean.
    probe = torch.zeros(3, requires_grad=True)
    probe.grad = torch.full((3,), float(world.rank + 1))
    average_gradients_([probe], world)
    model = transformers.LlamaForCausalLM.from_pretrained(TINY_LM).eval()
    text = (TINY_LM / "heldout.txt").read_text(encoding="utf-8").encode("utf-8")
    ids = torch.tensor(list(text[: 10 * 128]), dtype=torch.long).reshape(10, 128)
    batches = [{"input_ids": ids[i : i + 1]} for i in range(8)]
    held = [{"input_ids": ids[8:10]}]
    opt = attnopt.compile(model, "linear+window:16+fit_steps:5", example_inputs=batches[0], tolerance=10.0, e2e_tolerance=None)
    attnopt.calibrate(opt, batches, held_out=held, steps=12, progress=False, checkpoint=str(out / "checkpoint"))
    tensors = {f"{sid}/{n}": t.contiguous() for sid, m in site_modules(opt).items() for n, t in trainable_tensors(m).items()}
    save_file(tensors, str(out / f"rank{world.rank}.safetensors"))
    cal = opt.attnopt_report.calibration
    (out / f"rank{world.rank}.json").write_text(json.dumps({
        "world_size": cal["world_size"], "probe": probe.grad.tolist(), "train_batches": cal["train_batches"],
        "before": cal["end_to_end_before"]["worst"]["rel_rms"], "after": cal["end_to_end_after"]["worst"]["rel_rms"],
        "curves": [s["curve"] for s in cal["sites"]]}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
