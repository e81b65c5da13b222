"""Run under `mlx.launch -n 2`: the embedded model pipelined over the ranks with each hand-off
(send/recv, and the all_sum form used where a backend has no send/recv) and on one device;
rank 0 prints whether all three give bit-identical logits for a prompt and a decode step
evaluated together (tests/test_distributed.py)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from lockstep.models.load import load_model  # noqa: E402
from lockstep.server.distributed.pipeline import pipeline_llama  # noqa: E402


def run(model):
    cache = make_prompt_cache(model)
    prompt = model(mx.array([[1, 2, 3, 4, 5]]), cache=cache)
    step = model(mx.array([[7]]), cache=cache)
    mx.eval(prompt, step)  # two forwards in one evaluation: their hand-offs must not interleave
    return prompt, step


group = mx.distributed.init()
outputs = {}
for handoff in ("sendrecv", "all_sum"):
    loaded = load_model("default", weights="float32")
    pipeline_llama(loaded.model, group, handoff=handoff)
    outputs[handoff] = run(loaded.model)
if group.rank() == 0:
    alone = run(load_model("default", weights="float32").model)
    same = all(mx.array_equal(a, b).item() and mx.array_equal(a, c).item()
               for a, b, c in zip(alone, outputs["sendrecv"], outputs["all_sum"]))
    print(f"handoffs bit-identical to one device: {same}")
